"""``streamrl report RUN_DIR [RUN_DIR ...]``: PNG plots and a Markdown summary of recorded runs.

A run directory is a ``trainer.output_dir``; its ``metrics.jsonl`` (one JSON object per step,
written by ``metrics.MetricsLogger``) is all this module reads.

- ``load_run(dir) -> Run``: the step rows in step order. A resumed run appends rows for steps
  the killed run had already logged: the later rows replace them (wall time still counts the
  work that was thrown away). A line that is not a JSON object with a step (a killed run's
  torn last line) is counted and skipped.
- ``write_report(dirs, out) -> summary.md``: one PNG per topic in ``FIGURES`` with the runs side
  by side, and a table comparing them (``summary.md`` embeds the PNGs by relative links).

A metric no run logged is left out (older runs have no idle ratios or token staleness): a panel
is drawn, and a table row written, only when some run has it.
Depends on numpy and matplotlib only: no Ray, torch or streamrl imports.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROLLING = 5
"""Steps in the rolling mean of the reward (final / best reward, time to a threshold)."""
THRESHOLDS = (0.5, 0.9)
RENAMED = {"timing/step": "timing_s/step", "timing/take": "timing_s/take",
           "throughput/tokens_per_s": "perf/throughput"}
"""Keys of runs recorded before the metrics took verl's names, read under the new names."""
DPI = 90  # small PNGs: the README embeds one


class ReportError(Exception):
    """A run directory that cannot be reported on; the CLI prints it as one line."""


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    rows: list[dict[str, float]]
    """One per step, in step order."""
    wall: np.ndarray
    """Seconds since the run started, per row."""
    skipped: int
    """Lines of metrics.jsonl that were not a step row."""
    resumes: int

    @property
    def steps(self) -> np.ndarray:
        return self.column("step")

    def column(self, key: str) -> np.ndarray:
        """The metric per row, NaN where a row lacks it (matplotlib leaves a gap there)."""
        return np.array([row.get(key, np.nan) for row in self.rows], dtype=np.float64)

    def has(self, key: str) -> bool:
        return any(key in row for row in self.rows)

    def mean(self, key: str) -> float:
        return float(np.nanmean(self.column(key)))

    def rolling_reward(self) -> np.ndarray:
        return rolling_mean(self.column("reward/mean"))


def rolling_mean(values: np.ndarray, window: int = ROLLING) -> np.ndarray:
    """Trailing mean over ``window`` steps (the whole run if shorter); NaN before the first
    full window, so one lucky early step does not count as reaching a threshold."""
    window = min(window, len(values))
    out = np.full(len(values), np.nan)
    if window:
        out[window - 1:] = np.convolve(values, np.ones(window) / window, mode="valid")
    return out


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"no metrics.jsonl in {path} (a run directory is a trainer.output_dir)")
    logged: list[dict[str, float]] = []  # every step row, in the order the processes wrote them
    skipped = 0
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            logged.append({RENAMED.get(key, key): value for key, value in row.items()})
        else:
            skipped += 1
    if not logged:
        raise ReportError(f"no step rows in {metrics}")
    wall = _wall_times(logged)
    kept: list[int] = []
    for i, row in enumerate(logged):
        # A resumed run starts again at its checkpoint: its rows replace the killed run's.
        while kept and logged[kept[-1]]["step"] >= row["step"]:
            kept.pop()
        kept.append(i)
    return Run(path.resolve().name, path, [logged[i] for i in kept], wall[kept], skipped,
               resumes=sum(_resumed(logged, i) for i in range(len(logged))))


def _resumed(logged: list[dict[str, float]], i: int) -> bool:
    return i > 0 and logged[i]["step"] <= logged[i - 1]["step"]


def _wall_times(logged: list[dict[str, float]]) -> np.ndarray:
    """Seconds the run's processes spent up to each row, steps a resumed run did again
    included (the downtime between a kill and its resume is unknown and left out):
    ``time/elapsed_s`` where every row has it (a resumed process starts its clock again, so
    its rows continue from the row before), else the sum of step times (startup left out)."""
    if not all("time/elapsed_s" in row for row in logged):
        return np.cumsum([row.get("timing_s/step", 0.0) for row in logged])
    wall = np.empty(len(logged))
    offset = 0.0
    for i, row in enumerate(logged):
        if _resumed(logged, i):
            offset = wall[i - 1]
        wall[i] = offset + row["time/elapsed_s"]
    return wall


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Line style tells the keys apart, colour the runs."""
    x: str = "step"
    """step | wall"""
    smooth: bool = False
    """Draw the per-step values faint and their rolling mean on top."""


FIGURES: dict[str, tuple[Panel, ...]] = {
    "reward": (
        Panel("reward vs step", ("reward/mean",), smooth=True),
        Panel("reward vs wall time", ("reward/mean",), x="wall", smooth=True),
    ),
    "staleness": (
        Panel("group staleness (steps)", ("staleness/mean", "staleness/max")),
        Panel("token staleness (steps)",
              ("staleness/token_mean", "staleness/token_p90", "staleness/token_max")),
    ),
    "throughput": (
        Panel("trained tokens/s", ("perf/throughput",)),
        Panel("step time, waiting for data (take) (s)", ("timing_s/step", "timing_s/take")),
    ),
    "idle": (Panel("idle ratio", ("trainer/idle_ratio", "rollouter/idle_ratio")),),
    "kl_entropy": (
        Panel("KL", ("actor/ppo_kl", "actor/kl_loss")),
        Panel("entropy", ("actor/entropy",)),
    ),
}
STYLES = ("-", "--", ":", "-.")


def plot(runs: list[Run], name: str, panels: tuple[Panel, ...], out: Path) -> Path | None:
    """One PNG with a panel per drawable entry of ``panels``; None when no run has any key."""
    # The object API, not pyplot: no global figure state or display backend (PNG is Agg).
    from matplotlib.figure import Figure

    drawn = [p for p in panels if any(run.has(key) for run in runs for key in p.keys)]
    if not drawn:
        return None
    fig = Figure(figsize=(5.5 * len(drawn), 3.6), layout="constrained")
    for ax, panel in zip(fig.subplots(1, len(drawn), squeeze=False)[0], drawn):
        for color, run in enumerate(runs):
            x = run.wall if panel.x == "wall" else run.steps
            for style, key in zip(STYLES, panel.keys):
                if not run.has(key):
                    continue
                names = [run.label] * (len(runs) > 1) + [key] * (len(panel.keys) > 1)
                y = run.column(key)
                if panel.smooth:
                    ax.plot(x, y, color=f"C{color}", alpha=0.25, linewidth=1)
                    y = rolling_mean(y)
                    names.append(f"rolling mean of {ROLLING}")
                ax.plot(x, y, color=f"C{color}", linestyle=style,
                        label=", ".join(names) or None)
        ax.set_title(panel.title)
        ax.set_xlabel("wall time (s)" if panel.x == "wall" else "step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # one run, one key: the title says it all
            ax.legend(fontsize=8)
    target = out / f"{name}.png"
    fig.savefig(target, dpi=DPI)
    return target


def _time_to(run: Run, threshold: float) -> str:
    reached = np.flatnonzero(run.rolling_reward() >= threshold)
    if not reached.size:
        return "not reached"
    i = reached[0]
    return f"{run.wall[i]:.1f} s (step {int(run.steps[i])})"


def _cell(run: Run, key: str, fmt: str) -> str:
    return fmt.format(run.mean(key)) if run.has(key) else "—"


def summary_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """The comparison table: (row name, one cell per run)."""
    rolled = [run.rolling_reward() for run in runs]
    rows = [
        ("steps", [str(len(run.rows)) for run in runs]),
        ("wall time", [f"{run.wall[-1]:.1f} s" for run in runs]),
        (f"final reward (mean of last {ROLLING} steps)", [f"{r[-1]:.3f}" for r in rolled]),
        (f"best reward (rolling mean of {ROLLING})", [f"{np.nanmax(r):.3f}" for r in rolled]),
        *((f"rolling reward ≥ {t} at", [_time_to(run, t) for run in runs]) for t in THRESHOLDS),
    ]
    means = (("mean staleness (groups)", "staleness/mean", "{:.2f}"),
             ("mean staleness (tokens)", "staleness/token_mean", "{:.2f}"),
             ("mean tokens/s", "perf/throughput", "{:.0f}"),
             ("mean trainer idle ratio", "trainer/idle_ratio", "{:.2f}"),
             ("mean rollouter idle ratio", "rollouter/idle_ratio", "{:.2f}"))
    rows += [(name, [_cell(run, key, fmt) for run in runs])
             for name, key, fmt in means if any(run.has(key) for run in runs)]
    return rows


def _markdown(runs: list[Run], figures: list[Path]) -> str:
    lines = ["# streamrl report", "",
             "| | " + " | ".join(run.label for run in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in summary_rows(runs)]
    lines += ["", f"Rolling reward: the mean of the last {ROLLING} steps. Wall time: "
              "`time/elapsed_s` where the run logged it, else the sum of step times (startup "
              "left out); steps a resumed run did again count, the downtime before it does not.",
              ""]
    for run in runs:
        notes = [f"`{run.path}`"]
        if run.skipped:
            notes.append(f"skipped {run.skipped} unreadable line(s) of metrics.jsonl")
        if run.resumes:
            notes.append(f"resumed {run.resumes} time(s): rows of steps run again replace the "
                         "earlier ones")
        lines.append(f"- {run.label}: " + "; ".join(notes))
    for figure in figures:
        lines += ["", f"## {figure.stem}", "", f"![{figure.stem}]({figure.name})"]
    return "\n".join(lines) + "\n"


def write_report(dirs: list[str], out: str | None = None) -> Path:
    """Plots and ``summary.md`` into ``out`` (default: the run dir, or ``report/`` for several
    runs); returns the summary's path."""
    runs = [load_run(d) for d in dirs]
    labels = [run.label for run in runs]
    if len(set(labels)) < len(labels):  # e.g. two `out/` dirs: tell them apart by path
        runs = [dataclasses.replace(run, label=str(run.path)) for run in runs]
    target = Path(out) if out else (runs[0].path if len(runs) == 1 else Path("report"))
    target.mkdir(parents=True, exist_ok=True)
    figures = [f for name, panels in FIGURES.items() if (f := plot(runs, name, panels, target))]
    summary = target / "summary.md"
    summary.write_text(_markdown(runs, figures), encoding="utf-8")
    return summary
