"""Ray placement: the workers the controller drives, behind four small handles.

Parts:
- ``Runtime``: what the controller sees — ``buffer`` (a ReplayBuffer), ``learner``
  (``LearnerGroup``), ``weight_bus`` (``publish(version)``), ``fleet`` (``Fleet``).
- ``build_runtime(cfg)``: starts (or joins) Ray with token authentication on, reserves the
  resource pools as placement groups (``colocated``: learner rank i and replica i share bundle
  i; ``disaggregated``: a train pool and a rollout pool), creates the actors, wires the weight
  bus, and on exit kills every actor and shuts Ray down (``ray.shutdown``, never ``ray stop``).
- ``RemoteBuffer``: the ReplayBuffer protocol over a buffer actor (memory backend) so replicas
  in other processes share one queue; the Redis backend needs no actor (every process connects).

Dependencies point down: runtime -> learner / rollout_fleet / buffer / weight_bus.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Token authentication stays on; Ray reads the mode once, when it is first imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.batch import Batch
from streamrl.buffer import make_buffer
from streamrl.buffer.base import BufferStats, ReplayBuffer
from streamrl.config import Config, ConfigError, replace
from streamrl.types import Group

log = logging.getLogger(__name__)

# Engines on CPU need these in every worker process (DESIGN.md §11).
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RemoteBuffer(ReplayBuffer):
    """A ReplayBuffer whose state lives in a (threaded) Ray actor shared by all processes."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def try_admit(self) -> bool:
        return bool(ray.get(self.handle.try_admit.remote()))

    def cancel_admission(self) -> None:
        ray.get(self.handle.cancel_admission.remote())

    def put(self, group: Group) -> None:
        ray.get(self.handle.put.remote(group))

    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        return list(ray.get(self.handle.take.remote(n, learner_version, timeout)))

    def ack(self, group_ids: list[str]) -> None:
        ray.get(self.handle.ack.remote(group_ids))

    def set_version(self, learner_version: int) -> None:
        ray.get(self.handle.set_version.remote(learner_version))

    def rebase(self, learner_version: int, consumed: int, skip_ids: list[str]) -> None:
        ray.get(self.handle.rebase.remote(learner_version, consumed, skip_ids))

    def stats(self) -> BufferStats:
        return ray.get(self.handle.stats.remote())


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
        return dict(self.learner._all("publish", version))


class Fleet:
    """The rollout replicas, each a Ray actor running its continuous loop."""

    def __init__(self, replicas: list[Any]) -> None:
        self.replicas = replicas

    def start(self) -> None:
        ray.get([r.start.remote() for r in self.replicas])

    def stop(self) -> None:
        ray.get([r.stop.remote() for r in self.replicas])

    def validate(self) -> dict[str, float]:
        results = ray.get([r.validate.remote() for r in self.replicas[:1]])
        return dict(results[0])

    def state(self) -> list[dict[str, Any]]:
        return list(ray.get([r.state.remote() for r in self.replicas]))

    def load_state(self, states: list[dict[str, Any]]) -> None:
        if states:
            ray.get([r.load_state.remote(s) for r, s in zip(self.replicas, states)])


@dataclass
class Runtime:
    buffer: ReplayBuffer
    learner: LearnerGroup
    weight_bus: WeightBus
    fleet: Fleet
    pad_token_id: int
    num_train_prompts: int


def _init_ray(cfg: Config) -> bool:
    """Start a local Ray (or join ``runtime.address``); returns whether this call started it."""
    if ray.is_initialized():
        return False
    ray.init(
        address=cfg.runtime.address,
        num_cpus=cfg.runtime.num_cpus if cfg.runtime.address is None else None,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": WORKER_ENV},
    )
    return True


def _pools(cfg: Config) -> tuple[PlacementGroup, PlacementGroup]:
    """(train pool, rollout pool); the same group twice when colocated."""
    world, replicas = cfg.learner.world_size, cfg.rollout.num_replicas
    if cfg.runtime.placement == "colocated":
        bundle = {"CPU": cfg.runtime.cpus_per_learner + cfg.runtime.cpus_per_replica}
        pg = placement_group([bundle] * max(world, replicas), strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        return pg, pg
    train = placement_group([{"CPU": cfg.runtime.cpus_per_learner}] * world, strategy="PACK")
    rollout = placement_group([{"CPU": cfg.runtime.cpus_per_replica}] * replicas,
                              strategy="PACK")
    ray.get([train.ready(), rollout.ready()], timeout=120)
    return train, rollout


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


@contextmanager
def build_runtime(cfg: Config) -> Iterator[Runtime]:
    from transformers import AutoTokenizer

    from streamrl.data import make_prompt_source
    from streamrl.runtime_actors import LearnerActor, ReplicaActor
    from streamrl.testing import resolve_model_path

    if cfg.weight_bus.backend == "colocated":
        # ColocatedPublisher hands weights to an engine in the learner's own process; here the
        # learner and the engines are separate actors, so only the collective bus reaches them.
        raise ConfigError(
            "weight_bus.backend='colocated': streamrl train places learner ranks and engines in "
            "separate Ray actors; use weight_bus.backend=collective (with "
            "runtime.placement=colocated to share devices)"
        )
    model_path = resolve_model_path(cfg.model.path)
    cfg = replace(cfg, **{"model.path": model_path})  # every worker loads the same directory
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    num_train_prompts = len(make_prompt_source(cfg.task, tokenizer, "train"))
    started_ray = _init_ray(cfg)
    actors: list[Any] = []
    pgs: list[PlacementGroup] = []
    try:
        train_pg, rollout_pg = _pools(cfg)
        pgs = list({id(p): p for p in (train_pg, rollout_pg)}.values())
        buffer_actor = None
        if cfg.buffer.backend == "memory":
            buffer_actor = ray.remote(num_cpus=0, max_concurrency=64)(_buffer_actor_cls()).remote(
                cfg.task.train_batch_size, cfg.max_staleness
            )
            actors.append(buffer_actor)
            buffer: ReplayBuffer = RemoteBuffer(buffer_actor)
        else:
            buffer = make_buffer(cfg, cfg.task.train_batch_size, cfg.max_staleness)

        learner_port = free_port()
        learners = [
            ray.remote(num_cpus=cfg.runtime.cpus_per_learner)(LearnerActor).options(
                scheduling_strategy=_in(train_pg, rank),
            ).remote(cfg, rank, cfg.learner.world_size, "127.0.0.1", learner_port)
            for rank in range(cfg.learner.world_size)
        ]
        actors.extend(learners)
        endpoint = ray.get(learners[0].bus_endpoint.remote())
        replicas = [
            ray.remote(num_cpus=cfg.runtime.cpus_per_replica)(ReplicaActor).options(
                scheduling_strategy=_in(rollout_pg, i), max_concurrency=64,
            ).remote(cfg, model_path, i, buffer_actor, endpoint)
            for i in range(cfg.rollout.num_replicas)
        ]
        actors.extend(replicas)
        ray.get([r.setup.remote() for r in replicas])
        ray.get(learners[0].wait_for_receivers.remote(len(replicas)))
        learner = LearnerGroup(learners)
        fleet = Fleet(replicas)
        yield Runtime(
            buffer=buffer, learner=learner,
            weight_bus=WeightBus(learner), fleet=fleet,
            pad_token_id=int(tokenizer.pad_token_id),
            num_train_prompts=num_train_prompts,
        )
    finally:
        for actor in reversed(actors):
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as exc:  # a dead actor must not stop the others' clean-up
                log.warning("actor shutdown failed: %s", exc)
            ray.kill(actor)
        for pg in pgs:
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()


def _buffer_actor_cls() -> type:
    from streamrl.buffer.memory import MemoryBuffer

    class BufferActor(MemoryBuffer):
        """The memory backend in a threaded actor (replicas put while the learner takes)."""

        def shutdown(self) -> None:
            self.close()

    return BufferActor
