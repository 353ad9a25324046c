"""Rolling weight updates: how much of the fleet keeps sampling while a version is published.

Two replicas (the real ``Replica`` loop, each on its own vLLM engine of the tiny model, whose
engine core runs in a process of its own on a core of its own, as the runtime places replicas:
``VLLM_CPU_OMP_THREADS_BIND``) sample ragged prompts into one ``MemoryBuffer`` whose bound never
holds them back. Samples are single (``rollout.n=1``) so that every token is counted, with its
time, as the engine streams it. After a warm-up, every ``--every`` seconds the driver publishes
the model's own weights (a full load of every tensor) to both replicas at once, as their
weight-bus receivers do (``Replica.update_weights``), ``--publishes`` times per policy:
``rolling`` (the replicas share one ``SwapTokens`` of ``--k``), then ``pause``, ``abort`` and
``drain``, each on fresh replicas over the same engines.

The figure, per policy: fleet tokens/s during publishes (from the updates' start until both
replicas loaded, summed over the publishes) / fleet tokens/s in steady state (the rest of the
same policy's run after its warm-up). Tokens are counted as they arrive in this process, which
lags the engines by up to tens of milliseconds, as long as a swap of the tiny model: each
window's tokens are counted over the window widened by ``--margin`` seconds, less the steady
rate over the margins (``Run.rates``). So the figure is 1 - (tokens the publish cost / what the
fleet samples in the window's time): a resumed engine's first step, which recomputes its
requests' cache, counts against it, and can take pause / abort below 0. Goal: rolling >= 0.45
(of two replicas, one samples while the other swaps). pause / abort / drain are printed beside
it, without a goal. Also printed: the absolute rates, the publish window and each replica's
last turn wait (``swap_wait_s``). Time to reward of rolling vs pause is not measured here: a
training run per policy does not fit in a few minutes on two CPU cores.

    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/partials.py [--publishes 24] [--every 0.5]

Ends with ``RESULT fleet_tokens_during_publish_rolling value=<x> goal=>=0.45 met=yes|no``
(``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _key, _value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

import asyncio  # noqa: E402 - the environment above must be set before torch / vLLM load

from streamrl.testing import result_line  # noqa: E402

GOAL = 0.45
POLICIES = ("rolling", "pause", "abort", "drain")
FIRST_ORDINARY_TOKEN = 3  # the tiny tokenizer's ids 0-2 are special tokens
UNBOUNDED = 1_000_000  # max_staleness: admission never holds the replicas back


class ZeroScorer:
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return 0.0


@dataclass
class Counted:
    """An engine whose ``generate`` streams, logging (perf_counter, tokens) as they arrive."""

    engine: Any
    log: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        engine, log = self.engine, self.log

        async def generate(prompt_ids: list[int], params: Any, request_id: str) -> Any:
            return await engine.stream(prompt_ids, params, request_id,
                                       lambda ids: log.append((time.perf_counter(), len(ids))))

        engine.generate = generate  # the replica's requests go through the counting stream


@dataclass
class Run:
    policy: str
    windows: list[tuple[float, float]]
    """(start, end) of each publish: from the update calls until both replicas loaded."""
    start: float
    end: float
    tokens: list[tuple[float, int]]
    swap_wait_s: list[float]
    margin_s: float

    def rates(self) -> tuple[float, float]:
        """Fleet tokens/s during the publish windows, and in steady state.

        Tokens reach this process in bursts, tens of milliseconds after the engine sampled them
        (as long as a whole tiny-model swap), so counting arrivals inside a window would credit
        it with tokens sampled before it. Instead each window is widened by ``margin_s`` on both
        sides, into steady flow where the lag cancels out: the steady rate comes from the time
        outside the widened windows, and what the widened windows hold beyond that rate over
        their margins was sampled during the windows (a resumed engine's slow first step, as
        it recomputes its requests' cache, counts against the publish)."""
        spans = [(a - self.margin_s, b + self.margin_s) for a, b in self.windows]
        inside = sum(n for t, n in self.tokens if any(a <= t <= b for a, b in spans))
        total = sum(n for t, n in self.tokens if self.start <= t <= self.end)
        spans_s = sum(b - a for a, b in spans)
        window_s = sum(b - a for a, b in self.windows)
        steady = (total - inside) / (self.end - self.start - spans_s)
        return (inside - steady * (spans_s - window_s)) / window_s, steady


def prompts_of(count: int, vocab: int, seed: int) -> list[Any]:
    from streamrl.data import Prompt

    rng = random.Random(seed)
    return [Prompt(index=i, data_source="bench", ground_truth=None, extra={},
                   prompt_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, vocab)
                               for _ in range(rng.randint(4, 40))])
            for i in range(count)]


async def run_policy(policy: str, engines: list[Counted], weights: list[Any], first: int,
                     model: Model, args: argparse.Namespace) -> Run:
    """Fresh replicas on ``engines`` under ``policy``: warm up, publish ``args.publishes``
    versions from ``first`` on, one every ``args.every`` seconds, then one more steady span."""
    from streamrl.buffer.base import HeldBuffer
    from streamrl.buffer.memory import MemoryBuffer
    from streamrl.data import ListPromptSource, PromptStream
    from streamrl.rollout_fleet.replica import Replica, SwapTokens

    prompts = model.prompts
    buffer = MemoryBuffer(groups_per_step=len(prompts), max_staleness=UNBOUNDED)
    tokens = SwapTokens(k=args.k, timeout_s=60.0)
    replicas = [Replica(c.engine, HeldBuffer(buffer, f"replica-{i}"),
                        PromptStream(ListPromptSource(prompts, name="bench"), shuffle=True,
                                     seed=args.seed + i),
                        ZeroScorer(), model.tokenizer, model.rollout, name=f"replica-{i}",
                        swap_tokens=tokens)
                for i, c in enumerate(engines)]
    for c in engines:
        c.log.clear()
    for r in replicas:
        r.start()
    windows: list[tuple[float, float]] = []
    waits: list[float] = []
    try:
        await asyncio.sleep(args.warmup)
        start = time.perf_counter()
        for version in range(first, first + args.publishes):
            await asyncio.sleep(args.every)
            began = time.perf_counter()
            await asyncio.gather(*(r.update_weights(weights, version, policy) for r in replicas))
            windows.append((began, time.perf_counter()))
            waits.extend(r.counters.swap_wait_s for r in replicas)
        await asyncio.sleep(args.every)
        end = time.perf_counter()
    finally:
        for r in replicas:
            await r.stop(cancel=True, timeout=60)
    return Run(policy, windows, start, end, [x for c in engines for x in c.log], waits,
               args.margin)


@dataclass
class Model:
    """What every policy's replicas share: the rollout settings, tokenizer and prompts."""

    rollout: Any
    tokenizer: Any
    prompts: list[Any]


async def measure(args: argparse.Namespace) -> list[Run]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from streamrl.config import RolloutConfig
    from streamrl.models import resolve_model_path
    from streamrl.rollout_fleet import make_engine

    model_dir = resolve_model_path(args.model)
    weights = list(load_file(str(Path(model_dir) / "model.safetensors")).items())
    rollout = RolloutConfig(n=1, max_new_tokens=args.max_new_tokens, temperature=1.0,
                            max_inflight_groups=args.inflight, num_replicas=2,
                            max_model_len=512, seed=args.seed)
    model = Model(rollout, AutoTokenizer.from_pretrained(model_dir),
                  prompts_of(256, AutoConfig.from_pretrained(model_dir).vocab_size, args.seed))
    engines = []
    for core in range(2):  # the engine-core process reads its core at start
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
        engines.append(Counted(make_engine(rollout, model_dir, model_dir)))
    try:
        runs = []
        for i, policy in enumerate(args.policies.split(",")):
            runs.append(await run_policy(policy, engines, weights, 1 + i * args.publishes,
                                         model, args))
            report(runs[-1])
        return runs
    finally:
        for c in engines:
            await c.engine.close()


def report(run: Run) -> None:
    during, steady = run.rates()
    spans = [b - a for a, b in run.windows]
    print(f"{run.policy:>7}: {during / steady:5.2f} of steady during publishes "
          f"({during:7.0f} vs {steady:7.0f} fleet tok/s); publish window median "
          f"{statistics.median(spans) * 1e3:6.1f} ms (max {max(spans) * 1e3:.1f}); "
          f"turn wait max {max(run.swap_wait_s) * 1e3:.1f} ms", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model.path (default: the tiny model)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated, rolling first (its figure is the goal)")
    p.add_argument("--publishes", type=int, default=24, help="publishes per policy")
    p.add_argument("--every", type=float, default=0.5, help="seconds between publishes")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the first")
    p.add_argument("--margin", type=float, default=0.1,
                   help="seconds each window is widened by to count its tokens (< every / 2)")
    p.add_argument("--k", type=int, default=1, help="weight_bus.rolling_k")
    p.add_argument("--inflight", type=int, default=16, help="rollout.max_inflight_groups")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"2 replicas of {args.model}: {args.publishes} publishes per policy, one every "
          f"{args.every:g} s, {args.inflight} groups of n=1 in flight each, up to "
          f"{args.max_new_tokens} new tokens", flush=True)
    runs = asyncio.run(measure(args))
    rolling = [r for r in runs if r.policy == "rolling"]
    if rolling:
        during, steady = rolling[0].rates()
        print(result_line("fleet_tokens_during_publish_rolling", during / steady, ">=", GOAL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
