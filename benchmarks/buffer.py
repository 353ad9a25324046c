"""Redis buffer throughput: RedisBuffer put+take vs raw redis-py XADD+XREADGROUP of the same bytes.

Starts its own redis-server on a free port (same flags as the test fixture: AOF on, no RDB),
encodes ``--groups`` identical-size groups once, then measures on the same server:

- ``RedisBuffer``: per group ``try_admit`` + ``put``, one round trip each (a replica admits
  before it samples, so the two cannot share one); per step ``take(B)`` + ``ack``, three round
  trips (XREADGROUP COUNT B, then one msgspec decode per entry, the counting script; the
  XACK-and-trim script);
- ``raw pipelined``: XADD of the same bytes pipelined B at a time, then XREADGROUP COUNT B +
  XACK per step (no admission, no accounting, no decode): the floor our protocol sits on;
- ``raw unpipelined``: one XADD round trip per group (what a lone replica's put costs at best).

It also prints the ceiling the goal can reach here: a put of one bare XADD round trip and a take
of raw XREADGROUP plus one decode per group, against raw pipelined.

Run: ``.venv/bin/python benchmarks/buffer.py [--groups 2000 --n 4 --response-len 128 --batch 16]``

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(redis_buffer_vs_raw_pipelined; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from streamrl import testing
from streamrl.buffer.redis import CONSUMER_GROUP, RedisBuffer
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


def bench_buffer(url: str, groups: list[Group], batch: int) -> tuple[float, float]:
    eta = len(groups) // batch + 1  # admission never refuses here: we measure the data path
    buf = RedisBuffer(url, "bench", groups_per_step=batch, max_staleness=eta)
    buf.purge()
    buf = RedisBuffer(url, "bench", groups_per_step=batch, max_staleness=eta)

    def put_all() -> None:
        for group in groups:
            if not buf.try_admit():
                raise RuntimeError("admission refused")
            buf.put(group)

    def take_all() -> None:
        for _ in range(len(groups) // batch):
            taken = buf.take(batch, learner_version=0, timeout=10)
            buf.ack([g.group_id for g in taken])

    put_s, take_s = timed(put_all), timed(take_all)
    assert buf.stats().consumed == len(groups) // batch * batch
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
    args = parser.parse_args()

    groups = make_groups(args.groups, args.n, args.prompt_len, args.response_len)
    blobs = [encode(g) for g in groups]
    decode_s = timed(lambda: [decode(b, Group) for b in blobs])
    size = sum(map(len, blobs)) / len(blobs)
    with redis_server() as url:
        results = {
            "RedisBuffer": bench_buffer(url, groups, args.batch),
            "raw pipelined": bench_raw(url, blobs, args.batch, pipelined=True),
            "raw unpipelined": bench_raw(url, blobs, args.batch, pipelined=False),
        }
    print(f"{args.groups} groups x {size / 1024:.1f} KiB (n={args.n}, "
          f"response_len={args.response_len}), take batch B={args.batch}; "
          f"msgspec decode alone: {args.groups / decode_s:,.0f} groups/s")
    print(f"{'':<18}{'put/s':>10}{'take/s':>10}{'put+take/s':>12}{'MiB/s':>8}")
    for name, (put_s, take_s) in results.items():
        total = put_s + take_s
        mib = args.groups * size / total / 2**20
        print(f"{name:<18}{args.groups / put_s:>10,.0f}{args.groups / take_s:>10,.0f}"
              f"{args.groups / total:>12,.0f}{mib:>8.1f}")
    ours = sum(results["RedisBuffer"])
    ratios = {base: sum(results[base]) / ours for base in ("raw pipelined", "raw unpipelined")}
    for base, ratio in ratios.items():
        print(f"ratio RedisBuffer / {base} put+take throughput: {ratio:.2f}")
    floor = results["raw unpipelined"][0] + results["raw pipelined"][1] + decode_s
    print(f"ceiling (1 XADD round trip per put, raw take + decode) / raw pipelined: "
          f"{sum(results['raw pipelined']) / floor:.2f}")
    ratio = ratios["raw pipelined"]  # the goal of the performance issue (16)
    print(result_line("redis_buffer_vs_raw_pipelined", ratio, ">=", 0.5))


if __name__ == "__main__":
    main()
