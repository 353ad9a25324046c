"""``streamrl report`` on recorded runs: PNGs, the summary's numbers, torn and resumed logs.

The fixtures under ``tests/data/recorded/`` are real recordings, cut down to the metrics the
report reads: ``agent_sync`` and ``agent_fully_async`` (50 steps each) of
``tests/test_e2e_agent.py::test_agent_learns_to_condition_on_observations``, from before
``time/elapsed_s``, the idle ratios and verl's metric names (``timing/step``,
``throughput/tokens_per_s``); ``default`` is the first 80 steps of a default ``streamrl train``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.report import load_run

RUNS = Path(__file__).parent / "data" / "recorded"
FIGURES = ("reward", "staleness", "throughput", "kl_entropy")


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(RUNS / name, tmp_path / name))


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 10_000, (path, len(data))  # axes, lines and labels, not a blank image


def _table(summary: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in summary.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_one_run_writes_its_pngs_and_summary_into_the_run_dir(tmp_path: Path) -> None:
    run = _copy("agent_sync", tmp_path)
    assert main(["report", str(run)]) == 0
    for name in FIGURES:
        _assert_png(run / f"{name}.png")
    assert not (run / "idle.png").exists()  # no idle ratio logged: no empty figure
    summary = (run / "summary.md").read_text()
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", summary)
    assert sorted(links) == sorted(f"{name}.png" for name in FIGURES)
    table = _table(summary)
    assert table["steps"] == ["50"]
    # By hand from the fixture: mean reward of steps 30-34 is 0.5129 (of 29-33: 0.4674), and
    # the 34 step times sum to 72.44 s; for 0.9, steps 41-45 give 0.9104 (40-44: 0.8992) at
    # 93.89 s. The final rolling mean (steps 46-50) is 0.8996 and the 50 steps took 104.55 s.
    assert table["rolling reward ≥ 0.5 at"] == ["72.4 s (step 34)"]
    assert table["rolling reward ≥ 0.9 at"] == ["93.9 s (step 45)"]
    assert table["final reward (mean of last 5 steps)"] == ["0.900"]
    assert table["wall time"] == ["104.6 s"]
    assert table["mean staleness (groups)"] == ["0.00"]
    assert not any("idle" in name for name in table)


def test_runs_side_by_side_go_to_report_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(RUNS / "agent_sync"), str(RUNS / "agent_fully_async")]) == 0
    out = tmp_path / "report"
    assert capsys.readouterr().out.strip() == str(Path("report") / "summary.md")
    for name in FIGURES:
        _assert_png(out / f"{name}.png")
    summary = (out / "summary.md").read_text()
    assert summary.splitlines()[2] == "| | agent_sync | agent_fully_async |"
    table = _table(summary)
    # fully_async: steps 34-38 average 0.5043 (33-37: 0.4575) after 69.49 s; never 0.9.
    assert table["rolling reward ≥ 0.5 at"] == ["72.4 s (step 34)", "69.5 s (step 38)"]
    assert table["rolling reward ≥ 0.9 at"] == ["93.9 s (step 45)", "not reached"]
    assert table["mean staleness (groups)"] == ["0.00", "0.98"]  # 49 of 50 steps one behind
    # The side-by-side reward figure has two runs' lines: a bigger picture than one run's.
    single = tmp_path / "single"
    assert main(["report", str(RUNS / "agent_sync"), "--out", str(single)]) == 0
    assert (out / "reward.png").stat().st_size > (single / "reward.png").stat().st_size
    assert not (RUNS / "agent_sync" / "summary.md").exists()  # --out kept the fixture clean


def test_a_run_with_idle_ratios_and_elapsed_time(tmp_path: Path) -> None:
    assert main(["report", str(RUNS / "default"), "--out", str(tmp_path)]) == 0
    for name in (*FIGURES, "idle"):
        _assert_png(tmp_path / f"{name}.png")
    table = _table((tmp_path / "summary.md").read_text())
    # By hand: steps 64-68 average 0.5002 (63-67: 0.4664); step 68's time/elapsed_s is
    # 30.39 s (its step times sum to only 29.99 s: startup is in the elapsed clock).
    assert table["rolling reward ≥ 0.5 at"] == ["30.4 s (step 68)"]
    assert table["rolling reward ≥ 0.9 at"] == ["not reached"]
    assert table["wall time"] == ["35.4 s"]
    assert table["mean staleness (tokens)"] == ["0.99"]
    assert table["mean trainer idle ratio"] == ["0.02"]
    assert table["mean rollouter idle ratio"] == ["0.37"]  # steps 2-80: step 1 has no window


def test_a_torn_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    run = _copy("agent_sync", tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 51, "actor/entropy": 4.1, "reward/me')  # killed mid-write
    assert main(["report", str(run)]) == 0
    summary = (run / "summary.md").read_text()
    assert _table(summary)["steps"] == ["50"]
    assert "skipped 1 unreadable line(s) of metrics.jsonl" in summary
    _assert_png(run / "reward.png")


def test_rows_of_a_resumed_run_replace_the_steps_it_did_again(tmp_path: Path) -> None:
    # Killed after step 3 with a checkpoint at step 1: the resumed process logs 2 and 3 again,
    # its clock starting from zero.
    rows = [(1, 0.1, 10.0), (2, 0.2, 20.0), (3, 0.3, 30.0), (2, 0.4, 15.0), (3, 0.5, 25.0),
            (4, 0.6, 35.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward/mean": r, "time/elapsed_s": t}) + "\n" for s, r, t in rows))
    run = load_run(tmp_path)
    assert run.steps.tolist() == [1, 2, 3, 4]
    assert run.column("reward/mean").tolist() == [0.1, 0.4, 0.5, 0.6]
    # The thrown-away steps 2-3 still took 30 s: the resumed rows come after them.
    assert run.wall.tolist() == [10.0, 45.0, 55.0, 65.0]
    assert run.resumes == 1


def test_a_dir_without_metrics_is_one_error_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "not_a_run"
    missing.mkdir()
    assert main(["report", str(RUNS / "agent_sync"), str(missing),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "metrics.jsonl" in err
    assert not (tmp_path / "out").exists()  # nothing half-written
