"""Redis buffer throughput: RedisBuffer put+take vs raw redis-py XADD+XREADGROUP of the same bytes.

Starts its own redis-server on a free port (same flags as the test fixture: AOF on, no RDB),
builds ``--groups`` identical-size groups once, then measures on the same server:

- ``RedisBuffer``: the buffer calls one replica makes (``rollout_fleet/replica.py``), with
  sampling taking no time: at most ``--inflight`` groups in flight (rollout.max_inflight_groups,
  default 8); each group's slot comes from the previous put (``aput_and_admit``: the put and the
  next group's admission in one script) or else from ``atry_admit``; the event loop's writer
  sends the calls queued together in one pipeline (consecutive puts as one script). The puts'
  encode is timed too; the last claimed slots are given back (``acancel_admission``), as a
  stopping replica does. Per step ``take(B)`` + ``ack``: XREADGROUP COUNT B and the counting
  script in one round trip, one msgspec decode per entry, then the XACK-and-trim script;
- ``RedisBuffer sync``: one caller's ``try_admit`` + ``put``, one round trip each (what a
  blocking caller such as ``streamrl serve``'s episode close pays), same take;
- ``raw pipelined``: XADD of the pre-encoded bytes pipelined B at a time, then XREADGROUP COUNT
  B + XACK per step (no admission, no accounting, no encode or decode): the floor our protocol
  sits on;
- ``raw unpipelined``: one XADD round trip per group.

It also prints the ceiling the goal can reach here: raw pipelined plus one decode per group,
against raw pipelined.

Every row is measured once per round (``--rounds``, default 5), the rounds interleaved; the table
gives each row's median, the ratio is the median of the rounds' ratios (each round against its
own baseline: these machines are noisy).

Run: ``.venv/bin/python benchmarks/buffer.py [--groups 2000 --n 4 --response-len 128 --batch 16
--inflight 8 --rounds 5]``

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(redis_buffer_vs_raw_pipelined: the ``RedisBuffer`` row; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from streamrl import testing
from streamrl.buffer.redis import CONSUMER_GROUP, RedisBuffer
from streamrl.config import RolloutConfig
from streamrl.testing import make_trajectory, result_line
from streamrl.types import Group, decode, encode


@contextmanager
def redis_server() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as workdir, testing.redis_server(workdir) as url:
        yield url


def make_groups(count: int, n: int, prompt_len: int, response_len: int) -> list[Group]:
    return [
        Group(group_id=f"g{g:07d}", trajectories=[
            make_trajectory(f"g{g:07d}-{i}", f"g{g:07d}", response_len,
                            prompt_ids=list(range(prompt_len)),
                            response_ids=[(7 * j) % 50000 for j in range(response_len)],
                            logprobs=[-0.1234567] * response_len, versions=[0] * response_len,
                            reward=1.0)
            for i in range(n)
        ])
        for g in range(count)
    ]


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def new_buffer(url: str, groups: list[Group], batch: int) -> RedisBuffer:
    eta = len(groups) // batch + 1  # admission never refuses here: we measure the data path
    RedisBuffer(url, "bench", groups_per_step=batch, max_staleness=eta).purge()
    return RedisBuffer(url, "bench", groups_per_step=batch, max_staleness=eta)


async def replica_puts(buf: RedisBuffer, groups: list[Group], inflight: int) -> None:
    """The buffer calls of a replica loop (replica.py ``_run`` / ``_group``) whose groups are
    ready at once: at most ``inflight`` puts outstanding; a slot per group (a put's claim, else
    ``atry_admit``), then its put. Callbacks instead of a task per group: the driver's own
    overhead stays out of the buffer's numbers."""
    holder = "replica-0.0"
    claimed = outstanding = 0
    errors: list[BaseException] = []
    loop = asyncio.get_running_loop()
    freed = loop.create_future()  # a future, not an Event: waiting on it makes no task

    def done(put: asyncio.Future[bool]) -> None:
        nonlocal claimed, outstanding
        outstanding -= 1
        if put.exception() is not None:
            errors.append(put.exception())
        elif put.result():
            claimed += 1
        if not freed.done():
            freed.set_result(None)

    async def wait_below(limit: int) -> None:
        nonlocal freed
        while outstanding > limit:
            freed = loop.create_future()
            await asyncio.wait_for(freed, 60)  # a put lost for a minute: fail loudly
        if errors:
            raise errors[0]

    for group in groups:
        await wait_below(inflight - 1)
        if claimed:
            claimed -= 1
        elif not await buf.atry_admit(holder):
            raise RuntimeError("admission refused")
        outstanding += 1
        asyncio.ensure_future(buf.aput_and_admit(group, holder)).add_done_callback(done)
    await wait_below(0)
    for _ in range(claimed):  # the replica stops: claimed slots no group will use go back
        await buf.acancel_admission(holder)


def bench_buffer(url: str, groups: list[Group], batch: int, inflight: int | None
                 ) -> tuple[float, float]:
    """``inflight``: replica-like async puts with that many groups in flight; None: sync."""
    buf = new_buffer(url, groups, batch)

    def put_all() -> None:
        if inflight is not None:
            async def replica() -> None:
                await replica_puts(buf, groups, inflight)
                await buf.aclose()  # the loop's writer: its connections
            asyncio.run(replica())
            return
        for group in groups:
            if not buf.try_admit():
                raise RuntimeError("admission refused")
            buf.put(group)

    def take_all() -> None:
        for _ in range(len(groups) // batch):
            taken = buf.take(batch, learner_version=0, timeout=10)
            buf.ack([g.group_id for g in taken])

    put_s, take_s = timed(put_all), timed(take_all)
    s = buf.stats()
    assert (s.produced, s.in_flight, s.consumed) == (
        len(groups), 0, len(groups) // batch * batch), s
    buf.purge()
    buf.close()
    return put_s, take_s


def bench_raw(url: str, blobs: list[bytes], batch: int, pipelined: bool) -> tuple[float, float]:
    client = redis.Redis.from_url(url)
    stream = "bench:raw"
    client.delete(stream)
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)

    def put_all() -> None:
        if not pipelined:
            for i, blob in enumerate(blobs):
                client.xadd(stream, {"group_id": f"g{i}", "data": blob})
            return
        for start in range(0, len(blobs), batch):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + batch, len(blobs))):
                pipe.xadd(stream, {"group_id": f"g{i}", "data": blobs[i]})
            pipe.execute()

    def take_all() -> None:
        for _ in range(len(blobs) // batch):
            reply = client.xreadgroup(CONSUMER_GROUP, "c", {stream: ">"}, count=batch)
            entries = reply[0][1]
            assert len(entries) == batch
            client.xack(stream, CONSUMER_GROUP, *[eid for eid, _ in entries])

    put_s, take_s = timed(put_all), timed(take_all)
    client.delete(stream)
    client.close()
    return put_s, take_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--n", type=int, default=4, help="trajectories per group")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="groups per take (B)")
    parser.add_argument("--inflight", type=int, default=RolloutConfig().max_inflight_groups,
                        help="groups in flight in the replica (rollout.max_inflight_groups)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="each row measured once per round, rounds interleaved")
    args = parser.parse_args()

    groups = make_groups(args.groups, args.n, args.prompt_len, args.response_len)
    blobs = [encode(g) for g in groups]
    decode_s = timed(lambda: all(decode(b, Group) for b in blobs))  # one at a time, as take
    size = sum(map(len, blobs)) / len(blobs)
    rows: dict[str, Callable[[str], tuple[float, float]]] = {
        "RedisBuffer": lambda url: bench_buffer(url, groups, args.batch, args.inflight),
        "RedisBuffer sync": lambda url: bench_buffer(url, groups, args.batch, None),
        "raw pipelined": lambda url: bench_raw(url, blobs, args.batch, pipelined=True),
        "raw unpipelined": lambda url: bench_raw(url, blobs, args.batch, pipelined=False),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    with redis_server() as url:
        for _ in range(args.rounds):  # interleaved: a noisy spell hits every row alike
            for name, bench in rows.items():
                results[name].append(bench(url))
    print(f"{args.groups} groups x {size / 1024:.1f} KiB (n={args.n}, "
          f"response_len={args.response_len}), take batch B={args.batch}, "
          f"{args.inflight} groups in flight, median of {args.rounds} rounds; "
          f"msgspec decode alone: {args.groups / decode_s:,.0f} groups/s")
    print(f"{'':<18}{'put/s':>10}{'take/s':>10}{'put+take/s':>12}{'MiB/s':>8}")
    for name, runs in results.items():
        put_s, take_s = (statistics.median(r[i] for r in runs) for i in (0, 1))
        total = statistics.median(sum(r) for r in runs)
        mib = args.groups * size / total / 2**20
        print(f"{name:<18}{args.groups / put_s:>10,.0f}{args.groups / take_s:>10,.0f}"
              f"{args.groups / total:>12,.0f}{mib:>8.1f}")
    ours = [sum(r) for r in results["RedisBuffer"]]
    ratios = {}
    for base in ("raw pipelined", "raw unpipelined"):  # each round against its own baseline
        per_round = [sum(r) / o for r, o in zip(results[base], ours)]
        ratios[base] = statistics.median(per_round)
        print(f"ratio RedisBuffer / {base} put+take throughput: {ratios[base]:.2f} (rounds: "
              + ", ".join(f"{x:.2f}" for x in per_round) + ")")
    raw = statistics.median(sum(r) for r in results["raw pipelined"])
    print(f"ceiling (raw pipelined + one decode per group) / raw pipelined: "
          f"{raw / (raw + decode_s):.2f}")
    ratio = ratios["raw pipelined"]  # the goal of the performance issue (16)
    print(result_line("redis_buffer_vs_raw_pipelined", ratio, ">=", 0.5))


if __name__ == "__main__":
    main()
