"""Issue 44's figures: no token thrown away at a stop, and rolling weight updates.

Three sections (``--sections``, all by default), each on the tiny model unless ``--model``,
with real ``Replica`` loops on real vLLM engines:

- ``resume``: tokens thrown away (and so sampled again) after a SIGTERM-resume, per token in
  flight at the stop. A replica samples groups of random prompts (``--resume-n`` samples each);
  once ``--in-flight-tokens`` tokens are in flight it is stopped. Two arms per trial, on the
  same engine and prompts: ``saved``, the stop ``ReplicaActor.stop`` makes on SIGTERM
  (``stop(save=True)``: requests aborted, groups saved to a ``FilePartialStore`` on disk), then
  a new replica (a restarted process's) reads the snapshot from disk, resumes its groups and runs
  until each is in the buffer (every response must start with its saved tokens, their versions
  unchanged); ``baseline``, the stop before issue 44 (``stop(cancel=True)``, nothing saved).
  The engine counts every token it samples (aborted returns included): tokens in flight at the
  stop = what the stopped replica sampled - the response tokens of the groups it put; thrown
  away = sampled - the response tokens of the groups put, over both replicas. The figure is
  thrown away / in flight (goal 0; the baseline's is 1 by the same counters), with the size and
  wall time of the save and of the load.
- ``publish``: how much of the fleet keeps sampling while a version is published. Two replicas,
  each on its own engine whose engine core runs on a core of its own (as the runtime places
  replicas: ``VLLM_CPU_OMP_THREADS_BIND``), sample ragged prompts (``rollout.n=1``, so each
  token is counted, with its time, as the engine streams it) into one ``MemoryBuffer`` whose
  bound never holds them back. After a warm-up, every ``--every`` seconds the driver publishes
  the model's own weights (a full load of every tensor) to both replicas at once, as their
  weight-bus receivers do (``Replica.update_weights``), ``--publishes`` times per policy:
  ``rolling`` (the replicas share one ``SwapTokens`` of ``--k``), then ``pause``, ``abort``,
  ``drain``, each on fresh replicas over the same engines. The figure, per policy: fleet
  tokens/s during the publishes (from the updates' start until both replicas loaded) / fleet
  tokens/s in steady state (``PublishRun.rates`` says how the arrival lag is taken out). A
  resumed engine's first step, which recomputes its requests' cache, counts against it and can
  take pause / abort below 0. Goal: rolling >= 0.45 (of two replicas, one samples while the
  other swaps); the others are printed beside it, with the absolute rates, the publish window
  and each replica's last turn wait (``swap_wait_s``).
- ``reward``: time to reward, rolling against pause: real ``streamrl train`` runs in this
  process (``benchmarks/modes.py: measure``: vLLM replicas, FSDP2 learner, gloo weight bus,
  Ray) of GRPO on the toy task, ``trainer.mode=fully_async`` with two replicas
  (``rollout.num_replicas=2 runtime.cpus_per_replica=0.5`` on ``runtime.num_cpus=2``), the
  same seed and settings but ``weight_bus.update_policy``. Each run stops once the rolling
  mean of the reward (``streamrl.report.ROLLING`` steps) reaches ``--target``. Printed: wall
  seconds (``time/elapsed_s``: from the replicas' start) and steps to 0.5 and to the target,
  the curve (rolling reward every ``CURVE_EVERY_S`` seconds), the mean swap pause per update,
  the rollouter's idle ratio, staleness and groups dropped, and the ratios rolling / pause of
  the time to the target and of the seconds per step (no goal: what rolling buys depends on
  how long a swap is against a step, and on whether the replicas or the learner bound it).
  The runs and their curves (``streamrl report``) stay in ``--out`` (default: a new temp dir).

On 2 cores: resume ~1 min, publish ~2 min, reward ~3.5 min per seed (both policies).

    flock -x /tmp/heavy.lock timeout 900 .venv/bin/python benchmarks/partials.py  # ~7 min
    .venv/bin/python benchmarks/partials.py --sections resume --trials 5
    .venv/bin/python benchmarks/partials.py --sections reward --seeds 2 --out runs/rolling

Ends with ``RESULT partials_regenerated value=<x> goal=<=0 met=yes|no`` (the saved arm, mean
over trials) and ``RESULT fleet_tokens_during_publish_rolling value=<x> goal=>=0.45
met=yes|no`` for the sections run (``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _key, _value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

import asyncio  # noqa: E402 - the environment above must be set before torch / vLLM load

from streamrl.testing import CountingEngine, result_line  # noqa: E402

SECTIONS = ("resume", "publish", "reward")
RESUME_GOAL = 0.0
PUBLISH_GOAL = 0.45
POLICIES = ("rolling", "pause", "abort", "drain")
FIRST_ORDINARY_TOKEN = 3  # the tiny tokenizer's ids 0-2 are special tokens
UNBOUNDED = 1_000_000  # max_staleness: admission never holds the replicas back
WAIT_S = 300.0
CURVE_EVERY_S = 10.0
CORE_BIND = "VLLM_CPU_OMP_THREADS_BIND"


# -- shared setup -------------------------------------------------------------------------------


class ZeroScorer:
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return 0.0


@dataclass
class Model:
    """The model directory, its tokenizer and vocabulary size, shared by the sections."""

    path: str
    tokenizer: Any
    vocab: int

    @classmethod
    def load(cls, name: str) -> Model:
        from transformers import AutoConfig, AutoTokenizer

        from streamrl.models import resolve_model_path

        path = resolve_model_path(name)
        return cls(path, AutoTokenizer.from_pretrained(path),
                   AutoConfig.from_pretrained(path).vocab_size)

    def prompts(self, count: int, seed: int, longest: int) -> list[Any]:
        """``count`` prompts of 4 to ``longest`` random ordinary tokens."""
        from streamrl.data import Prompt

        rng = random.Random(seed)
        return [Prompt(index=i, data_source="bench", ground_truth=None, extra={},
                       prompt_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, self.vocab)
                                   for _ in range(rng.randint(4, longest))])
                for i in range(count)]


@asynccontextmanager
async def engines(rollout: Any, model: Model, count: int) -> AsyncIterator[list[Any]]:
    """``count`` vLLM engines, engine core ``i`` bound to core ``i`` (as the runtime places
    replicas; the engine-core process reads its core at start), closed on exit."""
    from streamrl.rollout_fleet import make_engine

    made, bound = [], os.environ.get(CORE_BIND)
    try:
        for core in range(count):
            os.environ[CORE_BIND] = str(core % (os.cpu_count() or 1))
            made.append(make_engine(rollout, model.path, model.path))
        # The reward section's Ray workers inherit this process's environment.
        if bound is None:
            del os.environ[CORE_BIND]
        else:
            os.environ[CORE_BIND] = bound
        yield made
    finally:
        for engine in made:
            await engine.close()


async def wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {WAIT_S:.0f} s")
        await asyncio.sleep(0.005)


# -- resume: tokens thrown away across a SIGTERM-resume -----------------------------------------


class Arm:
    """One arm of a trial: a replica sampling ``prompts`` until ``target`` tokens are in
    flight, then stopped (and, when ``save``, resumed by a second replica)."""

    def __init__(self, engine: Any, model: Model, prompts: list[Any], rollout: Any,
                 store_dir: Path) -> None:
        from streamrl.data import ListPromptSource

        self.engine, self.tokenizer, self.rollout = engine, model.tokenizer, rollout
        self.source = ListPromptSource(prompts, name="bench")
        self.store_dir = store_dir

    def replica(self, engine: Any, groups: int, cursor: int, **kwargs: Any) -> Any:
        from streamrl.buffer.memory import MemoryBuffer
        from streamrl.data import PromptStream
        from streamrl.rollout_fleet.replica import Replica

        return Replica(engine, MemoryBuffer(groups_per_step=groups, max_staleness=0),
                       PromptStream(self.source, False, 0, cursor=cursor), ZeroScorer(),
                       self.tokenizer, self.rollout, name="replica-0", **kwargs)

    async def run(self, target: int, save: bool) -> dict[str, float]:
        from streamrl.rollout_fleet.partials import FilePartialStore

        store = FilePartialStore(self.store_dir)
        counting = CountingEngine(self.engine)
        first = self.replica(counting, len(self.source), 0, partials=store)
        first.start()
        await wait(lambda: sum(self.engine.num_tokens(r) for r in first.request_ids) >= target,
                   f"{target} tokens in flight")
        start = time.perf_counter()
        await first.stop(save=save, cancel=True)
        sampled, kept = counting.sampled, first.counters.tokens
        out = {"in_flight": float(sampled - kept), "save_s": time.perf_counter() - start}
        if save:
            size = (self.store_dir / "replica-0.msgpack").stat().st_size
            resumed = await self.resume(store)
            out.update(resumed, bytes=float(size))
            sampled += resumed.pop("sampled")
            kept += resumed.pop("kept")
        out["thrown_away"] = float(sampled - kept)
        out["ratio"] = out["thrown_away"] / out["in_flight"]
        return out

    async def resume(self, store: Any) -> dict[str, float]:
        """A restarted replica: read the snapshot, finish its groups, check their prefixes."""
        start = time.perf_counter()
        snapshot = store.take("replica-0")
        load_s = time.perf_counter() - start
        assert snapshot is not None
        counting = CountingEngine(self.engine)
        second = self.replica(counting, len(snapshot.groups), snapshot.cursor)
        second.resume(snapshot.groups, max_staleness=0)
        second.start()
        await wait(lambda: second.buffer.stats().queued == len(snapshot.groups),
                   f"the {len(snapshot.groups)} resumed groups")
        await second.stop()
        groups = second.buffer.take(len(snapshot.groups), learner_version=0, timeout=10)
        saved = {g.group_id: g for g in snapshot.groups}
        for g in groups:  # the saved tokens open the finished responses, unchanged
            for t, s in zip(g.trajectories, saved[g.group_id].samples or [], strict=True):
                k = len(s.token_ids)
                assert list(t.response_ids[:k]) == s.token_ids
                assert list(t.versions[:k]) == s.versions
        return {"sampled": float(counting.sampled), "kept": float(second.counters.tokens),
                "saved_tokens": float(snapshot.num_tokens), "groups": float(len(groups)),
                "load_s": load_s}


async def resume_section(model: Model, args: argparse.Namespace) -> list[str]:
    from streamrl.config import RolloutConfig

    rollout = RolloutConfig(n=args.resume_n, max_new_tokens=args.resume_new_tokens,
                            max_inflight_groups=args.inflight, temperature=1.0,
                            max_model_len=512, seed=args.seed)
    print(f"== resume: n={args.resume_n}, {args.inflight} groups in flight, "
          f"{args.resume_new_tokens} new tokens, stop at {args.in_flight_tokens} tokens in "
          "flight", flush=True)
    results = []
    async with engines(rollout, model, 1) as (engine,):
        for i in range(args.trials):
            prompts = model.prompts(4 * args.inflight, args.seed + i, longest=24)
            with tempfile.TemporaryDirectory() as tmp:
                arm = Arm(engine, model, prompts, rollout, Path(tmp))
                saved = await arm.run(args.in_flight_tokens, save=True)
                base = await arm.run(args.in_flight_tokens, save=False)
            results.append((saved, base))
            print(f"trial {i}: saved: {saved['in_flight']:.0f} tokens in flight at the stop "
                  f"({saved['saved_tokens']:.0f} saved, {saved['groups']:.0f} groups), thrown "
                  f"away {saved['thrown_away']:.0f} ({saved['ratio']:.3f}); save "
                  f"{saved['save_s'] * 1e3:.0f} ms, {saved['bytes'] / 1e3:.0f} kB, load "
                  f"{saved['load_s'] * 1e3:.1f} ms | baseline: {base['in_flight']:.0f} in "
                  f"flight, thrown away {base['thrown_away']:.0f} ({base['ratio']:.3f})",
                  flush=True)
    ratio = statistics.fmean(s["ratio"] for s, _ in results)
    base = statistics.fmean(b["ratio"] for _, b in results)
    print(f"tokens thrown away / tokens in flight at the stop: saved {ratio:.3f}, baseline "
          f"(nothing saved) {base:.3f}; saved / baseline = {ratio / base:.3f}", flush=True)
    return [result_line("partials_regenerated", ratio, "<=", RESUME_GOAL, digits=3)]


# -- publish: the fleet's sampling rate while a version is published --------------------------


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
class PublishRun:
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

    def report(self) -> None:
        during, steady = self.rates()
        spans = [b - a for a, b in self.windows]
        print(f"{self.policy:>7}: {during / steady:5.2f} of steady during publishes "
              f"({during:7.0f} vs {steady:7.0f} fleet tok/s); publish window median "
              f"{statistics.median(spans) * 1e3:6.1f} ms (max {max(spans) * 1e3:.1f}); "
              f"turn wait max {max(self.swap_wait_s) * 1e3:.1f} ms", flush=True)


async def run_policy(policy: str, counted: list[Counted], weights: list[Any], first: int,
                     model: Model, rollout: Any, args: argparse.Namespace) -> PublishRun:
    """Fresh replicas on ``counted`` under ``policy``: warm up, publish ``args.publishes``
    versions from ``first`` on, one every ``args.every`` seconds, then one more steady span."""
    from streamrl.buffer.base import HeldBuffer
    from streamrl.buffer.memory import MemoryBuffer
    from streamrl.data import ListPromptSource, PromptStream
    from streamrl.rollout_fleet.replica import Replica, SwapTokens

    prompts = model.prompts(256, args.seed, longest=40)
    buffer = MemoryBuffer(groups_per_step=len(prompts), max_staleness=UNBOUNDED)
    tokens = SwapTokens(k=args.k, timeout_s=60.0)
    replicas = [Replica(c.engine, HeldBuffer(buffer, f"replica-{i}"),
                        PromptStream(ListPromptSource(prompts, name="bench"), shuffle=True,
                                     seed=args.seed + i),
                        ZeroScorer(), model.tokenizer, rollout, name=f"replica-{i}",
                        swap_tokens=tokens)
                for i, c in enumerate(counted)]
    for c in counted:
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
    return PublishRun(policy, windows, start, end, [x for c in counted for x in c.log], waits,
                      args.margin)


async def publish_section(model: Model, args: argparse.Namespace) -> list[str]:
    from safetensors.torch import load_file

    from streamrl.config import RolloutConfig

    print(f"== publish: 2 replicas, {args.publishes} publishes per policy, one every "
          f"{args.every:g} s, {args.inflight} groups of n=1 in flight each, up to "
          f"{args.publish_new_tokens} new tokens", flush=True)
    weights = list(load_file(str(Path(model.path) / "model.safetensors")).items())
    rollout = RolloutConfig(n=1, max_new_tokens=args.publish_new_tokens, temperature=1.0,
                            max_inflight_groups=args.inflight, num_replicas=2,
                            max_model_len=512, seed=args.seed)
    runs = []
    async with engines(rollout, model, 2) as made:
        counted = [Counted(e) for e in made]
        for i, policy in enumerate(args.policies.split(",")):
            runs.append(await run_policy(policy, counted, weights, 1 + i * args.publishes,
                                         model, rollout, args))
            runs[-1].report()
    rolling = [r for r in runs if r.policy == "rolling"]
    if not rolling:
        return []
    during, steady = rolling[0].rates()
    return [result_line("fleet_tokens_during_publish_rolling", during / steady, ">=",
                        PUBLISH_GOAL)]


# -- reward: time to reward, rolling against pause ----------------------------------------------


def reward_section(args: argparse.Namespace) -> list[str]:
    """Training runs per seed, rolling then pause, each stopped at the target reward."""
    from modes import measure, seconds_to

    from streamrl.report import ROLLING, load_run, write_report

    thresholds = (0.5, args.target) if args.target > 0.5 else (args.target,)
    out = Path(args.out or tempfile.mkdtemp(prefix="streamrl-partials-reward-"))
    print(f"== reward: fully_async, 2 replicas, rolling vs pause, {args.seeds} seed(s), until "
          f"the rolling reward ({ROLLING} steps) reaches {args.target:g} (at most "
          f"{args.max_steps} steps, {args.run_timeout:g} s); runs in {out}", flush=True)
    dirs: dict[str, list[str]] = {"rolling": [], "pause": []}
    results: dict[str, list[Any]] = {"rolling": [], "pause": []}
    for seed in range(args.seed, args.seed + args.seeds):
        for policy in dirs:  # seeds outermost: drift in the machine's load hits both alike
            run_dir = str(out / f"{policy}-s{seed}")
            overrides = [f"model.path={args.model}", "rollout.num_replicas=2",
                         "runtime.cpus_per_replica=0.5", f"weight_bus.update_policy={policy}",
                         *args.overrides]
            measured = argparse.Namespace(max_steps=args.max_steps, warmup=args.reward_warmup,
                                          run_timeout=args.run_timeout, overrides=overrides)
            results[policy].append(measure("default", "fully_async", seed, measured, run_dir,
                                           thresholds))
            dirs[policy].append(run_dir)
            run, r = load_run(run_dir), results[policy][-1]
            curve = run.rolling_reward()
            marks = [float(curve[(run.wall <= t).sum() - 1])  # the last step logged by t
                     for t in range(int(CURVE_EVERY_S), int(run.wall[-1]) + 1,
                                    int(CURVE_EVERY_S)) if run.wall[0] <= t]
            print(f"{policy:>7} seed {seed}: {r.steps} steps in {r.wall_s:.1f} s "
                  f"({r.wall_s / r.steps:.3f} s/step), reached "
                  + ", ".join(f"{t} at {v[0]:.1f} s (step {v[1]})" if v else f"{t} never"
                              for t, v in r.reached.items())
                  + f"; {r.traj_per_s:.1f} traj/s; swap pause "
                  f"{run.mean('replica/weight_pause_s') * 1e3:.0f} ms per update; rollouter "
                  f"idle {r.rollouter_idle:.2f}; staleness {run.mean('staleness/mean'):.2f}, "
                  f"{run.rows[-1].get('buffer/dropped', 0):.0f} group(s) dropped; rolling "
                  f"reward every {CURVE_EVERY_S:g} s: " + " ".join(f"{m:.2f}" for m in marks),
                  flush=True)
    to = {p: statistics.median(seconds_to(rs, args.target)) for p, rs in results.items()}
    per_step = {p: statistics.median(r.wall_s / r.steps for r in rs) for p, rs in results.items()}
    missed = [p for p, rs in results.items() if any(r.reached[str(args.target)] is None
                                                      for r in rs)]
    print(f"time to reward {args.target:g} (median over seeds): rolling {to['rolling']:.1f} s, "
          f"pause {to['pause']:.1f} s; rolling / pause = {to['rolling'] / to['pause']:.2f} (no "
          "goal" + (f"; not reached by {missed}: their wall time at the stop counts" if missed
                    else "") + f"); seconds per step rolling / pause = "
          f"{per_step['rolling'] / per_step['pause']:.2f}", flush=True)
    print(f"curves: {write_report([d for ds in dirs.values() for d in ds], str(out))}")
    return []


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument("--model", default="tiny", help="model.path (default: the tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inflight", type=int, default=16,
                   help="rollout.max_inflight_groups (resume and publish)")
    resume = p.add_argument_group("resume")
    resume.add_argument("--trials", type=int, default=3)
    resume.add_argument("--resume-n", type=int, default=4, help="samples per prompt")
    resume.add_argument("--resume-new-tokens", type=int, default=256)
    resume.add_argument("--in-flight-tokens", type=int, default=2000,
                        help="stop once this many tokens are in flight")
    publish = p.add_argument_group("publish")
    publish.add_argument("--policies", default=",".join(POLICIES),
                         help="comma-separated, rolling first (its figure is the goal)")
    publish.add_argument("--publishes", type=int, default=24, help="publishes per policy")
    publish.add_argument("--every", type=float, default=0.5, help="seconds between publishes")
    publish.add_argument("--warmup", type=float, default=3.0, help="seconds before the first")
    publish.add_argument("--margin", type=float, default=0.1,
                         help="seconds each window is widened by to count its tokens "
                              "(< every / 2)")
    publish.add_argument("--k", type=int, default=1, help="weight_bus.rolling_k")
    publish.add_argument("--publish-new-tokens", type=int, default=96)
    reward = p.add_argument_group("reward")
    reward.add_argument("--seeds", type=int, default=1,
                        help="runs per policy, seeds --seed, --seed + 1, ...")
    reward.add_argument("--target", type=float, default=0.9,
                        help="rolling reward a run stops at (also timed: 0.5)")
    reward.add_argument("--max-steps", type=int, default=120, help="step cap per run")
    reward.add_argument("--run-timeout", type=float, default=150.0,
                        help="wall seconds per run after its loop starts")
    reward.add_argument("--reward-warmup", type=int, default=4,
                        help="steps left out of the throughput")
    reward.add_argument("--out", help="the runs and their curves (default: a new temp dir)")
    reward.add_argument("overrides", nargs="*", help="config overrides for the training runs")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections={args.sections}: {sorted(unknown)} not among {SECTIONS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = args.sections.split(",")
    model = Model.load(args.model)
    lines = []
    if "resume" in sections:
        lines += asyncio.run(resume_section(model, args))
    if "publish" in sections:
        lines += asyncio.run(publish_section(model, args))
    if "reward" in sections:
        lines += reward_section(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
