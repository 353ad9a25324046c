"""The speed-up model of docs/speedup.md, fitted to benchmarks/modes.py's runs and projected.

Per step, with the phase seconds modes.py records (medians over seeds):

    sync:        T_sync  = t_R + t_T + t_W + t_O
    fully_async: T_async = max(t_R_busy, (1 + c) t_T, t_lat / (eta + 1)) + t_W + t_O

- t_R: the sync learner's wait for a batch (``take``): generation of the whole batch, ended
  by its longest group;
- t_T: training (``prepare`` + ``update``); c: how much slower it runs while the engine
  generates beside it (shared cores, memory bandwidth), fitted from the fully_async runs;
- t_R_busy: the replica's busy seconds per fully_async step (the engine kept full: no tail);
- t_lat / (eta + 1): the staleness bound. A group has to be taken within eta versions of the
  one it started on, so a step cannot be shorter than 1 / (eta + 1) of the longest group's
  generation latency t_lat (bounded here by the sync batch's, t_R);
- t_W: publish (gather, broadcast, the replicas' loads); t_O: the rest of the step (batching,
  advantages, logging), paid in every mode.

slime's bound is the same without c, t_R_busy, the latency term and t_O:
(t_R + t_T + t_W) / (max(t_R, t_T) + t_W). Time to reward divides further by kappa =
steps_async / steps_sync to the threshold (measured: how much the one-version-stale batches
cost in samples).

    .venv/bin/python benchmarks/speedup_model.py RUNS/modes.json

prints the fit, the predicted against the measured ratios per variant, and the GPU
projection of docs/speedup.md (labelled as such). Ends with ``RESULT
<variant>_model_error value=<x> goal=<=0.1`` lines: |predicted - measured| / measured of the
fully_async / sync step-time ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from streamrl.testing import result_line

MODEL_ERROR_GOAL = 0.1
ETA = 1  # buffer.max_staleness, the fully_async default


@dataclass(frozen=True)
class Phases:
    t_R: float
    t_T: float
    t_W: float
    t_O: float

    @property
    def sync_step(self) -> float:
        return self.t_R + self.t_T + self.t_W + self.t_O


def async_step(p: Phases, busy: float, c: float, t_lat: float, eta: int) -> float:
    return max(busy, (1 + c) * p.t_T, t_lat / (eta + 1)) + p.t_W + p.t_O


def slime_bound(t_R: float, t_T: float, t_W: float) -> float:
    return (t_R + t_T + t_W) / (max(t_R, t_T) + t_W)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r["phases"][key] for r in runs)


def phases_of(runs: list[dict]) -> Phases:
    t_R, t_W = median(runs, "take"), median(runs, "publish")
    t_T = statistics.median(r["phases"]["prepare"] + r["phases"]["update"] for r in runs)
    return Phases(t_R, t_T, t_W, median(runs, "step") - t_R - t_T - t_W)


def to_threshold(runs: list[dict], threshold: str, index: int) -> float | None:
    """Median seconds (index 0) or steps (1) to ``threshold``; None if a run missed it."""
    hits = [r["reached"][threshold] for r in runs]
    return None if None in hits else statistics.median(h[index] for h in hits)


def fit(variant: str, runs: list[dict]) -> str:
    """Print the variant's fit and checks; return its RESULT line."""
    sync = [r for r in runs if r["mode"] == "sync"]
    fully = [r for r in runs if r["mode"] == "fully_async"]
    p = phases_of(sync)
    t_T_async = statistics.median(r["phases"]["prepare"] + r["phases"]["update"] for r in fully)
    c = t_T_async / p.t_T - 1
    measured_async = median(fully, "step")
    busy = statistics.median(r["phases"]["step"] * (1 - r["rollouter_idle"]) for r in fully)
    predicted = async_step(p, busy, c, p.t_R, ETA)
    print(f"\n== {variant} ({len(sync)} sync, {len(fully)} fully_async runs) ==")
    print(f"fit: t_R={p.t_R:.3f} t_T={p.t_T:.3f} t_W={p.t_W:.3f} t_O={p.t_O:.3f} s; "
          f"c={c:+.2f}; t_R_busy={busy:.3f} s; t_lat/(eta+1)<={p.t_R / (ETA + 1):.3f} s")
    bound = max(("rollout (t_R_busy)", busy), ("learner ((1+c) t_T)", (1 + c) * p.t_T),
                ("staleness (t_lat/(eta+1))", p.t_R / (ETA + 1)), key=lambda kv: kv[1])[0]
    print(f"bottleneck of a fully_async step: {bound}")
    speedup, measured = p.sync_step / predicted, median(sync, "step") / measured_async
    print(f"step speed-up  slime bound {slime_bound(p.t_R, p.t_T, p.t_W):.2f}x   "
          f"model {speedup:.2f}x   measured {measured:.2f}x")
    for threshold in sorted({t for r in runs for t in r["reached"]}):
        steps_s, steps_a = to_threshold(sync, threshold, 1), to_threshold(fully, threshold, 1)
        secs_s, secs_a = to_threshold(sync, threshold, 0), to_threshold(fully, threshold, 0)
        if None in (steps_s, steps_a, secs_s, secs_a):
            print(f"time to {threshold}: a run missed it; no check")
            continue
        kappa = steps_a / steps_s
        print(f"time to {threshold}: kappa={kappa:.2f} (steps {steps_a:.0f} vs {steps_s:.0f}); "
              f"time ratio model kappa/speed-up={kappa / speedup:.2f}  "
              f"measured={secs_a / secs_s:.2f}")
    error = abs(1 / speedup - 1 / measured) * measured
    return result_line(f"{variant}_model_error", error, "<=", MODEL_ERROR_GOAL)


PROJECTIONS = (
    # name, t_R and t_W as shares of a colocated sync step (t_T the rest), tau: the share of
    # t_R the engine spends draining the batch's longest responses
    ("short answers, little tail", 0.50, 0.05, 0.10),
    ("reasoning, long tail", 0.70, 0.03, 0.40),
    ("long reasoning, heavy tail", 0.80, 0.02, 0.60),
)
PROJECTION_ETAS = (1, 4)


def project() -> None:
    """docs/speedup.md's GPU projection, from ASSUMED phase shares (not measurements). The
    longest group's latency is taken as t_R: a big sync batch starts every group at once and
    ends with its longest."""
    print("\n== PROJECTION for GPU clusters: assumed phase shares, not measurements ==")
    print(f"{'workload':<28}{'t_R':>6}{'t_T':>6}{'t_W':>6}{'tau':>6}{'slime':>8}"
          + "".join(f"{f'same eta={e}':>13}" for e in PROJECTION_ETAS)
          + "".join(f"{f'coloc eta={e}':>14}" for e in PROJECTION_ETAS))
    for name, t_R, t_W, tau in PROJECTIONS:
        t_T = 1 - t_R - t_W
        busy = (1 - tau) * t_R
        # same pools: sync and async on the same disaggregated pools (slime's comparison).
        same = [1 / (max(busy, t_T, t_R / (eta + 1)) + t_W) for eta in PROJECTION_ETAS]
        # vs colocated sync on the same devices: async splits them between the pools in
        # proportion to the work, so both sides take busy + t_T; only the tail is saved.
        coloc = [1 / (max(busy + t_T, t_R / (eta + 1)) + t_W) for eta in PROJECTION_ETAS]
        print(f"{name:<28}{t_R:>6.2f}{t_T:>6.2f}{t_W:>6.2f}{tau:>6.2f}"
              f"{slime_bound(t_R, t_T, t_W):>7.2f}x"
              + "".join(f"{x:>12.2f}x" for x in same) + "".join(f"{x:>13.2f}x" for x in coloc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modes_json", help="modes.json written by benchmarks/modes.py --out")
    args = parser.parse_args()
    runs = json.loads(Path(args.modes_json).read_text())
    lines = [fit(variant, [r for r in runs if r["variant"] == variant])
             for variant in dict.fromkeys(r["variant"] for r in runs)]
    project()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
