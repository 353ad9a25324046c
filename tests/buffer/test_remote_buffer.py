"""RemoteBuffer over a real buffer actor: an event loop's puts share actor calls (those of
one pass of the loop, and those made while a call is in flight), and each put keeps its own
result or error."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
from types import SimpleNamespace

from streamrl.buffer.remote import BufferActor, RemoteBuffer, actor_name, start_buffer_actor
from streamrl.testing import make_group


class CountingActor(BufferActor):
    def __init__(self, groups_per_step: int, max_staleness: int) -> None:
        super().__init__(groups_per_step, max_staleness)
        self.calls: list[int] = []  # puts per put_many call

    def put_many(self, puts):  # type: ignore[no-untyped-def]
        self.calls.append(len(puts))
        return super().put_many(puts)

    def put_calls(self) -> list[int]:
        return self.calls


def _buffer(ray, groups_per_step: int, max_staleness: int):  # type: ignore[no-untyped-def]
    actor = ray.remote(num_cpus=0, max_concurrency=8)(CountingActor).remote(
        groups_per_step, max_staleness)
    return actor, RemoteBuffer(actor, "test-buffer")


def test_puts_share_actor_calls(ray_local) -> None:
    actor, buf = _buffer(ray_local, groups_per_step=8, max_staleness=1)  # 16 slots
    assert buf.admit_up_to(6, "r") == 6  # one actor call for all six
    assert buf.try_admit("r") and buf.try_admit("r")

    async def bursts() -> list[bool]:
        first = [buf.aput_and_admit(make_group(0, f"g{i}"), "r") for i in range(3)]
        await asyncio.sleep(0)  # the loop's next pass sends those three together
        rest = [buf.aput_and_admit(make_group(0, f"g{i}"), "r") for i in range(3, 8)]
        return await asyncio.gather(*first, *rest)  # the five went while three were in flight

    claimed = asyncio.run(bursts())
    assert ray_local.get(actor.put_calls.remote()) == [3, 5]
    # Each put settled its own admission and claimed one of the 8 slots left.
    assert claimed == [True] * 8
    stats = buf.stats()
    assert (stats.produced, stats.queued, stats.in_flight) == (8, 8, 8)
    assert [g.group_id for g in buf.take(4, 0, timeout=5)] == [f"g{i}" for i in range(4)]


def test_each_put_keeps_its_own_result_and_error(ray_local) -> None:
    actor, buf = _buffer(ray_local, groups_per_step=2, max_staleness=0)  # 2 slots
    assert buf.try_admit("r")

    async def mixed() -> list[object]:
        return await asyncio.gather(
            buf.aput_and_admit(make_group(0, "a"), "r"),  # claims the second slot
            buf.aput_and_admit("not a group", "r"),  # type: ignore[arg-type]
            buf.aput_and_admit(make_group(0, "b"), "r"),  # settles that claim; none is left
            buf.aput(make_group(0, "a"), "r"),  # again: idempotent
            return_exceptions=True)

    first, bad, second, again = asyncio.run(mixed())
    assert ray_local.get(actor.put_calls.remote()) == [3]  # the non-Group fails before sending
    assert first is True and second is False and again is None
    assert isinstance(bad, TypeError) and "expected a Group, got str" in str(bad)
    assert buf.stats().produced == 2


def test_pickled_copies_put_from_their_own_loops(ray_local) -> None:
    _, buf = _buffer(ray_local, groups_per_step=2, max_staleness=0)
    copy = pickle.loads(pickle.dumps(buf))

    async def put(buffer: RemoteBuffer, group_id: str) -> None:
        await buffer.aput(make_group(0, group_id))

    asyncio.run(put(buf, "x"))
    asyncio.run(put(copy, "y"))  # a new loop, and a copy: a putter each
    assert sorted(g.group_id for g in buf.take(2, 0, timeout=5)) == ["x", "y"]


def test_a_killed_buffer_actor_is_recreated_and_every_copy_reattaches(ray_local, caplog
                                                                       ) -> None:
    """kill -9 of the actor's process: the driver's copy starts the next incarnation at the
    version and consumed count it saw, a replica's copy finds it by name; the dead actor's
    queued groups are lost (logged once with the count), its admissions' groups are put only
    within the bound (else dropped and counted), their cancels are no-ops, the accounting stays
    exact."""
    cfg = SimpleNamespace(task=SimpleNamespace(train_batch_size=2),
                          buffer=SimpleNamespace(max_staleness=1))  # 2 groups/step, eta 1
    base = "test-buffer-recreate"

    def recreate(incarnation: int, version: int, consumed: int, died: BaseException) -> object:
        return start_buffer_actor(cfg, actor_name(base, incarnation), version, consumed,
                                  recovered=True)  # type: ignore[arg-type]

    driver = RemoteBuffer(start_buffer_actor(cfg, actor_name(base, 0)), base,  # type: ignore[arg-type]
                          recreate=recreate)
    replica = pickle.loads(pickle.dumps(driver))  # as a replica gets it: no recreate
    assert replica.recreate is None
    driver.set_version(0)
    assert replica.admit_up_to(10, "r") == 4  # (0 + 1 + 1) * 2
    replica.put(make_group(0, "a"), "r")
    replica.put(make_group(0, "b"), "r")
    taken = driver.take(2, 0, timeout=5)
    driver.set_version(1)
    assert replica.admit_up_to(10, "r") == 2  # capacity(1) = 6: 2 in flight + 2 consumed
    replica.put(make_group(1, "c"), "r")
    assert driver.stats().queued == 1 and driver.last_stats.in_flight == 3

    pid = ray_local.get(driver.handle.__ray_call__.remote(lambda actor: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.remote"):
        fresh = driver.stats()  # the driver's next call meets the death and re-creates
    assert (fresh.learner_version, fresh.consumed, fresh.started, fresh.queued) == (1, 2, 2, 0)
    [warning] = [r.getMessage() for r in caplog.records if "re-created" in r.getMessage()]
    assert "lost the 1 group(s) queued and 3 admission(s) in flight" in warning
    assert driver.incarnation == 1

    # The replica's copy re-attaches on its next call; its claims died with the old actor.
    async def put_and_admit() -> bool:
        return await replica.aput_and_admit(make_group(1, "d"), "r")

    assert asyncio.run(put_and_admit()) is True  # within the bound: put, next slot claimed
    assert replica.incarnation == 1
    replica.cancel_admission("r")  # gives back the slot put_and_admit claimed here
    assert replica.admit_up_to(10, "r2") == 3  # the bound is reached: 6 started
    replica.put(make_group(1, "e"), "r")  # admitted by the dead actor, no slot left: dropped
    replica.cancel_admission("r")  # a claim of the dead actor: nothing to give back
    s = driver.stats()
    assert driver.lost() == 1
    assert s.started == s.consumed + s.queued + s.in_flight == 6
    driver.ack([g.group_id for g in taken])  # taken from the dead actor: nothing to ack
    replica.put(make_group(1, "f"), "r2")
    assert sorted(g.group_id for g in driver.take(2, 1, timeout=5)) == ["d", "f"]
