"""Learner throughput of one_step_off and fully_async against sync, same machine/model/task.

Runs ``streamrl train`` (real vLLM replica, FSDP2 learner, gloo weight bus, Ray) once per mode
with one rollout process and one learner process, each pinned to its own core
(``runtime.pin_cpus=true``), and reports trajectories trained per second over the steady-state
steps (the first ``--warmup`` steps, which include engine start-up, are excluded), as a ratio
against sync measured in the same run, plus the absolute numbers.

    .venv/bin/python benchmarks/modes.py [--steps 20] [--warmup 4] [key=value ...]

Goals on 2 cores: fully_async >= 1.8x sync, one_step_off >= 1.4x sync.

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(one_step_off_vs_sync and fully_async_vs_sync; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from streamrl.config import MODES, load_config
from streamrl.controller import run_training
from streamrl.testing import result_line

GOALS = {"one_step_off": 1.4, "fully_async": 1.8}


def measure(mode: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config([
            f"trainer.mode={mode}", f"trainer.total_steps={steps + warmup}",
            "trainer.logger=[]", f"trainer.output_dir={out}", "runtime.num_cpus=2",
            "runtime.pin_cpus=true", *overrides,
        ])
        history = run_training(cfg).history[warmup:]
    seconds = sum(h["timing_s/step"] for h in history)
    trajectories = len(history) * cfg.task.train_batch_size * cfg.rollout.n
    return {
        "traj_per_s": trajectories / seconds,
        "seconds": seconds,
        "take_s": sum(h["timing_s/take"] for h in history) / len(history),
        "update_s": sum(h["timing_s/update_actor"] for h in history) / len(history),
        "reward": history[-1]["reward/mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=4, help="steps excluded per mode")
    parser.add_argument("overrides", nargs="*", help="config overrides for every mode")
    args = parser.parse_args()
    results = {mode: measure(mode, args.steps, args.warmup, args.overrides) for mode in MODES}
    base = results["sync"]["traj_per_s"]
    print(f"{'mode':<14}{'traj/s':>9}{'vs sync':>9}{'take s/step':>13}{'update s/step':>15}")
    for mode, r in results.items():
        print(f"{mode:<14}{r['traj_per_s']:>9.1f}{r['traj_per_s'] / base:>8.2f}x"
              f"{r['take_s']:>13.3f}{r['update_s']:>15.3f}")
    for mode, goal in GOALS.items():
        print(result_line(f"{mode}_vs_sync", results[mode]["traj_per_s"] / base, ">=", goal))


if __name__ == "__main__":
    main()
