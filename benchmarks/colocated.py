"""Co-located hybrid workers against the disaggregated layout, on the same cores in one run.

Each case is a real ``streamrl train`` (vLLM on CPU, FSDP2 learner, Ray) on the default toy
task, 2 CPUs:

- ``disaggregated``: a learner actor and a replica actor (one CPU each), weights over the
  collective bus (gloo broadcast into the replica's engine);
- ``colocated``: one hybrid worker holding both on the two CPUs, weights swapped in place
  (``runtime.placement=colocated weight_bus.backend=colocated``).

Cases run ``--repeats`` times, the layouts alternating, and each figure is the median over the
repeats (one machine's speed drifts by up to 1.4x between two identical runs). Printed per
layout and mode: steady-state steps/s (the first ``--warmup`` steps, engine start-up
included, are left out), the median weight swap (``timing_s/update_weights``: from the publish
call until the engine serves the new version), reward at the end, and the peak memory of the
run's worker processes (PSS, summed over Ray actors and engine cores, sampled every 0.2 s).
The swap is measured twice: on the toy model (~0.5 MB, where fixed costs dominate) and on a
~67 MB model (``--swap-steps`` steps each) where the bytes do.

    .venv/bin/python benchmarks/colocated.py [--steps 12] [--warmup 3] [--repeats 3]

Goals (issue 12): (a) in-place swap <= 0.5x the collective publish of the same weights, (b)
colocated sync steps/s >= 1.0x disaggregated sync. Also measured: fully_async in both layouts
(the engine generating while the learner trains on the same cores). Ends with one
``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import psutil

from streamrl.config import load_config
from streamrl.controller import run_training
from streamrl.testing import build_tiny_model, result_line

LAYOUTS = {
    "disaggregated": [],
    "colocated": ["runtime.placement=colocated", "weight_bus.backend=colocated"],
}
WORKER_TITLES = ("ray::", "VLLM::EngineCore")
"""Process titles of the run's workers (Ray actors, vLLM engine cores), not Ray's daemons."""


@contextmanager
def peak_worker_memory() -> Iterator[list[float]]:
    """Yields a one-element list holding, once the block ends, the peak summed PSS (bytes) of
    this process's worker descendants."""
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not done.wait(0.2):
            total = 0
            for proc in me.children(recursive=True):
                try:
                    if any(t in " ".join(proc.cmdline()) for t in WORKER_TITLES):
                        total += proc.memory_full_info().pss
                except psutil.Error:
                    continue  # it ended between the listing and the read
            peak[0] = max(peak[0], float(total))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def run(layout: str, mode: str, steps: int, warmup: int, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out, peak_worker_memory() as peak:
        cfg = load_config([
            f"trainer.mode={mode}", f"trainer.total_steps={steps + warmup}", "trainer.logger=[]",
            f"trainer.output_dir={out}", "runtime.num_cpus=2", *LAYOUTS[layout], *extra,
        ])
        history = run_training(cfg).history[warmup:]
    return {
        "steps_per_s": len(history) / sum(h["timing_s/step"] for h in history),
        "swap_s": statistics.median(h["timing_s/update_weights"] for h in history),
        "reward": history[-1]["reward/mean"],
        "peak_gib": peak[0] / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out per case")
    parser.add_argument("--swap-steps", type=int, default=6,
                        help="measured steps per layout with the 67 MB model")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median)")
    args = parser.parse_args()

    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as models:
        medium = build_tiny_model(Path(models) / "medium", hidden_size=512, num_layers=4,
                                  num_heads=16, intermediate_size=2048)
        for _ in range(args.repeats):
            for mode in ("sync", "fully_async", "sync, 67 MB"):
                for layout in LAYOUTS:
                    if mode == "sync, 67 MB":
                        r = run(layout, "sync", args.swap_steps, 2, [f"model.path={medium}"])
                    else:
                        r = run(layout, mode, args.steps, args.warmup, [])
                    runs.setdefault((layout, mode), []).append(r)
                    print(f"{layout} {mode}: {r}", flush=True)
    results = {case: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for case, rs in runs.items()}
    swaps = {layout: results[layout, "sync, 67 MB"] for layout in LAYOUTS}

    print(f"{'layout':<15}{'mode':<13}{'steps/s':>8}{'swap ms':>9}{'reward':>8}{'peak GiB':>10}")
    for (layout, mode), r in results.items():
        print(f"{layout:<15}{mode:<13}{r['steps_per_s']:>8.2f}{r['swap_s'] * 1e3:>9.1f}"
              f"{r['reward']:>8.3f}{r['peak_gib']:>10.2f}")

    def ratio(a: dict[str, float], b: dict[str, float], key: str) -> float:
        return a[key] / b[key]

    sync_c, sync_d = results["colocated", "sync"], results["disaggregated", "sync"]
    async_c, async_d = results["colocated", "fully_async"], results["disaggregated", "fully_async"]
    print(f"colocated / disaggregated: sync steps/s {ratio(sync_c, sync_d, 'steps_per_s'):.2f}x, "
          f"fully_async steps/s {ratio(async_c, async_d, 'steps_per_s'):.2f}x, colocated "
          f"fully_async / sync {ratio(async_c, sync_c, 'steps_per_s'):.2f}x; peak memory sync "
          f"{ratio(sync_c, sync_d, 'peak_gib'):.2f}x")
    print(result_line("inplace_swap_vs_collective_toy", ratio(sync_c, sync_d, "swap_s"), "<=",
                      0.5))
    print(result_line("inplace_swap_vs_collective_67mb",
                      ratio(swaps["colocated"], swaps["disaggregated"], "swap_s"), "<=", 0.5))
    print(result_line("colocated_vs_disaggregated_sync_steps",
                      ratio(sync_c, sync_d, "steps_per_s"), ">=", 1.0))
    print(result_line("colocated_vs_disaggregated_sync_steps_67mb",
                      ratio(swaps["colocated"], swaps["disaggregated"], "steps_per_s"), ">=", 1.0))


if __name__ == "__main__":
    main()
