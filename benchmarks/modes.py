"""The three modes on one machine: time to reward and learner throughput, against sync.

Each run is ``streamrl train`` with the embedded defaults (real vLLM replica, FSDP2 learner,
gloo weight bus, Ray; one rollout and one learner process on ``runtime.num_cpus=2``), for
``--seeds`` seeds (``trainer/learner/rollout/task.seed``) and two task variants:

- ``default``: the toy task as shipped, every mode;
- ``long_tail``: a quarter of the prompts want 8x longer responses (``task.long_tail=0.25``,
  ``task.long_tail_tokens`` = 8 x ``rollout.max_new_tokens``): a sync step waits for its
  longest groups, which is where overlapping generation with training should matter most;
  sync and fully_async only (``VARIANTS``).

Seeds are the outer loop, so drift in the machine's load reaches every mode alike. Per run:

- time to reward: the wall seconds (``time/elapsed_s``: from the replicas' start, so engine
  start-up is not counted) and steps until the rolling mean of ``ROLLING`` steps' reward reaches
  each of ``THRESHOLDS``. A run stops once it has crossed the last one, after ``--max-steps``
  steps, or ``--run-timeout`` seconds after its loop started (a threshold it did not reach
  counts as its wall time at the stop: a lower bound, see ``seconds_to``);
- throughput: trajectories trained per second over the steps after ``--warmup``;
- phase seconds per step (take, prepare, update, publish), which ``speedup_model.py`` fits.

Per mode: the median over seeds and the spread (min-max); ratios are medians against sync
measured in the same invocation. ``--out DIR`` keeps every run dir (``streamrl report`` draws
the curves) and writes ``DIR/modes.json`` (every run's figures).

    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/modes.py --out runs/modes   # ~25 min

Goals on 2 cores: fully_async's median time to each threshold <= 0.7x sync's, in both
variants, and its slowest run still faster than sync's median (a spread small enough to trust
the medians); throughput fully_async >= 1.8x sync and one_step_off >= 1.4x (default variant).

Ends with ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` lines
(``streamrl.testing.result_line``): ``<variant>_fully_async_time_to_<t>_vs_sync`` (median
ratio) and ``<variant>_fully_async_time_to_<t>_worst_vs_sync`` (slowest fully_async run over
sync's median) for each variant and threshold, then ``one_step_off_vs_sync`` and
``fully_async_vs_sync`` (throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from streamrl.config import MODES, Config, load_config
from streamrl.controller import Controller
from streamrl.report import ROLLING, ReportError, Run, load_run
from streamrl.runtime import build_runtime
from streamrl.testing import result_line

THRESHOLDS = (0.5, 0.9)
LONG_TAIL_SHARE = 0.25
LONG_TAIL_FACTOR = 8
VARIANTS = {"default": MODES, "long_tail": ("sync", "fully_async")}
"""Modes run per variant (``--modes`` filters both): one_step_off is left out of the long tail,
whose runs take 2-4 minutes each, to keep one invocation within ~30 minutes on 2 cores."""
TIME_GOAL = 0.7
THROUGHPUT_GOALS = {"one_step_off": 1.4, "fully_async": 1.8}
PHASES = {"take": "timing_s/take", "prepare": "timing_s/old_log_prob",
          "update": "timing_s/update_actor", "publish": "timing_s/update_weights",
          "step": "timing_s/step"}
"""Phase name -> the metric holding its seconds per step (docs/metrics.md)."""
WATCH_S = 0.5


@dataclass
class RunResult:
    variant: str
    mode: str
    seed: int
    steps: int
    wall_s: float
    reached: dict[str, tuple[float, int] | None]
    """Threshold (as text) -> (seconds, step) when the rolling reward first reached it."""
    traj_per_s: float
    phases: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step after the warmup, by PHASES name."""
    rollouter_idle: float = 0.0


def variant_overrides(variant: str, cfg: Config) -> list[str]:
    if variant == "default":
        return []
    return [f"task.long_tail={LONG_TAIL_SHARE}",
            f"task.long_tail_tokens={LONG_TAIL_FACTOR * cfg.rollout.max_new_tokens}"]


def reached(run: Run, threshold: float) -> tuple[float, int] | None:
    """Wall seconds and step at which the rolling reward first reaches ``threshold``."""
    hits = (run.rolling_reward() >= threshold).nonzero()[0]
    return (float(run.wall[hits[0]]), int(run.steps[hits[0]])) if hits.size else None


def watch(controller: Controller, run_dir: str, deadline: float, done: threading.Event,
          last: float) -> None:
    """Stop the run once its rolling reward has crossed ``last``, or at the deadline. It reads
    ``metrics.jsonl`` as ``streamrl report`` would, so the stop rule is the measure."""
    while not done.wait(WATCH_S):
        if time.monotonic() > deadline:
            break
        try:
            if reached(load_run(run_dir), last) is not None:
                break
        except ReportError:  # no step logged yet
            continue
    controller.stop()


def measure(variant: str, mode: str, seed: int, args: argparse.Namespace, run_dir: str,
            thresholds: tuple[float, ...] = THRESHOLDS) -> RunResult:
    """One run (``args``: max_steps, run_timeout, warmup, overrides), stopped once its rolling
    reward crosses the last of ``thresholds``."""
    base = load_config([f"trainer.mode={mode}", *args.overrides])
    cfg = load_config([
        f"trainer.mode={mode}", f"trainer.total_steps={args.max_steps}",
        "trainer.logger=[jsonl]", f"trainer.output_dir={run_dir}", "runtime.num_cpus=2",
        *(f"{part}.seed={seed}" for part in ("trainer", "learner", "rollout", "task")),
        *variant_overrides(variant, base), *args.overrides,
    ])
    with build_runtime(cfg) as runtime:
        controller = Controller(cfg, runtime)
        done = threading.Event()
        watcher = threading.Thread(target=watch, daemon=True, args=(
            controller, run_dir, time.monotonic() + args.run_timeout, done, thresholds[-1]))
        watcher.start()
        try:
            controller.fit()
        finally:
            done.set()
            watcher.join()
    run = load_run(run_dir)
    steady = run.rows[args.warmup:]
    step_s = sum(row["timing_s/step"] for row in steady)
    return RunResult(
        variant, mode, seed, steps=len(run.rows), wall_s=float(run.wall[-1]),
        reached={str(t): reached(run, t) for t in thresholds},
        traj_per_s=len(steady) * cfg.task.train_batch_size * cfg.rollout.n / step_s,
        phases={name: statistics.fmean(row[key] for row in steady)
                for name, key in PHASES.items()},
        rollouter_idle=statistics.fmean(row.get("rollouter/idle_ratio", 0.0) for row in steady),
    )


def seconds_to(results: list[RunResult], threshold: float) -> list[float]:
    """Each run's seconds to ``threshold``. A run that stopped before reaching it counts as its
    wall time at the stop, a lower bound: a sync run's makes the ratio an upper bound (the
    cautious side for a <= goal), and an unreached fully_async run fails its goals outright."""
    return [r.reached[str(threshold)][0] if r.reached[str(threshold)] else r.wall_s
            for r in results]


def steps_to(results: list[RunResult], threshold: float) -> list[str]:
    return [str(r.reached[str(threshold)][1]) if r.reached[str(threshold)] else f">{r.steps}"
            for r in results]


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def report(variant: str, by_mode: dict[str, list[RunResult]]) -> list[str]:
    """Print the variant's table; return its RESULT lines."""
    print(f"\n== {variant}: median (min-max) over {len(by_mode['sync'])} seeds ==")
    print(f"{'mode':<13}" + "".join(f"{f'time to {t} s':>22}{'steps':>14}" for t in THRESHOLDS)
          + f"{'traj/s':>9}{'vs sync':>9}")
    sync_tp = statistics.median(r.traj_per_s for r in by_mode["sync"])
    for mode, results in by_mode.items():
        cells = ""
        for t in THRESHOLDS:
            secs = seconds_to(results, t)
            cells += f"{statistics.median(secs):>9.1f} ({spread(secs):>10})"
            cells += f"{' '.join(steps_to(results, t)):>14}"
        tp = statistics.median(r.traj_per_s for r in results)
        print(f"{mode:<13}{cells}{tp:>9.1f}{tp / sync_tp:>8.2f}x")
    print(f"{'mode':<13}" + "".join(f"{name + ' s':>11}" for name in PHASES)
          + f"{'rollouter idle':>16}")
    for mode, results in by_mode.items():
        print(f"{mode:<13}" + "".join(
            f"{statistics.median(r.phases[name] for r in results):>11.3f}" for name in PHASES)
            + f"{statistics.median(r.rollouter_idle for r in results):>16.2f}")
    if "fully_async" not in by_mode:
        return []
    lines = []
    for t in THRESHOLDS:
        sync = statistics.median(seconds_to(by_mode["sync"], t))
        fully = seconds_to(by_mode["fully_async"], t)
        missed = any(r.reached[str(t)] is None for r in by_mode["fully_async"])
        name = f"{variant}_fully_async_time_to_{t}"
        median, worst = statistics.median(fully) / sync, max(fully) / sync
        lines.append(result_line(f"{name}_vs_sync", median, "<=", TIME_GOAL,
                                 met=not missed and median <= TIME_GOAL))
        lines.append(result_line(f"{name}_worst_vs_sync", worst, "<=", 1.0,
                                 met=not missed and worst <= 1.0))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per mode and variant")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list; sync is the base")
    parser.add_argument("--max-steps", type=int, default=200, help="step cap per run")
    parser.add_argument("--run-timeout", type=float, default=150.0,
                        help="wall seconds per run after its loop starts")
    parser.add_argument("--warmup", type=int, default=4,
                        help="steps left out of throughput and phase times")
    parser.add_argument("--out", help="keep the run dirs and modes.json here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    variants = args.variants.split(",")
    modes = args.modes.split(",")
    if "sync" not in modes or not set(variants) <= set(VARIANTS):
        parser.error(f"--modes must include sync; --variants must be among {VARIANTS}")
    out = Path(args.out or tempfile.mkdtemp(prefix="streamrl-modes-"))
    results: list[RunResult] = []
    began = time.monotonic()
    for seed in range(args.seeds):
        for variant in variants:
            for mode in (m for m in modes if m in VARIANTS[variant]):
                run_dir = out / variant / f"{mode}-s{seed}"
                results.append(measure(variant, mode, seed, args, str(run_dir)))
                r = results[-1]
                print(f"[{time.monotonic() - began:6.0f} s] {variant} {mode} seed {seed}: "
                      f"{r.steps} steps, reached {r.reached}, {r.traj_per_s:.1f} traj/s",
                      flush=True)
    (out / "modes.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    lines = []
    for variant in variants:
        by_mode = {m: [r for r in results if r.variant == variant and r.mode == m]
                   for m in modes if m in VARIANTS[variant]}
        lines += report(variant, by_mode)
    if "default" in variants:
        default = {m: [r for r in results if r.variant == "default" and r.mode == m]
                   for m in modes if m in VARIANTS["default"]}
        sync_tp = statistics.median(r.traj_per_s for r in default["sync"])
        for mode, goal in THROUGHPUT_GOALS.items():
            if mode in default:
                tp = statistics.median(r.traj_per_s for r in default[mode]) / sync_tp
                lines.append(result_line(f"{mode}_vs_sync", tp, ">=", goal))
    print(f"\nrolling mean of {ROLLING} steps; run dirs and modes.json in {out} "
          f"({time.monotonic() - began:.0f} s in all)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
