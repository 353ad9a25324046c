"""The single controller: one training loop for sync, one_step_off and fully_async.

The modes differ only by presets (``config.MODE_PRESETS``): the staleness bound eta the buffer
admits and the update policy replicas apply when new weights land; this loop never asks which
mode it runs. Everything heavy runs behind the runtime's small handles (``streamrl.runtime``):
``buffer`` (ReplayBuffer), ``learner`` (FSDP2 ranks), ``weight_bus`` (publish to the rollout
fleet) and ``fleet`` (continuously running replicas). ``StepMetrics`` gathers and writes what
each step logs, so ``Controller.fit`` reads as the algorithm: take, prepare, advantages, update,
publish, log.
Dependencies point down: controller -> runtime -> (buffer, learner, weight_bus, rollout_fleet).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.buffer.base import Admission
from streamrl.config import Config
from streamrl.errors import RunStopped
from streamrl.metrics import MetricsLogger, RolloutIdle, Timer, rollout_metrics
from streamrl.runtime import LearnerGroup, Runtime, WeightBus, build_runtime
from streamrl.runtime.supervisor import LearnerDied, first_line
from streamrl.trace import ChromeTrace
from streamrl.types import Group

log = logging.getLogger(__name__)
TAKE_SLICE_S = 1.0


@dataclass
class TrainResult:
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint: str | None = None


def with_advantages(batch: Batch, cfg: Config, kl_ctrl: algos.KLController) -> Batch:
    """Token rewards (optionally KL-penalized) and advantages/returns: pure math, no workers."""
    scores = batch["token_level_scores"]
    if cfg.algorithm.use_kl_in_reward:
        rewards, _ = algos.apply_kl_penalty(
            scores, batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
            kl_ctrl, cfg.algorithm.kl_penalty,
        )
    else:
        rewards = scores
    data = {**batch.tensors, "token_level_rewards": rewards, "index": batch["index"]}
    advantages, returns = algos.compute_advantage(
        data, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, index_key="index",
    )
    return batch.union(Batch(tensors={
        "token_level_rewards": rewards, "advantages": advantages, "returns": returns,
    }))


class StepMetrics:
    """What a step logs besides the learner's and the weight bus's own metrics: phase timings,
    statistics of the groups trained on, throughput and idle ratios (``trained``, which ends the
    step's clock), then buffer and fleet counters (``log``, which writes the record to the
    configured sinks and the step's spans to the trace). Keys: docs/metrics.md."""

    def __init__(self, cfg: Config, runtime: Runtime, total_steps: int) -> None:
        self.rt = runtime
        self.logger = MetricsLogger(
            cfg.trainer.logger, cfg.trainer.output_dir, cfg.trainer.project_name,
            cfg.trainer.experiment_name, config=dataclasses.asdict(cfg), total_steps=total_steps,
        )
        self.trace = (ChromeTrace(Path(cfg.trainer.output_dir) / "trace.json")
                      if cfg.trainer.trace else None)
        self.rollout_idle = RolloutIdle()
        self.began = self.step_began = time.perf_counter()
        self.timer = Timer()

    def start(self) -> Timer:
        """Start a step's clock; the timer it returns times the step's phases."""
        self.timer = Timer()
        self.step_began = time.perf_counter()
        return self.timer

    def trained(self, groups: list[Group], batch: Batch, version: int) -> dict[str, float]:
        """The step's own statistics once the learner reached ``version`` (validation and
        checkpoints come after, outside the step's time)."""
        metrics = {**rollout_metrics(groups, version - 1), **self.timer.durations}
        step_s = metrics["timing_s/step"] = time.perf_counter() - self.step_began
        metrics["perf/throughput"] = int(batch["attention_mask"].sum()) / step_s
        metrics["trainer/idle_ratio"] = metrics["timing_s/take"] / step_s
        metrics["time/elapsed_s"] = time.perf_counter() - self.began
        return metrics

    def log(self, metrics: dict[str, float], version: int) -> dict[str, float]:
        """``metrics`` with the buffer's and the fleet's counters, written out; returns them."""
        rt = self.rt
        record = {**metrics, **{f"buffer/{k}": float(v)
                                for k, v in dataclasses.asdict(rt.buffer.stats()).items()}}
        fleet = rt.fleet.metrics()
        record.update(fleet, **self.rollout_idle(fleet))
        self.logger.log(record, step=version)
        if self.trace is not None:
            self.trace.add("learner", "learner", self.timer.spans)
            for replica, spans in rt.fleet.trace_spans().items():
                self.trace.add("rollout", replica, spans)
            self.trace.step_done()
        return record

    def close(self) -> None:
        self.logger.close()
        if self.trace is not None:
            self.trace.write()


class Controller:
    """Drives ``total_steps`` PPO/GRPO updates over a started runtime."""

    def __init__(self, cfg: Config, runtime: Runtime, *, patient: bool = False) -> None:
        """``patient``: groups come from ``streamrl serve`` clients, who may be idle for long;
        an empty buffer is then logged every ``buffer.take_timeout_s`` instead of failing."""
        if runtime.learner is None or runtime.weight_bus is None:
            raise ValueError("Controller: the runtime was built without learners")
        self.cfg = cfg
        self.rt = runtime
        self.patient = patient
        self._stop = threading.Event()
        self.learner: LearnerGroup = runtime.learner
        self.weight_bus: WeightBus = runtime.weight_bus
        self.kl_ctrl = algos.get_kl_controller(
            cfg.algorithm.kl_ctrl_type, cfg.algorithm.kl_coef, cfg.algorithm.target_kl,
            cfg.algorithm.horizon,
        )
        self.unacked: list[str] = []
        self.consumed = 0

    def fit(self) -> TrainResult:
        cfg, rt = self.cfg, self.rt
        version = self._resume()
        result = TrainResult(steps=version)
        steps = StepMetrics(cfg, rt, self.total_steps)
        rt.fleet.start()
        try:
            while version < self.total_steps:
                timer = steps.start()
                with timer("take"):
                    groups = self._take(cfg.task.train_batch_size, version)
                if groups is None:  # stop() was called
                    break
                batch = Batch.from_groups(groups, rt.pad_token_id)
                try:  # a step whose learner dies is done again from the last checkpoint
                    with timer("prepare"):
                        batch = self.learner.prepare(batch)
                    batch = with_advantages(batch, cfg, self.kl_ctrl)
                    with timer("update"):
                        metrics = self.learner.update(batch)
                    version += 1
                    if version % cfg.weight_bus.sync_every == 0:
                        with timer("publish"):
                            metrics.update(self.weight_bus.publish(version))
                    rt.buffer.set_version(version)
                    self._consume([g.group_id for g in groups])
                    metrics.update(steps.trained(groups, batch, version))
                    metrics.update(self._maybe_validate(version))
                    result.checkpoint = self._maybe_checkpoint(version) or result.checkpoint
                except LearnerDied as died:
                    version = self._restart_learner(died)
                    continue
                result.history.append({"step": version, **steps.log(metrics, version)})
                result.steps = version
        finally:
            rt.fleet.stop()
            steps.close()
        return result

    def stop(self) -> None:
        """Make ``fit`` return after the current step (called from another thread)."""
        self._stop.set()

    def _take(self, n: int, version: int) -> list[Group] | None:
        """``buffer.take`` in short slices, so ``stop`` and a fleet that cannot go on (a replica
        dead for good) are seen while waiting; a wait that runs out says why."""
        timeout = self.cfg.buffer.take_timeout_s
        since = time.monotonic()
        while not self._stop.is_set():
            if (failure := self.rt.fleet.failure) is not None:
                raise RunStopped(failure)
            try:
                return self.rt.buffer.take(n, version, min(TAKE_SLICE_S, timeout))
            except TimeoutError:
                self._catch_up(version)
                if time.monotonic() - since < timeout:
                    continue
                why = self._why_no_groups(n)
                if not self.patient:
                    raise RunStopped(f"no {n} groups within buffer.take_timeout_s={timeout}: "
                                     f"{why}") from None
                log.warning("waiting for episodes from streamrl serve clients: %s", why)
                since = time.monotonic()
        return None

    def _catch_up(self, version: int) -> None:
        """While the learner waits for groups its weights are those of ``version``: replicas
        that joined after it was published (or missed it) get it now rather than with the next
        publish, which a fleet behind as a whole would never let come (the publisher keeps no
        copy, ``CollectivePublisher.catch_up``)."""
        try:
            self.weight_bus.catch_up(version)
        except LearnerDied as died:  # the next step's learner call restarts the ranks
            log.warning("weight catch-up of version %d: %s", version, died)

    def _why_no_groups(self, n: int) -> str:
        s = self.rt.buffer.stats()
        slots = Admission(n, self.cfg.buffer.max_staleness).capacity(s.learner_version)
        facts = (f"{s.queued} queued, {s.in_flight} in flight, {s.started} of {slots} admission "
                 f"slots held; {self.rt.fleet.status()}")
        if not self.rt.fleet.members:
            return f"{facts}; no replica of this run produces (streamrl serve clients idle?)"
        filtered = (self.rt.fleet.metrics().get("replica/groups_filtered", 0.0)
                    if self.cfg.rollout.filter_groups else 0.0)
        if filtered:
            return (f"{facts}; {filtered:.0f} groups filtered for equal rewards "
                    "(rollout.filter_groups=true): if most are, the reward does not separate "
                    "the samples (task too easy or too hard for the model, or a constant reward)")
        if s.in_flight:
            return f"{facts}; replicas hold admissions but put nothing (slow or stuck engines)"
        return f"{facts}; replicas start no groups (check the replica log for errors)"

    @property
    def total_steps(self) -> int:
        cfg = self.cfg
        if cfg.trainer.total_epochs > 0:
            per_epoch = max(1, self.rt.num_train_prompts // cfg.task.train_batch_size)
            return cfg.trainer.total_epochs * per_epoch
        return cfg.trainer.total_steps

    def _consume(self, group_ids: list[str]) -> None:
        # With checkpoints on, groups are acked only once a checkpoint records them as trained:
        # a crash before it re-delivers them (Redis) instead of losing them.
        self.consumed += len(group_ids)
        self.unacked.extend(group_ids)
        if self.cfg.trainer.save_freq == 0:
            self.rt.buffer.ack(self.unacked)
            self.unacked = []

    def _maybe_validate(self, version: int) -> dict[str, float]:
        freq = self.cfg.trainer.test_freq
        if freq and version % freq == 0:
            results = self.rt.fleet.validate(self.cfg.trainer.val_timeout_s)
            return {f"val/{k}": v for k, v in results.items()}
        return {}

    def _maybe_checkpoint(self, version: int) -> str | None:
        freq = self.cfg.trainer.save_freq
        if not (freq and (version % freq == 0 or version == self.total_steps)):
            return None
        extra: dict[str, Any] = {
            "consumed": self.consumed,
            "trained_group_ids": self.unacked,
            "fleet": self.rt.fleet.state(partials=True),  # groups in flight: docs/partials.md
        }
        path = self.learner.save_checkpoint(version, extra)
        self.rt.buffer.ack(self.unacked)
        self.unacked = []
        return path

    def _resume(self) -> int:
        """Load the checkpoint trainer.resume names; rebase buffer and fleet to its version."""
        cfg = self.cfg
        path = None
        if cfg.trainer.resume == "auto":
            # Here, not at the top: it imports torch.distributed.checkpoint, ~1 s of start-up.
            from streamrl.learner.checkpoint import find_latest

            path = find_latest(cfg.trainer.output_dir)
        elif cfg.trainer.resume != "disable":
            path = cfg.trainer.resume
        if path is None:
            self.rt.buffer.set_version(0)
            return 0
        version = self._load(str(path), fleet=True)
        log.info("resumed from %s at step %d", path, version)
        return version

    def _load(self, path: str, fleet: bool) -> int:
        """The learner at checkpoint ``path``, the buffer rebased to it, its weights published;
        ``fleet``: the replicas' prompt cursors and partial groups too. Returns its version."""
        extra = self.learner.load_checkpoint(path)
        version = int(self.learner.version)
        self.consumed = int(extra.get("consumed", 0))
        self.unacked = []  # trained after the checkpoint: the buffer delivers them again
        self.rt.buffer.rebase(version, self.consumed, skip_ids=extra.get("trained_group_ids", []))
        if fleet:
            self.rt.fleet.load_state(extra.get("fleet", {}))
        self.weight_bus.publish(version)
        return version

    def _restart_learner(self, died: LearnerDied) -> int:
        """New learner ranks from the last checkpoint, up to runtime.max_restarts times; the
        replicas keep running (their in-flight groups newer than the checkpoint are refused at
        take, and their slots given back). Returns the version to go on from."""
        from streamrl.learner.checkpoint import find_latest

        limit = self.cfg.runtime.max_restarts
        path = find_latest(self.cfg.trainer.output_dir)
        if self.learner.respawn is None:
            raise LearnerDied(f"{died}; not restarted: its ranks live in the hybrid workers")
        if self.learner.restarts >= limit:
            raise LearnerDied(f"{died}; not restarted: runtime.max_restarts={limit} restarts "
                              "are used up")
        if path is None:
            raise LearnerDied(f"{died}; not restarted: no checkpoint in trainer.output_dir="
                              f"{self.cfg.trainer.output_dir} (trainer.save_freq)")
        log.error("%s; restarting the learner from %s (restart %d of runtime.max_restarts=%d)",
                  died, path, self.learner.restarts + 1, limit)
        started = time.monotonic()
        try:
            self.learner.restart()
        except Exception as exc:  # e.g. no bundle free for the new ranks
            raise LearnerDied(f"{died}; restarting it failed: {first_line(exc)}") from None
        version = self._load(str(path), fleet=False)
        log.warning("learner restarted from %s at step %d in %.0f s", path, version,
                    time.monotonic() - started)
        return version


def run_training(cfg: Config) -> TrainResult:
    """``streamrl train``: build the runtime the config describes and run the loop."""
    torch.manual_seed(cfg.trainer.seed)
    with build_runtime(cfg) as runtime:
        # Without replicas of its own the trainer learns from a streamrl serve process.
        return Controller(cfg, runtime, patient=cfg.rollout.num_replicas == 0).fit()
