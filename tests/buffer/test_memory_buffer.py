"""MemoryBuffer: blocking take across threads and asyncio, idempotence, errors, rebase."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrl.buffer.memory import MemoryBuffer
from streamrl.testing import make_group


def test_take_blocks_until_a_replica_thread_puts() -> None:
    buf = MemoryBuffer(groups_per_step=2, max_staleness=1)

    def replica() -> None:
        for i in range(2):
            time.sleep(0.05)
            assert buf.try_admit()
            buf.put(make_group(0, f"g{i}"))

    thread = threading.Thread(target=replica)
    t0 = time.monotonic()
    thread.start()
    groups = buf.take(2, learner_version=0, timeout=5)
    thread.join()
    assert [g.group_id for g in groups] == ["g0", "g1"]
    assert time.monotonic() - t0 >= 0.1


def test_take_from_asyncio_via_to_thread() -> None:
    buf = MemoryBuffer(groups_per_step=1, max_staleness=0)

    async def main() -> list[str]:
        waiter = asyncio.create_task(asyncio.to_thread(buf.take, 1, 0, 5.0))
        await asyncio.sleep(0.05)
        assert buf.try_admit()  # cheap calls go straight from the event loop
        buf.put(make_group(0, "a"))
        return [g.group_id for g in await waiter]

    assert asyncio.run(main()) == ["a"]


def test_timeout_names_the_shortfall() -> None:
    buf = MemoryBuffer(groups_per_step=2, max_staleness=0)
    assert buf.try_admit()
    with pytest.raises(TimeoutError, match="2 groups wanted, 0 queued, 1 in flight"):
        buf.take(2, 0, timeout=0.05)


def test_oldest_version_first_and_stale_dropped_with_slot_returned() -> None:
    buf = MemoryBuffer(groups_per_step=1, max_staleness=1)
    buf.set_version(2)
    for gid, versions in [("new", [2]), ("old", [1, 2]), ("stale", [0, 2])]:
        assert buf.try_admit()
        buf.put(make_group(versions, gid))
    before = buf.stats().started
    assert [g.group_id for g in buf.take(2, 2)] == ["old", "new"]
    s = buf.stats()
    assert (s.dropped, s.started, s.consumed, s.queued) == (1, before - 1, 2, 0)
    assert (s.staleness_max, s.staleness_mean) == (1, 0.5)


RESUMED_PUTS = [  # (group id, versions, holder): replicas 1 and 2 kept newer weights
    ("future", [12], "replica-1.0"), ("mixed", [10, 12], "replica-2.0"),
    ("again", [11], "replica-1.0"), ("ok", [10], "replica-0.0"), ("ok2", [9, 10], "replica-0.0"),
]


def test_a_group_newer_than_the_learner_is_refused_naming_it(caplog) -> None:
    """After a resume from step 10's checkpoint, a group carrying any token newer than 10
    (negative staleness) is never trained: refused and counted, one line naming it, its holder
    and the versions for each holder's first; its slot comes back and the others are
    delivered."""
    buf = MemoryBuffer(groups_per_step=2, max_staleness=2)
    buf.rebase(learner_version=10, consumed=20)
    for gid, versions, holder in RESUMED_PUTS:
        assert buf.try_admit(holder)
        buf.put(make_group(versions, gid), holder)
    with caplog.at_level("WARNING", logger="streamrl.buffer.memory"):
        assert sorted(g.group_id for g in buf.take(2, 10)) == ["ok", "ok2"]
    s = buf.stats()
    assert (s.refused, s.consumed, s.queued, s.in_flight, s.dropped) == (3, 22, 0, 0, 0)
    assert s.started == s.consumed + s.queued + s.in_flight
    assert s.staleness_max == 1  # only the delivered groups are counted
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 2  # replica-1's second refusal is counted, not logged
    assert text.count("put by replica-1.0") == 1
    assert "group mixed (prompt -1, put by replica-2.0) has policy versions 10..12, newer " \
           "than learner version 10 (negative staleness): refused" in text
    assert all(buf.try_admit() for _ in range(4))  # the refused groups' slots are free again


def test_put_is_idempotent_and_accounts_unadmitted_puts() -> None:
    buf = MemoryBuffer(groups_per_step=1, max_staleness=0)
    group = make_group(0, "x")
    buf.put(group)  # no admission (e.g. an episode closed by the serve API)
    buf.put(group)
    s = buf.stats()
    assert (s.produced, s.queued, s.started, s.in_flight) == (1, 1, 1, 0)
    assert not buf.try_admit()  # the unadmitted put still holds the step's only slot


def test_errors_are_clear() -> None:
    buf = MemoryBuffer(groups_per_step=1, max_staleness=0)
    with pytest.raises(ValueError, match="no admitted group is in flight"):
        buf.cancel_admission()
    with pytest.raises(ValueError, match="not taken or already acked"):
        buf.ack(["nope"])
    buf.set_version(3)
    with pytest.raises(ValueError, match="learner_version=2 < current 3"):
        buf.set_version(2)
    with pytest.raises(TypeError, match="expected a Group"):
        buf.put(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n=0"):
        buf.take(0, 3)


def test_rebase_requeues_unacked_and_skips_trained() -> None:
    buf = MemoryBuffer(groups_per_step=2, max_staleness=1)
    for i in range(4):
        assert buf.try_admit()
        buf.put(make_group(0, f"g{i}"))
    taken = buf.take(2, 0)
    assert [g.group_id for g in taken] == ["g0", "g1"]
    # The learner checkpointed g0 (trained) at version 0 and crashed before acking.
    buf.rebase(learner_version=0, consumed=1, skip_ids=["g0"])
    s = buf.stats()
    assert (s.learner_version, s.consumed, s.queued, s.in_flight) == (0, 1, 3, 0)
    assert s.started == 4  # consumed + queued: the bound still counts every live group
    assert [g.group_id for g in buf.take(3, 0)] == ["g1", "g2", "g3"]
    buf.put(make_group(0, "g0"))  # a replica retrying a trained group: ignored
    assert buf.stats().queued == 0


def test_async_admission_keeps_the_bound_and_the_holder() -> None:
    from streamrl.buffer.base import HeldBuffer

    buf = MemoryBuffer(groups_per_step=2, max_staleness=0)  # two slots at version 0
    held = HeldBuffer(buf, "replica-0.0")

    async def admit(n: int) -> list[bool]:
        return list(await asyncio.gather(*(held.atry_admit() for _ in range(n))))

    assert sorted(asyncio.run(admit(3))) == [False, True, True]
    assert buf.stats().started == 2
    assert buf.release("replica-0.0") == 2  # counted under the holder, like try_admit
    assert buf.stats().started == 0


def test_the_buffer_actor_class_stays_a_threaded_actor() -> None:
    """Ray turns an actor class with any coroutine method into an async actor, whose sync
    methods run one at a time on its event loop: the learner's blocking ``take`` then stalls
    every replica's ``put`` (measured: ~1 group/s, 35 s sync steps)."""
    import inspect

    from streamrl.buffer.remote import BufferActor

    coroutines = [name for name, fn in inspect.getmembers(BufferActor, inspect.isfunction)
                  if inspect.iscoroutinefunction(fn)]
    assert coroutines == []


def test_a_trainer_resume_keeps_the_admissions_of_live_holders() -> None:
    """streamrl serve (holder "") and a replica hold slots when the trainer resumes from a
    checkpoint: rebase keeps them (every holder of a memory buffer is alive: in this process,
    or a replica the supervisor releases), so the open group's cancel and put still settle
    its slot instead of failing."""
    buf = MemoryBuffer(groups_per_step=2, max_staleness=1)
    assert buf.admit_up_to(2) == 2  # the service's open groups
    assert buf.try_admit("replica-0.0")
    buf.rebase(learner_version=0, consumed=0)
    s = buf.stats()
    assert (s.in_flight, s.started, s.queued) == (3, 3, 0)
    buf.cancel_admission()  # a client's failed episode gives its slot back
    buf.put(make_group(0, "served"))  # the other one is put on its own slot
    s = buf.stats()
    assert (s.in_flight, s.started, s.queued) == (1, 2, 1)
    assert buf.release("replica-0.0") == 1
    assert [g.group_id for g in buf.take(1, 0, timeout=0)] == ["served"]


def test_put_remembers_only_the_last_seen_keep_group_ids(monkeypatch) -> None:
    """Idempotence covers retries (seconds old), not the whole run: the set of ids put is
    bounded, the newest kept."""
    from streamrl.buffer import memory

    monkeypatch.setattr(memory, "SEEN_KEEP", 4)
    buf = MemoryBuffer(groups_per_step=2, max_staleness=100)
    for i in range(10):
        buf.put(make_group(0, f"g{i}"))
    assert buf._seen == {"g6", "g7", "g8", "g9"}
    buf.put(make_group(0, "g9"))  # a retry of a recent put adds nothing
    assert buf.stats().produced == 10
    buf.rebase(0, 0, skip_ids=["t0", "t1"])  # ids trained before a restart count as seen too
    assert buf._seen == {"g8", "g9", "t0", "t1"}
