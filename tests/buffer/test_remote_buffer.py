"""RemoteBuffer over a real buffer actor: an event loop's puts share actor calls (those of
one pass of the loop, and those made while a call is in flight), and each put keeps its own
result or error."""

from __future__ import annotations

import asyncio
import pickle

from streamrl.buffer.remote import BufferActor, RemoteBuffer
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
    return actor, RemoteBuffer(actor)


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
