"""What the controller sees of the workers: four small handles over Ray actors.

- ``LearnerGroup``: SPMD learner ranks; every call goes to all ranks, rank 0 answers,
- ``WeightBus``: ``publish(version)`` (ranks gather, rank 0 sends, replicas ack loaded),
- ``Fleet``: the rollout replicas (start, stop, validate, counters, resume state),
- ``Runtime``: the four together (with the buffer) plus run facts the loop needs.

The controller depends on these, never on Ray or the actor classes. Depends on batch and the
buffer protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from streamrl.batch import Batch
from streamrl.buffer.base import ReplayBuffer


class LearnerGroup:
    """SPMD learner ranks: every call goes to all ranks; rank 0's answer is returned."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def _all(self, method: str, *args: Any) -> Any:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])[0]

    @property
    def version(self) -> int:
        return int(ray.get(self.actors[0].get_version.remote()))

    def prepare(self, batch: Batch) -> Batch:
        return self._all("prepare", batch)

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
    """Controller-side handle: the learner ranks gather, rank 0 sends and waits until every
    replica serves ``version`` (so admission never opens for groups sampled by old weights)."""

    def __init__(self, learner: LearnerGroup) -> None:
        self.learner = learner

    def publish(self, version: int) -> dict[str, float]:
        return self.learner.publish(version)


class Fleet:
    """The rollout replicas, each a Ray actor running its continuous loop, or, in
    ``streamrl serve`` (``loops=False``), answering the service's requests instead."""

    def __init__(self, replicas: list[Any], loops: bool = True) -> None:
        self.replicas = replicas
        self.loops = loops

    def start(self) -> None:
        if self.loops:
            ray.get([r.start.remote() for r in self.replicas])

    def stop(self) -> None:
        if self.loops:
            ray.get([r.stop.remote() for r in self.replicas])

    def validate(self) -> dict[str, float]:
        if not self.replicas:
            return {}
        results = ray.get([r.validate.remote() for r in self.replicas[:1]])
        return dict(results[0])

    def metrics(self) -> dict[str, float]:
        """Replica counters summed over the fleet (``replica/<counter>``); rates and gauges
        that do not add up (means, versions, timings) are averaged."""
        per_replica: list[dict[str, float]] = ray.get([r.metrics.remote() for r in self.replicas])
        out: dict[str, float] = {}
        for name in per_replica[0] if per_replica else ():
            values = [m[name] for m in per_replica]
            summed = name not in AVERAGED_COUNTERS
            out[f"replica/{name}"] = sum(values) if summed else sum(values) / len(values)
        return out

    def state(self) -> list[dict[str, Any]]:
        return list(ray.get([r.state.remote() for r in self.replicas]))

    def load_state(self, states: list[dict[str, Any]]) -> None:
        if states:
            ray.get([r.load_state.remote(s) for r, s in zip(self.replicas, states)])


AVERAGED_COUNTERS = frozenset({"reward_mean", "version", "last_update_s"})


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
