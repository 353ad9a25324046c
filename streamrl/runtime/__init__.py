"""streamrl.runtime: places the workers on Ray and hands the controller small handles.

Parts:
- ``placement``: start/join Ray (token auth on), reserve the resource pools, pin cores,
- ``handles``: what the controller sees — ``Runtime`` with ``buffer`` (a ReplayBuffer),
  ``learner`` (``LearnerGroup``), ``weight_bus`` (``publish(version)``), ``fleet`` (``Fleet``),
- ``actors``: the process roles placed as Ray actors (``LearnerActor``, ``ReplicaActor``),
- ``build_runtime(cfg)`` (here): wires them up in ``setup`` order — shared buffer, learner
  ranks, replicas joined to the weight bus — and on exit stops every actor and shuts Ray down
  (``ray.shutdown``, never ``ray stop``).

Components never reference the runtime; it wires them and the controller drives them.
Dependencies point down: runtime -> learner / rollout_fleet / buffer / weight_bus.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from streamrl.buffer import make_buffer
from streamrl.buffer.base import ReplayBuffer
from streamrl.buffer.remote import RemoteBuffer, start_buffer_actor
from streamrl.config import Config, replace
from streamrl.models import resolve_model_path
from streamrl.net import free_port
from streamrl.runtime.handles import Fleet, LearnerGroup, Runtime, WeightBus
from streamrl.runtime.placement import in_bundle, init_ray, reserve_pools

__all__ = ["Fleet", "LearnerGroup", "Runtime", "WeightBus", "build_runtime"]

log = logging.getLogger(__name__)
ACTOR_SHUTDOWN_TIMEOUT_S = 30


@contextmanager
def build_runtime(cfg: Config, *, learners: bool = True, serving: bool = False
                  ) -> Iterator[Runtime]:
    """Place and wire the workers ``cfg`` describes.

    ``learners=False``: no learner ranks (a ``streamrl serve`` process that only serves; with
    ``buffer=redis`` its replicas follow the bus endpoint a trainer announces in the buffer).
    ``serving=True``: replicas answer requests (``streamrl serve``) instead of running their
    own prompt loops. ``rollout.num_replicas=0``: a trainer fed by another process's replicas;
    with ``buffer=redis`` it announces its bus endpoint there.
    """
    from transformers import AutoTokenizer

    from streamrl.data import make_prompt_source
    from streamrl.runtime.actors import LearnerActor, ReplicaActor

    model_path = resolve_model_path(cfg.model.path)
    cfg = replace(cfg, **{"model.path": model_path})  # every worker loads the same directory
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    num_train_prompts = len(make_prompt_source(cfg.task, tokenizer, "train"))
    started_ray = init_ray(cfg)
    actors: list[Any] = []
    pgs: list[PlacementGroup] = []
    try:
        train_pg, rollout_pg = reserve_pools(cfg, learners=learners)
        pgs = list({id(p): p for p in (train_pg, rollout_pg) if p is not None}.values())
        buffer: ReplayBuffer
        if cfg.buffer.backend == "memory":
            # One queue for every process: the memory backend lives in an actor.
            buffer_actor = start_buffer_actor(cfg)
            actors.append(buffer_actor)
            buffer = RemoteBuffer(buffer_actor)
        else:
            buffer = make_buffer(cfg)  # every process connects to the same Redis run

        learner_group: LearnerGroup | None = None
        endpoint: str | None = None
        if learners:
            assert train_pg is not None
            learner_port = free_port()
            ranks = [
                ray.remote(num_cpus=cfg.runtime.cpus_per_learner)(LearnerActor).options(
                    scheduling_strategy=in_bundle(train_pg, rank),
                ).remote(cfg, rank, cfg.learner.world_size, "127.0.0.1", learner_port)
                for rank in range(cfg.learner.world_size)
            ]
            actors.extend(ranks)
            learner_group = LearnerGroup(ranks)
            endpoint = ray.get(ranks[0].bus_endpoint.remote())
            announce = getattr(buffer, "announce_bus", None)
            if announce is not None:  # Redis: how a separate streamrl serve finds the bus
                announce(endpoint)
        replicas = [
            ray.remote(num_cpus=cfg.runtime.cpus_per_replica)(ReplicaActor).options(
                scheduling_strategy=in_bundle(rollout_pg, i), max_concurrency=1024,
            ).remote(cfg, i, buffer, endpoint)
            for i in range(cfg.rollout.num_replicas)
        ] if rollout_pg is not None else []
        actors.extend(replicas)
        ray.get([r.setup.remote() for r in replicas])
        if learner_group is not None and replicas:
            ray.get(learner_group.actors[0].wait_for_receivers.remote(len(replicas)))
        yield Runtime(
            buffer=buffer, learner=learner_group,
            weight_bus=WeightBus(learner_group) if learner_group is not None else None,
            fleet=Fleet(replicas, loops=not serving), pad_token_id=int(tokenizer.pad_token_id),
            num_train_prompts=num_train_prompts, tokenizer=tokenizer, model_path=model_path,
        )
    finally:
        for actor in reversed(actors):
            try:
                ray.get(actor.shutdown.remote(), timeout=ACTOR_SHUTDOWN_TIMEOUT_S)
            except Exception as exc:  # a dead actor must not stop the others' clean-up
                log.warning("actor shutdown failed: %s", exc)
            ray.kill(actor)
        for pg in pgs:
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()
