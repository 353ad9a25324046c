"""Chaos: what a training run does when one of its parts dies, how fast, and what it costs.

Each scenario is a real ``streamrl train`` (vLLM replicas, FSDP2 learner, gloo weight bus, Ray)
started as a subprocess: two replicas (``rollout.num_replicas=2 runtime.cpus_per_replica=0.5``
on ``runtime.num_cpus=2``), the Redis buffer on a redis-server this benchmark starts
(append-only, in a temp dir; each scenario its own ``buffer.run``), ``runtime.heartbeat_s=1``,
``trainer.save_freq=5`` and ``--steps`` steps. Once step ``--fault-step`` is logged
(``metrics.jsonl``), one fault is injected; process roles are found among the driver's
descendants by their title (``cmdline[0]``):

- ``replica_kill``: kill -9 a ``ray::ReplicaActor``. Expected: recovered (the supervisor logs
  "its actor died ... admission(s) it held given back", then "re-created (incarnation 1)");
- ``engine_core_kill``: with ``rollout.engine_in_process=false`` (on CPU the fully_async
  replicas otherwise step vLLM on a thread of the actor, and have no engine-core process), kill
  -9 a ``VLLM::EngineCore``. Expected: recovered ("its engine core died");
- ``learner_kill``: kill -9 the ``ray::LearnerActor`` (world size 1: the only rank). Expected:
  recovered: the run itself starts a new rank from the last checkpoint ("learner restarted
  from"), its replicas kept;
- ``learner_kill_resume``: the same with ``runtime.max_restarts=0``. Expected: the run stops
  with one clear line (exit code != 0); then the same command with ``trainer.resume=auto``
  (same output dir and buffer run) finishes;
- ``buffer_actor_kill``: with ``buffer=memory`` (no Redis), kill -9 the ``ray::BufferActor``.
  Expected: recovered ("re-created it as"); lost = the groups queued in it, as the run's warning
  counts them (as of the step before);
- ``redis_restart``: stop redis-server (SIGTERM: it flushes its append-only file), keep it down
  ``REDIS_DOWN_S`` and start it again on the same port and dir (down ~1.5 s in all). Expected:
  the run carries on, or stops with one clear line;
- ``redis_empty``: the same, but Redis comes back empty (a new data dir: a server without
  persistence). Expected: recovered; the learner re-creates the run's keys and warns once; lost
  = what that warning counts (the stats hash's ``lost``);
- ``bus_receiver_kill``: kill -9 a weight-bus receiver mid-broadcast. A receiver is two halves
  of a replica: ZMQ control and heartbeats in the ``ray::ReplicaActor``, the gloo data plane in
  its ``VLLM::EngineCore`` (in the actor itself where the engine runs in process, as on CPU in
  fully_async); both are killed together the moment Ray retitles the learner
  ``ray::LearnerActor.publish``. Approximated: that title covers the whole publish call
  (gather, broadcast, the replicas' acks and loads), not the broadcast alone; "hit" says
  whether the publisher counted the receiver as died during that publish
  (``weight_bus/receivers_died``). Expected: recovered;
- ``driver_sigterm``: SIGTERM to the driver. Expected: it exits (however) within 60 s, none of
  its processes left.

Per scenario: the outcome (recovered / stopped with a clear error / stopped with a traceback /
stopped without a message / died of <signal> / hung / ended before recovering); seconds from the
fault to recovery (replica faults: the first step logged after the supervisor's "re-created"
line; Redis: the first step logged after it is back; the note says how many steps the survivors
trained meanwhile) or to the driver's exit; groups from the run's Redis
counters (``streamrl:<run>:stats``): produced, consumed, trained (last step x
``task.train_batch_size``), queued, dropped as too stale, lost = produced - consumed - queued -
dropped; duplicated: group ids trained more than once, by id: every checkpoint
(``trainer.save_freq=5``, all kept) records the ids it trained since the previous one, so the
ids of a run and of its resume are counted together (a step trained after the last checkpoint
of a killed run is not in the model the resume starts from: its groups are re-delivered and
count once);
whether the staleness bound held (the largest ``staleness/max`` logged <= buffer.max_staleness);
and how many processes of the run were still alive ``ORPHAN_GRACE_S`` after its driver exited
(every descendant is recorded while it runs). Runs are long enough (``--steps``) to outlast a
replica's re-creation (a vLLM engine start: 40-60 s on 2 busy cores). Timings are wall-clock on
a shared machine: expect noise.

    .venv/bin/python benchmarks/chaos.py [--steps 80 --fault-step 5] [--work-dir DIR]

Goals: every scenario recovered (the run then finished, exit code 0) or stopped with a clear
error (learner_kill_resume: and the resume finished; driver_sigterm: any exit, nothing left)
within 60 s, with duplicated = 0 and lost = 0, except where a fault destroys the only copy of
queued groups (buffer_actor_kill, redis_empty): there lost is what the run itself reported; no
process outlives its run. ``--steps 20 --fault-step 5`` is enough where nothing is re-created
(redis_restart, redis_empty, driver_sigterm); where a replica is, keep the default 80: the
survivor alone trains a step in ~2.3 s while the new incarnation's engine starts on the same
two busy cores (80 s and more), and at ``--steps 40`` the run ends before it is up ("ended
before recovering").

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(chaos_<scenario> and chaos_no_orphans; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil
import redis

from streamrl.buffer.redis import RunKeys
from streamrl.models import resolve_model_path
from streamrl.net import free_port
from streamrl.testing import result_line

HOST = "127.0.0.1"
GOAL_S = 60.0
START_TIMEOUT_S = 300.0  # from launch until the fault step is logged (engines start first)
RUN_TIMEOUT_S = 300.0  # from recovery (or a resume's launch) until the run exits
ORPHAN_GRACE_S = 30.0
REDIS_TIMEOUT_S = 10.0
POLL_S = 0.2
REDIS_DOWN_S = 1.0  # how long Redis stays stopped (on top of its stop and start)
REPLICA, ENGINE, LEARNER = "ray::ReplicaActor", "VLLM::EngineCore", "ray::LearnerActor"
PUBLISHING = LEARNER + ".publish"  # Ray's title for an actor while it runs that method
# Without CUDA, where rollout overlaps learning, a replica steps vLLM on a thread of its own
# process (runtime.placement.engine_in_process): there is no engine-core process to kill.
OWN_ENGINE_CORE = "rollout.engine_in_process=false"
RECREATED = "re-created (incarnation"
LEARNER_RESTARTED = "learner restarted from"
BUFFER_RECREATED = "re-created it as"
BUFFER_ACTOR = "ray::BufferActor"
# The warnings that count what a fault lost (RemoteBuffer._reattach, RedisBuffer._recreate).
LOST = re.compile(r"lost the (\d+) group\(s\) queued")
FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(")  # "(ReplicaActor pid=..)", "(raylet)": workers'


class RedisServer:
    """A redis-server (append-only, data in ``workdir``) that can be stopped and started again
    on the same port and dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port(HOST)
        self.url = f"redis://{HOST}:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, empty: bool = False) -> None:
        """Start on the port; ``empty``: without the data written so far (no persistence)."""
        server = shutil.which("redis-server")
        if server is None:
            raise FileNotFoundError("redis-server is not installed: run scripts/setup.sh")
        if empty:
            shutil.rmtree(self.workdir / "appendonlydir", ignore_errors=True)
        self.proc = subprocess.Popen(
            [server, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly",
             "yes", "--dir", str(self.workdir), "--daemonize", "no", "--logfile",
             str(self.workdir / "redis.log")], start_new_session=True)
        client = redis.Redis(host=HOST, port=self.port)
        deadline = time.monotonic() + REDIS_TIMEOUT_S
        while True:
            with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                client.ping()
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not come up (log: "
                                   f"{self.workdir / 'redis.log'})")
            time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the append-only file, then exits
            try:
                self.proc.wait(timeout=REDIS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stats(self, run: str) -> dict[str, float]:
        client = redis.Redis.from_url(self.url, socket_timeout=REDIS_TIMEOUT_S)
        try:
            raw = client.hgetall(RunKeys.of(run).stats)
        finally:
            client.close()
        return {k.decode(): float(v) for k, v in raw.items() if k != b"bus_endpoint"}


@dataclass(frozen=True)
class Fault:
    at: float  # time.monotonic() of the fault
    log_offset: int
    rows: int


class TrainRun:
    """One ``streamrl train`` subprocess; every process it starts is recorded while it runs."""

    def __init__(self, args: list[str], log: Path, out: Path) -> None:
        self.log, self.out, self.metrics = log, out, out / "metrics.jsonl"
        with log.open("ab") as sink:
            self.proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.launched = time.monotonic()
        self.exited: float | None = None
        self.left: list[str] | None = None
        self.driver = psutil.Process(self.proc.pid)
        self.family: set[psutil.Process] = set()
        self._sampler = threading.Thread(target=self._record, daemon=True)
        self._sampler.start()

    def _record(self) -> None:
        while self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                self.family.update(self.driver.children(recursive=True))
            time.sleep(0.5)

    def rows(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().split("\n")[:-1]  # the last piece may be half-written
        return [json.loads(line) for line in lines if line.strip()]

    def trained_ids(self) -> Counter[str]:
        """How often each group id was trained, from every checkpoint's ``trained_group_ids``."""
        counts: Counter[str] = Counter()
        for extra in sorted(self.out.glob("global_step_*/extra.json")):
            counts.update(json.loads(extra.read_text()).get("trained_group_ids", []))
        return counts

    def text(self, offset: int = 0) -> str:
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def find(self, title: str, within: psutil.Process | None = None) -> psutil.Process | None:
        """A live descendant titled ``title`` (or ``title.<method>``, Ray's title during a
        call)."""
        with contextlib.suppress(psutil.Error):
            for p in (within or self.driver).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    first = p.cmdline()[:1]
                    if first and (first[0] == title or first[0].startswith(title + ".")):
                        return p
        return None

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(r["step"] >= step for r in self.rows()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"step {step} was never logged (exit code "
                                   f"{self.proc.poll()}); log tail:\n{self.text()[-2000:]}")
            time.sleep(POLL_S)

    def mark(self) -> Fault:
        return Fault(time.monotonic(), self.log.stat().st_size, len(self.rows()))

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the driver still runs after ``timeout`` s."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.exited = self.exited or time.monotonic()
        return code

    def step_after(self, fault: Fault, timeout: float, marker: str | None = None,
                   rows: int | None = None) -> tuple[float | None, int]:
        """Seconds from ``fault`` to the first step logged once ``marker`` appeared in the log
        (or, without a marker, once ``rows`` steps were logged); None if the run exited or
        ``timeout`` passed first. Also: how many steps were logged from the fault to then."""
        rows_then = rows
        while time.monotonic() - fault.at < timeout and self.proc.poll() is None:
            if rows_then is None:
                if marker is not None and marker in self.text(fault.log_offset):
                    rows_then = len(self.rows())
            elif len(self.rows()) > rows_then:
                return time.monotonic() - fault.at, rows_then - fault.rows
            time.sleep(POLL_S)
        return None, len(self.rows()) - fault.rows

    def finish(self) -> list[str]:
        """Stop whatever of the run still runs; returns the titles of its processes still alive
        ``ORPHAN_GRACE_S`` after the driver exited (a hung driver is killed first). Idempotent."""
        if self.left is not None:
            return self.left
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._sampler.join()
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while (left := [p for p in self.family if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        self.left = [f"{p.pid} {_title(p)}" for p in left]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return self.left


def _title(p: psutil.Process) -> str:
    try:
        return (p.cmdline() or ["?"])[0]
    except psutil.Error:
        return "?"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def driver_lines(text: str) -> list[str]:
    """The driver's own lines (Ray forwards worker lines prefixed ``(Name pid=N)``)."""
    return [line for line in text.splitlines() if line.strip() and not FORWARDED.match(line)]


def how_it_stopped(run: TrainRun, fault: Fault) -> str:
    code = run.proc.returncode
    if code < 0:  # a signal ended it: no handler ran (Ray's C++ one prints a stack and aborts)
        return f"died of {signal.Signals(-code).name}"
    lines = driver_lines(run.text(fault.log_offset))
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return "stopped with a traceback"
    if any(line.startswith("streamrl: ") for line in lines[-5:]):
        return "stopped with a clear error"
    return "stopped without a message"


def last_driver_line(run: TrainRun, fault: Fault) -> str:
    lines = driver_lines(run.text(fault.log_offset))
    return lines[-1][:300] if lines else "(none)"


@dataclass
class Result:
    scenario: str
    outcome: str
    seconds: float | None  # fault -> recovery or exit; None: hung
    stats: dict[str, float]
    rows: list[dict[str, Any]]
    finished: bool  # the run (or its resume) reached trainer.total_steps
    left: list[str]  # processes of the run alive ORPHAN_GRACE_S after it exited
    note: str
    trained_ids: Counter[str] = field(default_factory=Counter)
    accepted: tuple[str, ...] = ("recovered", "stopped with a clear error")
    also: bool = True  # the scenario's own condition: the resume finished, nothing left
    reported_lost: int | None = None
    """Groups the run said it lost (a fault that destroys the only copy of queued groups); None:
    lost is measured from the Redis counters and must be 0."""

    @property
    def orphans(self) -> int:
        return len(self.left)

    @property
    def trained(self) -> int:
        return int(self.rows[-1]["step"] * self.stats.get("groups_per_step", 0)) if self.rows \
            else 0

    @property
    def lost(self) -> int:
        if self.reported_lost is not None:
            return self.reported_lost
        s = self.stats
        return int(s.get("produced", 0) - s.get("consumed", 0) - s.get("queued", 0)
                   - s.get("dropped", 0))

    @property
    def duplicated(self) -> int:
        return sum(n - 1 for n in self.trained_ids.values())

    @property
    def staleness_max(self) -> float:
        return max((r.get("staleness/max", 0.0) for r in self.rows), default=0.0)

    @property
    def staleness_held(self) -> bool:
        return self.staleness_max <= self.stats.get("max_staleness", 0)

    @property
    def met(self) -> bool:
        recovered_and_finished = self.outcome != "recovered" or self.finished
        return (self.also and self.outcome in self.accepted and self.seconds is not None
                and self.seconds <= GOAL_S and recovered_and_finished and self.duplicated == 0
                and (self.lost == 0 or self.reported_lost is not None))


@dataclass(frozen=True)
class Context:
    model: str
    redis: RedisServer
    work: Path
    steps: int
    fault_step: int
    timeout: float
    overrides: tuple[str, ...]
    runs: list[TrainRun] = field(default_factory=list)  # every run launched, to finish

    def launch(self, name: str, *extra: str, run: str | None = None,
               log: str = "train.log", redis: bool = True) -> tuple[TrainRun, str]:
        """``redis`` False: the memory buffer (in its actor) instead of this Redis."""
        out = self.work / name / "out"
        out.mkdir(parents=True, exist_ok=True)
        run = run or f"chaos-{name}-{uuid.uuid4().hex[:8]}"
        buffer = (["buffer=redis", f"buffer.redis_url={self.redis.url}", f"buffer.run={run}"]
                  if redis else ["buffer=memory"])
        args = [sys.executable, "-m", "streamrl.cli", "train", f"model.path={self.model}",
                f"trainer.total_steps={self.steps}", "trainer.logger=[jsonl]",
                f"trainer.output_dir={out}", "trainer.save_freq=5", "trainer.max_to_keep=0",
                "runtime.num_cpus=2",
                "rollout.num_replicas=2", "runtime.cpus_per_replica=0.5",
                "runtime.heartbeat_s=1", *buffer, *self.overrides, *extra]
        self.runs.append(TrainRun(args, self.work / name / log, out))
        return self.runs[-1], run


def recover_or_stop(ctx: Context, name: str, run: TrainRun, buffer_run: str, fault: Fault,
                    note: str, marker: str | None = None, rows: int | None = None) -> Result:
    """After a fault the run should go on: wait for the step that shows it (see
    ``TrainRun.step_after``), then for the run's end."""
    recovered_s, steps = run.step_after(fault, ctx.timeout, marker, rows)
    note += f"; {steps} step(s) logged meanwhile"
    code = run.wait_exit(RUN_TIMEOUT_S if recovered_s is not None else ctx.timeout)
    if code is None:
        outcome, seconds = "hung", None
    elif code == 0:
        outcome = "recovered" if recovered_s is not None else "ended before recovering"
        seconds = recovered_s
    else:
        outcome = how_it_stopped(run, fault)
        seconds = (run.exited or time.monotonic()) - fault.at
        note += f"; exit {code}: {last_driver_line(run, fault)}"
    return Result(name, outcome, seconds, ctx.redis.stats(buffer_run), run.rows(),
                  finished=code == 0, left=run.finish(), note=note,
                  trained_ids=run.trained_ids())


def kill_first(run: TrainRun, title: str) -> tuple[psutil.Process, Fault]:
    """kill -9 the run's first process titled ``title``; returns it and the fault marked."""
    victim = run.find(title)
    if victim is None:
        raise RuntimeError(f"no {title} process among the driver's descendants")
    victim.kill()
    return victim, run.mark()


def kill_role(ctx: Context, name: str, title: str, expected: tuple[str, ...],
              marker: str = RECREATED, redis: bool = True, extra: tuple[str, ...] = ()
              ) -> Result:
    run, buffer_run = ctx.launch(name, *extra, redis=redis)
    run.wait_for_step(ctx.fault_step)
    victim, fault = kill_first(run, title)
    result = recover_or_stop(ctx, name, run, buffer_run, fault, f"killed pid {victim.pid}",
                             marker=marker)
    text = run.text(fault.log_offset)
    missing = [line for line in expected if line not in text]
    result.note += "; expected log lines " + (f"missing: {missing}" if missing else "present")
    return result


def replica_kill(ctx: Context) -> Result:
    return kill_role(ctx, "replica_kill", REPLICA,
                     ("its actor died", "admission(s) it held given back", RECREATED + " 1)"))


def engine_core_kill(ctx: Context) -> Result:
    return kill_role(ctx, "engine_core_kill", ENGINE, ("its engine core died", RECREATED + " 1)"),
                     extra=(OWN_ENGINE_CORE,))


def learner_kill(ctx: Context) -> Result:
    result = kill_role(ctx, "learner_kill", LEARNER, ("restarting the learner from",),
                       marker=LEARNER_RESTARTED)
    recreated = RECREATED in ctx.runs[-1].text()
    result.note += f"; replicas re-created: {'yes' if recreated else 'no (kept)'}"
    return result


def buffer_actor_kill(ctx: Context) -> Result:
    result = kill_role(ctx, "buffer_actor_kill", BUFFER_ACTOR, (BUFFER_RECREATED,),
                       marker=BUFFER_RECREATED, redis=False)
    result.reported_lost = reported_lost(ctx.runs[-1].text())
    result.stats = memory_stats(ctx, result.rows)
    return result


def memory_stats(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, float]:
    """What ``RedisServer.stats`` gives for a Redis run, for a memory one: the buffer counters
    of its last step logged, with the run's bound from its config."""
    from streamrl.config import load_config

    cfg = load_config(["buffer=memory", *ctx.overrides])
    counters = {k.removeprefix("buffer/"): v for k, v in (rows[-1] if rows else {}).items()
                if k.startswith("buffer/")}
    return {**counters, "groups_per_step": cfg.task.train_batch_size,
            "max_staleness": cfg.buffer.max_staleness}


def reported_lost(text: str) -> int | None:
    """The groups the run's recovery warnings say were lost; None if none said so."""
    counts = [int(n) for n in LOST.findall(text)]
    return sum(counts) if counts else None


def learner_kill_resume(ctx: Context) -> Result:
    name = "learner_kill_resume"
    run, buffer_run = ctx.launch(name, "runtime.max_restarts=0")
    run.wait_for_step(ctx.fault_step)
    _, fault = kill_first(run, LEARNER)
    code = run.wait_exit(ctx.timeout)
    if code is None:
        outcome, seconds, note = "hung", None, "the driver did not exit"
    else:
        outcome = how_it_stopped(run, fault) if code else "exited 0 after the kill"
        seconds = (run.exited or time.monotonic()) - fault.at
        note = f"exit {code}: {last_driver_line(run, fault)}"
    left = run.finish()

    resumed, _ = ctx.launch(name, "trainer.resume=auto", run=buffer_run, log="resume.log")
    code = resumed.wait_exit(START_TIMEOUT_S + RUN_TIMEOUT_S)
    at = re.search(r"resumed from \S+ at step (\d+)", resumed.text())
    note += (f"; resume {'from step ' + at.group(1) if at else 'found no checkpoint'}, "
             + (f"finished in {resumed.exited - resumed.launched:.0f} s"
                if code == 0 and resumed.exited else f"exit {code}"))
    return Result(name, outcome, seconds, ctx.redis.stats(buffer_run), resumed.rows(),
                  finished=code == 0, left=left + resumed.finish(), note=note, also=code == 0,
                  trained_ids=resumed.trained_ids())


def redis_restart(ctx: Context, name: str = "redis_restart", empty: bool = False) -> Result:
    run, buffer_run = ctx.launch(name)
    run.wait_for_step(ctx.fault_step)
    fault = run.mark()
    ctx.redis.stop()
    time.sleep(REDIS_DOWN_S)
    ctx.redis.start(empty=empty)
    down_s = time.monotonic() - fault.at
    return recover_or_stop(ctx, name, run, buffer_run, fault, f"Redis down {down_s:.1f} s",
                           rows=len(run.rows()))


def redis_empty(ctx: Context) -> Result:
    result = redis_restart(ctx, "redis_empty", empty=True)
    warned = ctx.runs[-1].text().count("keys are gone from Redis")
    result.note += f"; {warned} warning(s) that the keys were gone"
    if warned:
        result.reported_lost = int(result.stats.get("lost", 0))
    return result


def bus_receiver_kill(ctx: Context) -> Result:
    name = "bus_receiver_kill"
    run, buffer_run = ctx.launch(name)
    run.wait_for_step(ctx.fault_step)
    learner, replica = run.find(LEARNER), run.find(REPLICA)
    if learner is None or replica is None:
        raise RuntimeError(f"no {LEARNER} or {REPLICA} among the driver's descendants")
    engine = run.find(ENGINE, within=replica)
    deadline = time.monotonic() + ctx.timeout
    while learner.cmdline()[:1] != [PUBLISHING]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the learner was never seen titled {PUBLISHING}")
        time.sleep(0.002)
    for p in (replica, engine):
        if p is not None:
            p.kill()
    fault = run.mark()
    result = recover_or_stop(ctx, name, run, buffer_run, fault,
                             f"killed pids {replica.pid} (actor), "
                             f"{engine.pid if engine else '-'} (engine core)", marker=RECREATED)
    died = sum(r.get("weight_bus/receivers_died", 0.0) for r in result.rows[fault.rows:])
    result.note += f"; hit: {'yes' if died else 'no'} (receivers_died {died:g} after the kill)"
    return result


def driver_sigterm(ctx: Context) -> Result:
    name = "driver_sigterm"
    run, buffer_run = ctx.launch(name)
    run.wait_for_step(ctx.fault_step)
    run.proc.send_signal(signal.SIGTERM)
    fault = run.mark()
    code = run.wait_exit(ctx.timeout)
    outcome = "hung" if code is None else how_it_stopped(run, fault)
    seconds = None if code is None else (run.exited or time.monotonic()) - fault.at
    left = run.finish()
    # Asked to stop, any exit is the expected one; the goal is its time and what it leaves.
    return Result(name, outcome, seconds, ctx.redis.stats(buffer_run), run.rows(),
                  finished=False, left=left, note=f"exit {code}: {last_driver_line(run, fault)}",
                  trained_ids=run.trained_ids(),
                  accepted=(outcome,) if code is not None else (), also=not left)


SCENARIOS: dict[str, Callable[[Context], Result]] = {
    "replica_kill": replica_kill,
    "engine_core_kill": engine_core_kill,
    "learner_kill": learner_kill,
    "learner_kill_resume": learner_kill_resume,
    "buffer_actor_kill": buffer_actor_kill,
    "redis_restart": redis_restart,
    "redis_empty": redis_empty,
    "bus_receiver_kill": bus_receiver_kill,
    "driver_sigterm": driver_sigterm,
}


def print_table(results: list[Result]) -> None:
    print(f"{'scenario':<21}{'outcome':<28}{'s':>6}{'produced':>9}{'consumed':>9}"
          f"{'trained':>8}{'queued':>7}{'dropped':>8}{'lost':>5}{'dup':>4}{'stale':>8}"
          f"{'left':>5}{'rc0':>5}")
    for r in results:
        s = r.stats
        seconds = "-" if r.seconds is None else f"{r.seconds:.1f}"
        stale = f"{r.staleness_max:g}/{s.get('max_staleness', 0):g}" + \
            ("" if r.staleness_held else "!")
        print(f"{r.scenario:<21}{r.outcome:<28}{seconds:>6}{s.get('produced', 0):>9.0f}"
              f"{s.get('consumed', 0):>9.0f}{r.trained:>8}{s.get('queued', 0):>7.0f}"
              f"{s.get('dropped', 0):>8.0f}{r.lost:>5}{r.duplicated:>4}{stale:>8}"
              f"{r.orphans:>5}{'yes' if r.finished else 'no':>5}")
    for r in results:
        print(f"  {r.scenario}: {r.note}" + (f"; left: {r.left}" if r.left else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="trainer.total_steps of every run")
    p.add_argument("--fault-step", type=int, default=5, help="inject once this step is logged")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds after a fault before a run that neither recovers nor exits "
                        "counts as hung")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep logs, metrics and checkpoints here (default: a temp dir, deleted)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fault_step >= args.steps:
        raise SystemExit(f"--fault-step {args.fault_step} must be below --steps {args.steps}")
    model = resolve_model_path("tiny")
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="streamrl-bench-chaos-")))
        else:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        (work / "redis").mkdir(exist_ok=True)
        server = RedisServer(work / "redis")
        server.start()
        stack.callback(server.stop)
        ctx = Context(model, server, work, args.steps, args.fault_step, args.timeout,
                      tuple(args.overrides))
        print(f"model {model}; {args.steps} steps per run, fault after step {args.fault_step}; "
              f"Redis {server.url}; logs in {work}", flush=True)
        results = []
        for name in args.scenarios:
            started = time.monotonic()
            try:
                result = SCENARIOS[name](ctx)
            except (RuntimeError, psutil.Error) as exc:  # the fault could not be injected
                left = [title for run in ctx.runs for title in run.finish()]
                result = Result(name, "not measured", None, {}, [], finished=False, left=left,
                                note=" ".join(str(exc).split())[:400])
            finally:
                for run in ctx.runs:
                    run.finish()
                ctx.runs.clear()
            print(f"{name}: {result.outcome} ({time.monotonic() - started:.0f} s)", flush=True)
            results.append(result)
    print_table(results)
    for r in results:
        value = args.timeout if r.seconds is None else r.seconds
        print(result_line(f"chaos_{r.scenario}", value, "<=", GOAL_S, met=r.met, digits=1))
    print(result_line("chaos_no_orphans", sum(r.orphans for r in results), "<=", 0, digits=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
