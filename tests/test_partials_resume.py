"""Partial rollouts across a SIGTERM, end to end (docs/partials.md): a real `streamrl train`
stopped by SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C: one line, exit 143, none of its
processes left (Ray's own handler would abort the driver and orphan its workers), and each
replica's groups in flight saved with their tokens so far; a `trainer.resume=auto` run
continues them from those tokens. The exactness of a resumed response
(its tokens, log-probs and versions) is tested on a real engine in
tests/rollout_fleet/test_replica_partials.py; here: the wiring from the signal to the file and
from the file back into the replica of the next run."""

from __future__ import annotations

import json
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


def test_a_sigterm_saves_the_groups_in_flight_and_a_resumed_run_continues_them(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "streamrl.cli", "train", f"model.path={tiny_model_dir}",
            "runtime.num_cpus=2", "trainer.logger=[jsonl]", "trainer.save_freq=1",
            # Room to sample ahead of the learner, and answers long enough that groups are
            # decoding at any moment: with eta=1 and 8-token answers a SIGTERM could find every
            # group parked at the bound or just finished, nothing in flight to save.
            "buffer.max_staleness=2", "rollout.max_new_tokens=96",
            f"trainer.output_dir={out}"]
    first_log = tmp_path / "first.log"
    with process([*args, "trainer.total_steps=1000"], first_log) as proc:
        wait_for(lambda: latest_step(out) >= 2, RUN_TIMEOUT_S, "a second checkpoint", first_log,
                 proc=proc)
        # Right after a checkpoint: the replica samples with that checkpoint's weights, so the
        # tokens in flight are not newer than the step the next run resumes from (those would
        # be cut: partials.usable).
        step = latest_step(out)
        wait_for(lambda: latest_step(out) > step, RUN_TIMEOUT_S, "the next checkpoint",
                 first_log, proc=proc)
        time.sleep(STOP_AFTER_S)
        family = set(psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, first_log.read_text()[-3000:]
    assert "streamrl: interrupted (SIGTERM); the run's processes were stopped" in \
        first_log.read_text(errors="replace")
    _, left = psutil.wait_procs(list(family), timeout=30)
    assert not [p for p in left if p.status() != "zombie"], [p.cmdline()[:3] for p in left]

    saved = decode((out / "partials" / "replica-0.msgpack").read_bytes(), PartialSnapshot)
    assert saved.groups and saved.num_tokens > 0, saved
    resumed_from = latest_step(out)
    second_log = tmp_path / "second.log"
    with process([*args, "trainer.resume=auto", f"trainer.total_steps={resumed_from + 1}"],
                 second_log) as proc:
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, second_log.read_text()[-3000:]

    assert f"resumed from {out / f'global_step_{resumed_from}'}" in second_log.read_text()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == resumed_from + 1
    with_tokens = sum(1 for g in saved.groups if g.num_tokens)
    assert 1 <= last["replica/partials_resumed"] <= with_tokens, (last, saved)
