"""What a user sees of a run: a quiet console with progress, every documented metric in the
JSONL (and nothing undocumented), a Chrome trace, and `streamrl report` on the run.

One short default `streamrl train` (the CLI, as a user runs it; output to a pipe, so plain
progress lines) serves every test here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrl.metrics import Progress

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 6
CATALOG = Path(__file__).parents[1] / "docs" / "metrics.md"
PROGRESS = re.compile(rf"^step \d+/{STEPS} \| eta ")


@dataclass
class Run:
    output: list[str]
    records: list[dict[str, float]]
    out_dir: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    out_dir = tmp_path_factory.mktemp("observed-run")
    done = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "train", f"model.path={tiny_model_dir}",
         f"trainer.total_steps={STEPS}", f"trainer.output_dir={out_dir}", "trainer.trace=true"],
        capture_output=True, text=True, timeout=600,
    )
    output = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(output[-30:])
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(output, records, out_dir)


def catalog_keys() -> tuple[set[str], list[str]]:
    """(keys of the "Every run" tables, every key pattern on the page; ``<x>`` is a wildcard)."""
    text = CATALOG.read_text()
    every_run = text.split("## Every run", 1)[1].split("\n## ", 1)[0]

    def keys(section: str) -> list[str]:
        return [key for line in section.splitlines() if line.startswith("| `")
                for key in re.findall(r"`([a-z_]+(?:/[a-z_0-9<>]+)+|step)`",
                                      line.split(" | ")[0])]

    return set(keys(every_run)), keys(text)


def test_the_console_shows_progress_and_little_else(run: Run) -> None:
    progress = [line for line in run.output if PROGRESS.match(line)]
    assert [int(line.split()[1].split("/")[0]) for line in progress] == list(range(1, STEPS + 1))
    assert all(" reward " in line and " tok/s " in line and " buffer " in line
               for line in progress)
    assert "idle learner" in progress[-1] and "| rollout " in progress[-1]
    other = [line for line in run.output if not PROGRESS.match(line) and " INFO " not in line]
    assert len(other) < 10, "\n".join(other)


def test_every_documented_metric_is_logged_and_every_logged_one_documented(run: Run) -> None:
    every_run, patterns = catalog_keys()
    last = run.records[-1]
    assert sorted(every_run - last.keys()) == []
    documented = [re.compile("^" + re.sub(r"<[a-z]+>", "[a-z_0-9]+", p) + "$") for p in patterns]
    undocumented = [k for r in run.records for k in r
                    if not any(d.match(k) for d in documented)]
    assert sorted(set(undocumented)) == []
    for r in run.records[1:]:
        assert 0.0 <= r["trainer/idle_ratio"] <= 1.0 and 0.0 <= r["rollouter/idle_ratio"] <= 1.0
        assert r["staleness/token_max"] <= 1  # the fully_async default bound
    assert [r["step"] for r in run.records] == list(range(1, STEPS + 1))


def test_the_trace_shows_learner_phases_and_replica_generation(run: Run) -> None:
    events = json.loads((run.out_dir / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    learner = [e["name"] for e in spans if e["pid"] == 1]
    assert learner == ["take", "prepare", "update", "publish"] * STEPS
    generate = [e for e in spans if e["pid"] == 2 and e["name"] == "generate"]
    updates = [e for e in spans if e["pid"] == 2 and e["name"].startswith("weights v")]
    # The learner does not wait for replicas to load: the last version may still be loading
    # when the run ends.
    assert generate and len(updates) in (STEPS - 1, STEPS)
    assert all(e["dur"] >= 0 for e in spans)
    # spans sit on one clock: every replica span falls inside the run's learner time
    start = min(e["ts"] for e in spans if e["pid"] == 1)
    end = max(e["ts"] + e["dur"] for e in spans if e["pid"] == 1)
    assert all(start - 120e6 < e["ts"] < end for e in generate)


def test_report_plots_the_run(run: Run, tmp_path: Path) -> None:
    from streamrl.cli import main

    assert main(["report", str(run.out_dir), "--out", str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert (tmp_path / "summary.md").read_text().count("|") > 10


def test_progress_eta_counts_from_the_first_step_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed at step 5 of 10 estimates from its own steps, not from step 0."""
    now = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr("streamrl.metrics.time.perf_counter", lambda: next(now))
    progress = Progress(total_steps=10, stream=sys.stderr)  # not a terminal under pytest
    first = progress.line({"reward/mean": 0.5, "trainer/idle_ratio": 0.25}, step=5)
    assert first == "step 5/10 | eta 0:50 | reward 0.500 | idle learner 0.25"
    assert progress.line({}, step=6).startswith("step 6/10 | eta 0:40")


def test_tensorboard_and_jsonl_sinks_record_every_metric(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from streamrl.metrics import MetricsLogger

    logger = MetricsLogger(["jsonl", "tensorboard"], tmp_path, "p", "e", total_steps=2)
    logger.log({"reward/mean": 0.25, "trainer/idle_ratio": 0.5}, step=1)
    logger.log({"reward/mean": 0.75, "trainer/idle_ratio": 0.0}, step=2)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.value for e in events.Scalars("trainer/idle_ratio")] == [0.5, 0.0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.25, "trainer/idle_ratio": 0.5},
                    {"step": 2, "reward/mean": 0.75, "trainer/idle_ratio": 0.0}]
