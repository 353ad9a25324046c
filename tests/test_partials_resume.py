"""Stopping and resuming a real `streamrl train`, end to end, three runs on one output dir.

A run killed mid-training (SIGKILL of its whole process group: no clean-up at all) resumes from
its last checkpoint with `trainer.resume=auto`. Partial rollouts across a SIGTERM
(docs/partials.md): a run stopped by SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C: one
line, exit 143, none of its processes left (Ray's own handler would abort the driver and orphan
its workers), and each replica's groups in flight saved with their tokens so far; a
`trainer.resume=auto` run continues them from those tokens. The exactness of a resumed response
(its tokens, log-probs and versions) is tested on a real engine in
tests/rollout_fleet/test_replica_partials.py; here: the wiring from the signal to the file and
from the file back into the replica of the next run. The SIGTERM stops the run resumed after
the SIGKILL, so the three runs start up three times, not four."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from streamrl.rollout_fleet.partials import PartialSnapshot
from streamrl.types import decode
from tests.support.processes import process, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RUN_TIMEOUT_S = 240
STOP_AFTER_S = 0.5
"""After the checkpoint: the replica's groups have decoded some tokens, far from all."""


def latest_step(out: Path) -> int:
    latest = out / "latest"
    return int(latest.read_text().removeprefix("global_step_")) if latest.exists() else 0


def test_a_killed_run_resumes_and_a_sigterm_saves_the_groups_in_flight_for_the_next_run(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "streamrl.cli", "train", f"model.path={tiny_model_dir}",
            "runtime.num_cpus=2", "trainer.logger=[jsonl]", "trainer.save_freq=1",
            # Room to sample ahead of the learner, and answers long enough that groups are
            # decoding at any moment: with eta=1 and 8-token answers a SIGTERM could find every
            # group parked at the bound or just finished, nothing in flight to save.
            "buffer.max_staleness=2", "rollout.max_new_tokens=96",
            f"trainer.output_dir={out}"]
    killed_log = tmp_path / "killed.log"
    with process([*args, "trainer.total_steps=1000"], killed_log) as proc:
        wait_for(lambda: latest_step(out) >= 2, RUN_TIMEOUT_S, "a second checkpoint",
                 killed_log, proc=proc)
        os.killpg(proc.pid, signal.SIGKILL)  # driver, Ray head and every actor: no clean-up
        proc.wait()
    killed_at = latest_step(out)
    metrics = out / "metrics.jsonl"
    killed_logged = metrics.stat().st_size  # the next run appends its steps after these

    stopped_log = tmp_path / "stopped.log"
    with process([*args, "trainer.resume=auto", "trainer.total_steps=1000"], stopped_log) as proc:
        wait_for(lambda: latest_step(out) > killed_at, RUN_TIMEOUT_S,
                 "a checkpoint after the resume", stopped_log, proc=proc)
        # Right after a checkpoint: the replica samples with that checkpoint's weights, so the
        # tokens in flight are not newer than the step the next run resumes from (those would
        # be cut: partials.usable).
        step = latest_step(out)
        wait_for(lambda: latest_step(out) > step, RUN_TIMEOUT_S, "the next checkpoint",
                 stopped_log, proc=proc)
        time.sleep(STOP_AFTER_S)
        family = set(psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, stopped_log.read_text()[-3000:]
    stopped_text = stopped_log.read_text(errors="replace")
    # The killed run's checkpoint, continued at the next step.
    assert f"resumed from {out / f'global_step_{killed_at}'}" in stopped_text, stopped_text[-3000:]
    assert json.loads(metrics.read_bytes()[killed_logged:].splitlines()[0])["step"] == \
        killed_at + 1
    assert "streamrl: interrupted (SIGTERM); the run's processes were stopped" in stopped_text
    _, left = psutil.wait_procs(list(family), timeout=30)
    assert not [p for p in left if p.status() != "zombie"], [p.cmdline()[:3] for p in left]

    saved = decode((out / "partials" / "replica-0.msgpack").read_bytes(), PartialSnapshot)
    assert saved.groups and saved.num_tokens > 0, saved
    resumed_from = latest_step(out)
    continued_log = tmp_path / "continued.log"
    with process([*args, "trainer.resume=auto", f"trainer.total_steps={resumed_from + 1}"],
                 continued_log) as proc:
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, continued_log.read_text()[-3000:]

    assert f"resumed from {out / f'global_step_{resumed_from}'}" in continued_log.read_text()
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["step"] == resumed_from + 1
    with_tokens = sum(1 for g in saved.groups if g.num_tokens)
    assert 1 <= last["replica/partials_resumed"] <= with_tokens, (last, saved)
