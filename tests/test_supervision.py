"""Replica supervision end to end: a real `streamrl train` whose only replica is killed twice.

The first kill -9 of the replica actor is noticed within seconds, the admissions it held are
given back and a new incarnation rejoins the weight bus and produces, so training goes on. With
``runtime.max_restarts=1`` the second kill cannot be repaired: the run stops with exit code 3 and
one line naming the replica and the cause, within 60 s. Afterwards none of the run's processes
(Ray's, the replica actors', vLLM engine cores, reward pool workers) is left. A killed
co-located hybrid worker (a learner rank with its engine) is not re-created: the run stops the
same way at once. A killed learner rank is restarted from the last checkpoint with the replicas
kept, a killed memory buffer actor is re-created, both ``runtime.max_restarts`` times.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.processes import process, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RUN_TIMEOUT_S = 420


def steps_logged(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


@contextmanager
def train_process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``streamrl train args`` in a session of its own, its output in ``log``."""
    with process([sys.executable, "-m", "streamrl.cli", "train", *args], log) as proc:
        yield proc


def kill_and_wait(proc: subprocess.Popen[bytes], victim: psutil.Process) -> tuple[int, float]:
    """Kill ``victim``: the run's exit code, and the seconds it took to end after that."""
    victim.kill()
    killed_at = time.monotonic()
    code = proc.wait(timeout=RUN_TIMEOUT_S)
    return code, time.monotonic() - killed_at


def assert_none_left(family: set[psutil.Process]) -> None:
    """Nothing of the run outlives it (30 s to go)."""
    deadline = time.monotonic() + 30
    while (left := [p for p in family if p.is_running() and p.status() != "zombie"]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]


def replica_actor(driver: psutil.Process, title: str = "ray::ReplicaActor"
                  ) -> psutil.Process | None:
    for p in driver.children(recursive=True):
        try:
            first = p.cmdline()[:1]
            # Ray titles an actor ``ray::<Class>.<method>`` while it runs a call.
            if first and (first[0] == title or first[0].startswith(title + ".")):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_killed_replica_is_recreated_then_a_hopeless_one_stops_the_run(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "train.log"
    metrics = out / "metrics.jsonl"
    args = [f"model.path={tiny_model_dir}", "runtime.num_cpus=2", "trainer.logger=[jsonl]",
            "trainer.total_steps=1000", f"trainer.output_dir={out}", "runtime.max_restarts=1",
            "runtime.heartbeat_s=1"]
    family: set[psutil.Process] = set()
    with train_process(args, log) as proc:
        driver = psutil.Process(proc.pid)
        first = wait_for(lambda: replica_actor(driver), 240, "a replica actor", log, proc=proc)
        wait_for(lambda: len(steps_logged(metrics)) >= 3, 240, "3 training steps", log, proc=proc)
        family |= set(driver.children(recursive=True))
        first.kill()

        # Recovered: a new incarnation produces and the learner takes more steps with it.
        second = wait_for(lambda: (a := replica_actor(driver)) is not None and a.pid != first.pid
                          and a, 120, "a re-created replica", log, proc=proc)
        stepped = len(steps_logged(metrics))
        wait_for(lambda: len(steps_logged(metrics)) >= stepped + 3, 180,
                 "3 steps after the re-creation", log, proc=proc)
        last = steps_logged(metrics)[-1]
        assert last["fleet/restarts"] == 1 and last["fleet/live_replicas"] == 1
        family |= set(driver.children(recursive=True))

        # Hopeless: restarts used up, the run stops with one line naming replica and cause.
        code, stopped_after_s = kill_and_wait(proc, second)
    text = log.read_text(errors="replace")
    assert "replica-0: its actor died" in text and "re-created (incarnation 1)" in text
    assert code == 3, text[-3000:]
    assert stopped_after_s < 60, stopped_after_s
    # The driver's own lines (Ray prefixes those forwarded from workers with their pid).
    driver_lines = [line for line in text.split("re-created (incarnation 1)")[-1].splitlines()
                    if "pid=" not in line]
    assert not [line for line in driver_lines if "Traceback" in line], text[-3000:]
    stopped = [line for line in driver_lines if line.startswith("streamrl: run stopped:")]
    assert len(stopped) == 1 and stopped[0] in driver_lines[-5:], driver_lines[-10:]
    assert stopped[0].startswith("streamrl: run stopped: replica-0 its actor died"), stopped
    assert "runtime.max_restarts=1" in stopped[0], stopped
    assert_none_left(family)


def test_a_killed_learner_and_buffer_actor_are_restarted_then_a_hopeless_one_stops_the_run(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """kill -9 of the only learner rank: the run starts new ranks from the last checkpoint and
    goes on with the same replicas (not re-created); kill -9 of the memory buffer actor: it is
    re-created at the learner's version and the run goes on; a second learner death with
    ``runtime.max_restarts=1`` stops the run with one line, within 60 s."""
    out, log = tmp_path / "out", tmp_path / "train.log"
    metrics = out / "metrics.jsonl"
    args = [f"model.path={tiny_model_dir}", "runtime.num_cpus=2", "trainer.logger=[jsonl]",
            "trainer.total_steps=1000", f"trainer.output_dir={out}", "trainer.save_freq=2",
            "runtime.max_restarts=1", "runtime.heartbeat_s=1"]

    def more_steps(n: int, what: str) -> None:
        stepped = len(steps_logged(metrics))
        wait_for(lambda: len(steps_logged(metrics)) >= stepped + n, 180, what, log, proc=proc)

    family: set[psutil.Process] = set()
    with train_process(args, log) as proc:
        driver = psutil.Process(proc.pid)
        wait_for(lambda: len(steps_logged(metrics)) >= 3, 240, "3 training steps", log, proc=proc)
        replica = replica_actor(driver)
        learner = replica_actor(driver, "ray::LearnerActor")
        assert replica is not None and learner is not None
        family |= set(driver.children(recursive=True))
        learner.kill()
        wait_for(lambda: "learner restarted from" in log.read_text(errors="replace"), 180,
                 "the learner restarted", log, proc=proc)
        more_steps(2, "2 steps after the learner restart")

        buffer_actor = replica_actor(driver, "ray::BufferActor")
        assert buffer_actor is not None
        family |= set(driver.children(recursive=True))
        buffer_actor.kill()
        more_steps(2, "2 steps after the buffer actor was killed")
        assert replica.is_running()  # the same replica all along: kept, not re-created

        family |= set(driver.children(recursive=True))
        second = replica_actor(driver, "ray::LearnerActor")
        assert second is not None and second.pid != learner.pid
        code, stopped_after_s = kill_and_wait(proc, second)
    text = log.read_text(errors="replace")
    assert "restarting the learner from" in text and "re-created it as" in text, text[-3000:]
    assert code == 3, text[-3000:]
    assert stopped_after_s < 60, stopped_after_s
    stopped = [line for line in text.splitlines() if line.startswith("streamrl: run stopped:")]
    assert len(stopped) == 1, text[-3000:]
    assert "learner rank 0 died" in stopped[0], stopped
    assert "runtime.max_restarts=1 restarts are used up" in stopped[0], stopped
    assert_none_left(family)


def test_a_killed_hybrid_worker_stops_the_run_at_once(tmp_path: Path, tiny_model_dir: Path
                                                      ) -> None:
    out, log = tmp_path / "out", tmp_path / "train.log"
    args = [f"model.path={tiny_model_dir}", "runtime.num_cpus=2", "trainer.logger=[jsonl]",
            "trainer.total_steps=1000", "trainer.mode=sync", "runtime.placement=colocated",
            "weight_bus.backend=colocated", f"trainer.output_dir={out}", "runtime.heartbeat_s=1"]
    with train_process(args, log) as proc:
        driver = psutil.Process(proc.pid)
        worker = wait_for(lambda: replica_actor(driver, "ray::HybridActor"), 240,
                          "a hybrid worker", log, proc=proc)
        wait_for(lambda: len(steps_logged(out / "metrics.jsonl")) >= 2, 240, "2 steps", log,
                 proc=proc)
        family = set(driver.children(recursive=True))
        code, stopped_after_s = kill_and_wait(proc, worker)
    text = log.read_text(errors="replace")
    assert code == 3, text[-3000:]
    assert stopped_after_s < 60, stopped_after_s
    stopped = [line for line in text.splitlines() if line.startswith("streamrl: run stopped:")]
    assert len(stopped) == 1, text[-3000:]
    # Whichever noticed first: the learner call that lost its rank, or the supervisor.
    assert "learner rank 0 died" in stopped[0] or "is not re-created" in stopped[0], stopped
    assert "trainer.resume=auto" in stopped[0], stopped
    assert_none_left(family)
