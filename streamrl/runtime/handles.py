"""What the controller sees of the workers: four small handles over Ray actors.

- ``LearnerGroup``: SPMD learner ranks; every call goes to all ranks, rank 0 answers,
- ``WeightBus``: ``publish(version)`` (ranks gather, rank 0 sends, replicas ack loaded),
- ``Fleet``: the rollout replicas (start, stop, validate, counters, resume state), kept alive
  by a ``supervisor.Supervisor``; ``failure`` says why the fleet cannot go on,
- ``Runtime``: the four together (with the buffer) plus run facts the loop needs.

The controller depends on these, never on Ray or the actor classes. Depends on batch and the
buffer protocol.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from streamrl.batch import Batch
from streamrl.buffer.base import ReplayBuffer
from streamrl.runtime.supervisor import LearnerDied, Member, Supervisor, first_line, shut_down

log = logging.getLogger(__name__)


class LearnerGroup:
    """SPMD learner ranks: every call goes to all ranks; rank 0's answer is returned.
    ``skip_prepare``: the ranks' ``prepare`` would return the batch as it came
    (``Config.prepare_adds_tensors`` is false), so it is not sent to them and back.
    ``respawn``: replaces the ranks (``restart``); None: they cannot be (hybrid workers)."""

    def __init__(self, actors: list[Any], skip_prepare: bool = False,
                 respawn: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.actors = actors
        self.skip_prepare = skip_prepare
        self.respawn = respawn
        self.restarts = 0

    def restart(self) -> None:
        """New ranks in place of these (killed), joined to the fleet's replicas, at the
        initial weights: the caller loads a checkpoint next."""
        assert self.respawn is not None
        self.restarts += 1
        self.actors = self.respawn(self.actors)

    def _all(self, method: str, *args: Any) -> Any:
        """Rank 0's answer. A rank that dies stops the run at once, naming it: the other ranks
        would wait in a collective for it until their own timeout."""
        return self._ranks(method, self.actors, *args)

    def _rank0(self, method: str, *args: Any) -> Any:
        """Rank 0 alone, for what only it knows (the weight bus's receivers): no collective,
        so the other ranks are not woken."""
        return self._ranks(method, self.actors[:1], *args)

    def _ranks(self, method: str, actors: list[Any], *args: Any) -> Any:
        refs = [getattr(a, method).remote(*args) for a in actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError as exc:
                rank = refs.index(done[0])
                raise LearnerDied(
                    f"learner rank {rank} died during {method} ({first_line(exc)}); "
                    "trainer.resume=auto continues from the last checkpoint") from None
        return ray.get(refs[0])

    @property
    def version(self) -> int:
        return int(ray.get(self.actors[0].get_version.remote()))

    def prepare(self, batch: Batch) -> Batch:
        return batch if self.skip_prepare else self._all("prepare", batch)

    def update(self, batch: Batch) -> dict[str, float]:
        return dict(self._all("update", batch))

    def publish(self, version: int) -> dict[str, float]:
        return dict(self._all("publish", version))

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        return str(self._all("save_checkpoint", step, extra))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return dict(self._all("load_checkpoint", path))

    def export_hf(self, path: str) -> None:
        self._all("export_hf", path)


class WeightBus:
    """Controller-side handle: the learner ranks gather, rank 0 sends ``version`` and returns
    once every replica received it. Replicas load it while the learner goes on, and start no
    group before it is loaded, so admission may open for ``version`` at once; the next publish
    first waits for these loads."""

    def __init__(self, learner: LearnerGroup) -> None:
        self.learner = learner

    def publish(self, version: int) -> dict[str, float]:
        return self.learner.publish(version)

    def catch_up(self, version: int) -> None:
        """Re-send ``version`` (the learner's current weights) to the replicas behind it, if
        any. Asked every take slice: rank 0 alone answers whether any is (only it knows the
        receivers); all ranks gather only when one is."""
        if self.learner._rank0("behind", version):
            self.learner._all("catch_up", version)


class Fleet:
    """The rollout replicas, each a Ray actor running its continuous loop, or, in
    ``streamrl serve`` (``loops=False``), answering the service's requests instead.

    Calls go to the live replicas only (one that died between two heartbeats is skipped: its
    supervisor replaces it), so a replica's death never crashes the controller."""

    def __init__(self, members: list[Member], loops: bool = True,
                 swap_tokens: Any = None) -> None:
        """``swap_tokens``: the rolling update's tokens actor (``actors.start_swap_tokens``),
        held here so it lives as long as the fleet, whichever replica dies."""
        self.members = members
        self.loops = loops
        self.swap_tokens = swap_tokens
        self.lock = threading.RLock()
        self.supervisor: Supervisor | None = None

    @property
    def replicas(self) -> list[Any]:
        """The live replicas' actor handles."""
        with self.lock:
            return [m.actor for m in self.members if m.live]

    def supervise(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        supervisor.start()

    @property
    def failure(self) -> str | None:
        """Why the fleet cannot go on (a replica dead for good), or None."""
        return self.supervisor.failure if self.supervisor is not None else None

    def status(self) -> str:
        """What the fleet is doing, for a message about a wait that ran out."""
        if self.failure is not None:
            return self.failure
        live = sum(m.live for m in self.members)
        down = [m.name for m in self.members if not m.live]
        return (f"{live} of {len(self.members)} replicas live"
                + (f" ({', '.join(down)} being re-created)" if down else ""))

    def _each(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every live replica; the answers of those that are still alive."""
        actors = self.replicas
        results = []
        for ref in [getattr(a, method).remote(*args) for a in actors]:
            try:
                results.append(ray.get(ref))
            except RayActorError as exc:
                log.warning("a replica died during %s (its supervisor replaces it): %s",
                            method, first_line(exc))
        return results

    def start(self) -> None:
        if self.loops:
            self._each("start")

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.loops:
            self._each("stop")

    def validate(self, timeout_s: float) -> dict[str, float]:
        """The first live replica's validation; {} (with a warning naming the replica) when
        it takes longer than ``timeout_s`` (trainer.val_timeout_s): training goes on."""
        with self.lock:
            live = [m for m in self.members if m.live]
        for member in live:
            ref = member.actor.validate.remote()
            try:
                return dict(ray.get(ref, timeout=timeout_s))
            except RayActorError:
                continue
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref)
                log.warning("validation on %s did not finish within "
                            "trainer.val_timeout_s=%g s: skipped (lower task.val_size or "
                            "rollout.max_new_tokens, or raise trainer.val_timeout_s)",
                            member.name, timeout_s)
                return {}
        return {}

    def metrics(self) -> dict[str, float]:
        """Replica counters summed over the fleet (``replica/<counter>``); rates and gauges
        that do not add up (means, versions, timings) are averaged. ``fleet/*``: live
        replicas, re-creations, admissions given back by dead ones."""
        per_replica: list[dict[str, float]] = self._each("metrics")
        out: dict[str, float] = {}
        for name in per_replica[0] if per_replica else ():
            values = [m[name] for m in per_replica]
            summed = name not in AVERAGED_COUNTERS
            out[f"replica/{name}"] = sum(values) if summed else sum(values) / len(values)
        out["fleet/live_replicas"] = float(sum(m.live for m in self.members))
        if self.supervisor is not None:
            out["fleet/restarts"] = float(self.supervisor.restarts)
            out["fleet/released_admissions"] = float(self.supervisor.released)
        return out

    def trace_spans(self) -> dict[str, list[tuple[str, float, float]]]:
        """Each live replica's spans since the last call (``trainer.trace``), by name."""
        with self.lock:
            members = [m for m in self.members if m.live]
        spans = {}
        for m in members:
            try:
                spans[m.name] = list(ray.get(m.actor.trace_spans.remote()))
            except RayActorError:
                continue  # died: its supervisor replaces it
        return spans

    def state(self, partials: bool = False) -> list[dict[str, Any]]:
        """Each replica's resume state; ``partials`` (a checkpoint): with its groups in flight."""
        # A replica being re-created is saved with the cursor of its last heartbeat.
        with self.lock:
            members = list(self.members)
        states = []
        for m in members:
            try:
                states.append(dict(ray.get(m.actor.state.remote(partials))) if m.live
                              else m.state)
            except RayActorError:
                states.append(m.state)
        return states

    def shutdown(self, timeout: float) -> None:
        """Stop supervising, shut every replica down (``timeout`` each) and kill its actor."""
        if self.supervisor is not None:
            self.supervisor.stop()
        for m in self.members:
            if m.live:
                shut_down(m.actor, m.name, timeout)
            else:
                ray.kill(m.actor)
        if self.swap_tokens is not None:
            ray.kill(self.swap_tokens)

    def load_state(self, states: list[dict[str, Any]]) -> None:
        if states:
            ray.get([m.actor.load_state.remote(s) for m, s in zip(self.members, states)])
        for m, s in zip(self.members, states):
            m.state = dict(s)


AVERAGED_COUNTERS = frozenset({"reward_mean", "version", "weight_pause_s", "swap_wait_s"})


@dataclass
class Runtime:
    buffer: ReplayBuffer
    learner: LearnerGroup | None
    """None in a ``streamrl serve`` process that only serves."""
    weight_bus: WeightBus | None
    fleet: Fleet
    pad_token_id: int
    num_train_prompts: int
    tokenizer: Any
    model_path: str
