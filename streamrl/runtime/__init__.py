"""streamrl.runtime: places the workers on Ray and hands the controller small handles.

Parts:
- ``placement``: start/join Ray (token auth on), reserve the resource pools, pin cores,
- ``handles``: what the controller sees — ``Runtime`` with ``buffer`` (a ReplayBuffer),
  ``learner`` (``LearnerGroup``), ``weight_bus`` (``publish(version)``), ``fleet`` (``Fleet``),
- ``actors``: the process roles placed as Ray actors (``LearnerActor``, ``ReplicaActor``),
- ``hybrid``: ``HybridActor``, a learner rank and its in-process engine in one actor
  (``weight_bus.backend=colocated``): both handles drive the same actors,
- ``supervisor``: notices dead or hung replicas, gives their admissions back, re-creates them,
- ``build_runtime(cfg)`` (here): wires them up in ``setup`` order — shared buffer, learner
  ranks (rendezvous at an address rank 0 picks on its own node), replicas joined to the weight
  bus (or hybrid workers: ranks first, then their engines inside the ranks' world) — and on
  exit stops every actor and shuts Ray down (``ray.shutdown``, never ``ray stop``).
  The same config runs on one machine (``runtime.address`` unset: loopback) or on a cluster.

Components never reference the runtime; it wires them and the controller drives them.
Dependencies point down: runtime -> learner / rollout_fleet / buffer / weight_bus.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group

from streamrl.buffer import make_buffer
from streamrl.buffer.base import BufferProducer, ReplayBuffer
from streamrl.buffer.remote import Recreate, RemoteBuffer, actor_name, start_buffer_actor
from streamrl.config import Config, replace
from streamrl.errors import ConfigError, RunStopped
from streamrl.logs import CPU_MODE_NOTE
from streamrl.models import padding_id, resolve_model_path
from streamrl.rollout_fleet import load_user_code
from streamrl.rollout_fleet.rewards import start_reward_servers
from streamrl.runtime.handles import Fleet, LearnerGroup, Runtime, WeightBus
from streamrl.runtime.placement import check_fits, gpus_per, in_bundle, init_ray, reserve_pools
from streamrl.runtime.supervisor import (
    START_TIMEOUT_S,
    Member,
    Spawn,
    Supervisor,
    first_line,
    holder_name,
    shut_down,
)

__all__ = ["Fleet", "LearnerGroup", "Runtime", "WeightBus", "build_runtime"]

ACTOR_SHUTDOWN_TIMEOUT_S = 30
log = logging.getLogger(__name__)


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
    from streamrl.data import make_prompt_source
    from streamrl.runtime.hybrid import start_hybrid_workers

    # Bad input fails here, before Ray and the engines start.
    check_fits(cfg, learners=learners)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer_path = (resolve_model_path(cfg.model.tokenizer_path, "model.tokenizer_path",
                                         "tokenizer_config.json")
                      if cfg.model.tokenizer_path is not None else None)
    # every worker loads the same directories
    cfg = replace(cfg, **{"model.path": model_path, "model.tokenizer_path": tokenizer_path})
    from transformers import AutoTokenizer  # ~2 s: after the checks that do not need it

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    num_train_prompts = len(make_prompt_source(cfg.task, tokenizer, "train"))
    load_user_code(cfg)
    redis_buffer = make_buffer(cfg) if cfg.buffer.backend == "redis" else None
    started_ray = init_ray(cfg)
    actors: list[Any] = []
    pgs: list[PlacementGroup] = []
    fleet: Fleet | None = None
    remote_buffer: RemoteBuffer | None = None
    try:
        train_pg, rollout_pg = reserve_pools(cfg, learners=learners)
        pgs = list({id(p): p for p in (train_pg, rollout_pg) if p is not None}.values())
        buffer: ReplayBuffer
        if redis_buffer is not None:
            buffer = redis_buffer  # every process connects to the same Redis run
        elif serving:
            # Replicas that serve never touch the buffer: the service admits and puts, the
            # controller takes, both in this process, without an actor call per episode.
            buffer = make_buffer(cfg)
        else:
            # One queue for every process: the memory backend lives in an actor (re-created
            # if it dies: it holds only generated groups).
            base = f"streamrl-buffer-{uuid.uuid4().hex[:8]}"
            remote_buffer = buffer = RemoteBuffer(
                start_buffer_actor(cfg, actor_name(base, 0)), base,
                recreate=_buffer_recreator(cfg, base))
        # Reward models and judges: one actor each, shared by every replica (and re-creation).
        reward_servers = start_reward_servers(cfg.reward)
        actors.extend(reward_servers.values())

        learner_group: LearnerGroup | None = None
        spawn: Spawn | None = None
        if cfg.weight_bus.backend == "colocated":
            if serving or not learners:
                raise ConfigError("weight_bus.backend=colocated: streamrl serve runs no hybrid "
                                  "workers; use weight_bus.backend=collective")
            assert train_pg is not None
            workers = start_hybrid_workers(cfg, train_pg, buffer, reward_servers)
            learner_group = LearnerGroup(workers)
            fleet = Fleet([Member(i, w) for i, w in enumerate(workers)])
        else:
            learner_group, spawn, fleet = _start_disaggregated(
                cfg, learners, serving, buffer, reward_servers, train_pg, rollout_pg, actors)
        if fleet.members and cfg.trainer.log_level != "debug" and not torch.cuda.is_available():
            log.info(CPU_MODE_NOTE)  # in place of the engines' start-up warnings about it
        fleet.supervise(Supervisor(cfg, fleet.members, buffer, spawn, loops=not serving,
                                   lock=fleet.lock, swap_tokens=fleet.swap_tokens))
        yield Runtime(
            buffer=buffer, learner=learner_group,
            weight_bus=WeightBus(learner_group) if learner_group is not None else None,
            fleet=fleet, pad_token_id=padding_id(tokenizer),
            num_train_prompts=num_train_prompts, tokenizer=tokenizer, model_path=model_path,
        )
    finally:
        if fleet is not None:
            fleet.shutdown(ACTOR_SHUTDOWN_TIMEOUT_S)
        for actor in reversed(actors):
            shut_down(actor, "actor", ACTOR_SHUTDOWN_TIMEOUT_S)
        if remote_buffer is not None:  # its current incarnation
            shut_down(remote_buffer.handle, "buffer actor", ACTOR_SHUTDOWN_TIMEOUT_S)
        for pg in pgs:
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()


def _buffer_recreator(cfg: Config, base: str) -> Recreate:
    """How the driver re-creates a dead memory buffer actor: up to runtime.max_restarts
    times, then the run stops naming the cause."""

    def recreate(incarnation: int, version: int, consumed: int, died: BaseException) -> Any:
        if incarnation > cfg.runtime.max_restarts:
            raise RunStopped(
                f"the memory buffer actor died ({first_line(died)}), and "
                f"runtime.max_restarts={cfg.runtime.max_restarts} re-creations are used up; "
                "trainer.resume=auto continues from the last checkpoint") from None
        return start_buffer_actor(cfg, actor_name(base, incarnation), version, consumed,
                                  recovered=True)

    return recreate


def _start_disaggregated(cfg: Config, learners: bool, serving: bool, buffer: BufferProducer,
                         reward_servers: dict[str, Any], train_pg: PlacementGroup | None,
                         rollout_pg: PlacementGroup | None, actors: list[Any]
                         ) -> tuple[LearnerGroup | None, Spawn, Fleet]:
    """Learner ranks (their actors appended to ``actors``) and replicas in actors of their own,
    joined over the weight bus; the replicas set up and, with learners, connected. The engines
    start while the learner ranks do (each side takes seconds of imports and loading)."""
    from streamrl.runtime.actors import LearnerActor, ReplicaActor, start_swap_tokens

    endpoint: str | None = None  # the bus, once the learner is up: a re-created replica joins it

    def spawn(index: int, holder: str) -> Any:
        assert rollout_pg is not None
        return ray.remote(num_cpus=cfg.runtime.cpus_per_replica,
                          num_gpus=gpus_per(cfg, "replica"))(ReplicaActor).options(
            scheduling_strategy=in_bundle(rollout_pg, index), max_concurrency=1024,
        ).remote(cfg, index, None if serving else buffer, endpoint, holder, reward_servers)

    num_replicas = cfg.rollout.num_replicas if rollout_pg is not None else 0
    # Before any replica: each finds it by name as it sets up.
    swap_tokens = (start_swap_tokens(cfg.weight_bus.rolling_k, cfg.weight_bus.timeout_s)
                   if num_replicas and cfg.weight_bus.update_policy == "rolling" else None)
    fleet = Fleet([Member(i, spawn(i, holder_name(i, 0))) for i in range(num_replicas)],
                  loops=not serving, swap_tokens=swap_tokens)
    learner_group: LearnerGroup | None = None

    def start_ranks() -> list[Any]:
        """The learner ranks, started; their bus endpoint announced (``endpoint``)."""
        nonlocal endpoint
        assert train_pg is not None
        ranks = [
            ray.remote(num_cpus=cfg.runtime.cpus_per_learner,
                       num_gpus=gpus_per(cfg, "learner"))(LearnerActor).options(
                scheduling_strategy=in_bundle(train_pg, rank),
            ).remote(cfg, rank, cfg.learner.world_size)
            for rank in range(cfg.learner.world_size)
        ]
        actors.extend(ranks)
        # The FSDP group rendezvous on rank 0's node, at a port picked there.
        # Bounded: a restart's ranks wait for the dead ones' bundles, which Ray may not free.
        where = "its runtime.train_pool bundle, model load"
        [(master_addr, master_port)] = _wait_started([ranks[0].rendezvous.remote()],
                                                     "start", where, "learner rank {}")
        _wait_started([r.start.remote(master_addr, master_port) for r in ranks],
                      "join the FSDP group", where, "learner rank {}")
        endpoint = ray.get(ranks[0].bus_endpoint.remote())
        announce = getattr(buffer, "announce_bus", None)
        if announce is not None:  # Redis: how a separate streamrl serve finds the bus
            announce(endpoint)
        return ranks

    def join_bus(ranks: list[Any]) -> None:
        replicas = fleet.replicas
        if replicas:
            _wait_started([r.connect_bus.remote(endpoint) for r in replicas],
                           "join the weight bus", f"its publisher at {endpoint}")
            ray.get(ranks[0].wait_for_receivers.remote(len(replicas)))

    def respawn(dead: list[Any]) -> list[Any]:
        """New ranks in the dead ones' bundles; the running replicas (kept) join their bus."""
        for rank in dead:
            ray.kill(rank, no_restart=True)
        actors[:] = [a for a in actors if all(a is not rank for rank in dead)]
        ranks = start_ranks()
        join_bus(ranks)
        return ranks

    try:
        setups = [r.setup.remote() for r in fleet.replicas]
        if learners:
            learner_group = LearnerGroup(start_ranks(), skip_prepare=not cfg.prepare_adds_tensors,
                                         respawn=respawn)
        _wait_started(setups, "set up", "vLLM engine start-up")
        if learner_group is not None:
            join_bus(learner_group.actors)
    except BaseException:
        fleet.shutdown(ACTOR_SHUTDOWN_TIMEOUT_S)
        raise
    return learner_group, spawn, fleet


def _wait_started(calls: list[Any], what: str, where: str, who: str = "replica-{}") -> list[Any]:
    """Every call's result (one per replica or learner rank, in index order), or an error
    naming the first (``who`` formatted with its index) that did not ``what`` within
    ``START_TIMEOUT_S`` and ``where`` to look."""
    if not calls:
        return []
    _, pending = ray.wait(calls, num_returns=len(calls), timeout=START_TIMEOUT_S)
    if pending:
        raise RunStopped(f"{who.format(calls.index(pending[0]))} did not {what} within "
                         f"{START_TIMEOUT_S:.0f} s ({where}: see its log above)")
    return ray.get(calls)
