"""Property test of the staleness bound (DESIGN.md §2) over random interleavings.

A hypothesis state machine drives one buffer with replicas that admit, cancel and put groups
stamped with the replica's (lagging) weight version, possibly spanning weight swaps, and a
learner that takes B groups per step, acks them and bumps its version. After every step:

- no taken group is older than eta, none is delivered twice, each batch is oldest first;
- admission admits exactly while started < (V + eta + 1) * B;
- every slot is accounted for: started == consumed + queued + in_flight, consumed == V * B;
- no deadlock: capacity(V) - consumed >= B, and the ``learner_waits`` rule shows it
  operationally (finish in-flight groups, admit new ones, until the learner is served; a
  refused admission while the learner still waits fails the test);
- with replicas in sync that finish in admission order, nothing is ever dropped;
- a replica that dies (``release`` of its holder) gives back exactly the slots it held, and a
  late put from it still keeps the accounting exact;
- a put that also claims the holder's next slot (``put_and_admit``, sync or from an event loop)
  claims it exactly when ``try_admit`` would have, and ``admit_up_to(n)`` claims exactly as
  many slots as are left, n at most, all counted under the holder.

The same machine runs against the memory backend and (fewer examples) the Redis backend.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from streamrl.buffer.base import Admission, ReplayBuffer
from streamrl.buffer.memory import MemoryBuffer
from streamrl.testing import make_group

Factory = Callable[[int, int], ReplayBuffer]
HOLDERS = st.sampled_from(["", "replica-0.0", "replica-1.0"])


class BufferMachine(RuleBasedStateMachine):
    factory: Factory
    synced: bool = False  # replicas in sync with the learner, finishing in admission order

    def __init__(self) -> None:
        super().__init__()
        self.buf: ReplayBuffer | None = None
        self.version = 0
        # (holder, replica weight version at admission), in admission order
        self.in_flight: list[tuple[str, int]] = []
        self.taken: set[str] = set()
        self.loop = asyncio.new_event_loop()  # for the awaitable calls a replica makes

    @initialize(b=st.integers(1, 3), eta=st.integers(0, 2))
    def start(self, b: int, eta: int) -> None:
        self.b, self.eta = b, eta
        self.adm = Admission(b, eta)
        self.buf = type(self).factory(b, eta)

    # -- replicas -------------------------------------------------------------------------
    def _admit(self, lag: int, holder: str = "") -> bool:
        started = self.buf.stats().started
        ok = self.buf.try_admit(holder)
        assert ok == self.adm.may_start(started, self.version), (started, self.version)
        if ok:
            self.in_flight.append((holder, max(0, self.version - (0 if self.synced else lag))))
        return ok

    @rule(lag=st.integers(0, 4), holder=HOLDERS)
    def admit(self, lag: int, holder: str) -> None:
        self._admit(lag, holder)

    @rule(n=st.integers(1, 4), lag=st.integers(0, 4), holder=HOLDERS, from_loop=st.booleans())
    def admit_up_to(self, n: int, lag: int, holder: str, from_loop: bool) -> None:
        """A replica claims a slot for each of its free ones in one call."""
        started = self.buf.stats().started
        claimed = (self._await(lambda: self.buf.aadmit_up_to(n, holder)) if from_loop
                   else self.buf.admit_up_to(n, holder))
        assert claimed == min(n, self.adm.slots_left(started, self.version)), (n, started)
        weights = max(0, self.version - (0 if self.synced else lag))
        self.in_flight += [(holder, weights)] * claimed

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        holder, _ = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.buf.cancel_admission(holder)

    @rule(holder=HOLDERS, late_put=st.booleans())
    def replica_dies(self, holder: str, late_put: bool) -> None:
        """The supervisor releases a dead replica's slots; a hung one may still put later."""
        held = [entry for entry in self.in_flight if entry[0] == holder]
        self.in_flight = [entry for entry in self.in_flight if entry[0] != holder]
        assert self.buf.release(holder) == len(held)
        if late_put and held and not self.synced:  # synced: nothing may be dropped
            self.buf.put(make_group([held[0][1]]), holder)

    def _finish(self, data: st.DataObject) -> None:
        """A replica puts one in-flight group; weights may have been swapped mid-group."""
        i = 0 if self.synced else data.draw(st.integers(0, len(self.in_flight) - 1))
        holder, start = self.in_flight.pop(i)
        # Tokens after an in-flight swap carry newer versions; the first stays the start view.
        later = data.draw(st.lists(st.integers(start, self.version), max_size=3))
        group = make_group([start, *sorted(later)])
        before = self.buf.stats()
        how = data.draw(st.sampled_from(["put", "put_and_admit", "aput_and_admit"]))
        if how == "put":
            self.buf.put(group, holder)
        else:  # the put settles the holder's slot; the claim is then checked like try_admit
            claimed = (self.buf.put_and_admit(group, holder) if how == "put_and_admit"
                       else self._await(lambda: self.buf.aput_and_admit(group, holder)))
            assert claimed == self.adm.may_start(before.started, self.version), before
            if claimed:
                self.in_flight.append((holder, self.version))
        if data.draw(st.booleans()):
            self.buf.put(group, holder)  # a retried put is a no-op
        assert self.buf.stats().produced == before.produced + 1

    def _await(self, call: Callable[[], Awaitable[Any]]) -> Any:
        async def run() -> Any:
            return await call()
        return self.loop.run_until_complete(run())

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        self._finish(data)

    # -- learner --------------------------------------------------------------------------
    def _learner_step(self) -> bool:
        try:
            groups = self.buf.take(self.b, self.version, timeout=0)
        except TimeoutError:
            return False
        assert len(groups) == self.b
        for g in groups:
            assert g.staleness(self.version) <= self.eta, "took a group older than the bound"
            assert g.group_id not in self.taken, "a group was delivered twice"
            self.taken.add(g.group_id)
        oldest = [g.min_version for g in groups]
        assert oldest == sorted(oldest), "batch not oldest first"
        self.buf.ack([g.group_id for g in groups])
        self.version += 1
        self.buf.set_version(self.version)
        return True

    @rule()
    def learner_step(self) -> None:
        self._learner_step()

    @rule(data=st.data())
    def learner_waits(self, data: st.DataObject) -> None:
        """The learner blocks in take; replicas keep working until it is served."""
        for _ in range(4 * (self.eta + 2) * self.b + 8):
            if self._learner_step():
                return
            if self.in_flight:
                self._finish(data)
            else:
                assert self._admit(lag=0), "deadlock: learner waits, nothing queued or admissible"
        raise AssertionError("learner was not served")

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def accounting(self) -> None:
        if self.buf is None:
            return
        s = self.buf.stats()
        assert s.learner_version == self.version
        assert s.in_flight == len(self.in_flight)
        assert s.consumed == self.version * self.b
        assert s.started == s.consumed + s.queued + s.in_flight, s
        assert s.started <= self.adm.capacity(self.version), s
        assert self.adm.capacity(self.version) - s.consumed >= self.b  # learner can be served
        if self.synced:
            assert s.dropped == 0, s

    def teardown(self) -> None:
        if self.buf is not None:
            purge = getattr(self.buf, "purge", None)
            if purge is not None:
                purge()
            self.buf.close()
        self.loop.close()


def run_machine(factory: Factory, synced: bool, max_examples: int, steps: int) -> None:
    machine = type("Machine", (BufferMachine,), {"factory": staticmethod(factory),
                                                 "synced": synced})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow], database=None,
    ))


@pytest.mark.parametrize("synced", [False, True], ids=["lagging", "synced"])
def test_memory_bound_and_liveness(synced: bool) -> None:
    run_machine(MemoryBuffer, synced, max_examples=150, steps=40)


@pytest.mark.parametrize("synced", [False, True], ids=["lagging", "synced"])
def test_redis_bound_and_liveness(redis_url: str, synced: bool) -> None:
    from streamrl.buffer.redis import RedisBuffer

    def factory(b: int, eta: int) -> ReplayBuffer:
        return RedisBuffer(redis_url, f"prop-{uuid.uuid4().hex[:8]}", b, eta)

    run_machine(factory, synced, max_examples=20, steps=30)
