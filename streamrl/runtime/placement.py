"""Ray placement: start or join the cluster and reserve the resource pools.

- ``WORKER_ENV``: the environment every worker process needs for CPU engines (DESIGN.md §11),
- ``init_ray(cfg)``: start a local Ray (or join ``runtime.address``) with token auth on,
- ``reserve_pools(cfg)``: placement groups — ``colocated``: learner rank i and replica i share
  bundle i; ``disaggregated``: a train pool and a rollout pool; each pool laid over the nodes
  by its ``runtime.<pool>`` strategy (PACK / SPREAD ...) and node labels,
- ``check_fits(cfg)``: before Ray starts, that the pools fit the local cluster's CPUs,
- ``in_bundle(pg, i)``: the scheduling strategy that puts an actor in bundle i,
- ``threads_per(cfg, role)``: the torch threads of a learner rank or a replica (its CPUs),
- ``pins_cpus(cfg)``, ``pin_role(cfg, role, index)``, ``pin_to_core(slot, width)``: core
  pinning (``runtime.pin_cpus``),
- ``engine_in_process(cfg)``: whether a replica steps vLLM on a thread of its own process
  (``rollout.engine_in_process``),
- ``freeze_startup_heap()``: keep what a long-lived process built at start-up out of GC passes.

Depends on config only.
"""

from __future__ import annotations

import gc
import os
import signal
import threading

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from streamrl.config import Config, PoolConfig
from streamrl.errors import ConfigError
from streamrl.logs import worker_env

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Workers load models from directories (``streamrl.models`` resolves hub ids to their cached
snapshots in the driver), so the hub mode is the driver's own: ``PASSED_ENV`` travels as set."""
PASSED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "STREAMRL_TINY_MODEL",
              "STREAMRL_SMOLLM2")


def worker_env_vars(cfg: Config) -> dict[str, str]:
    """The environment of every Ray worker of the run."""
    passed = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    return {**WORKER_ENV, **passed, **worker_env(cfg.trainer.log_level)}
POOL_READY_TIMEOUT_S = 120
LOCAL_RAY_SYSTEM_CONFIG = {
    # Ray prestarts one idle worker per CPU for tasks; the run places actors only, each in a
    # process of its own, so those workers only took CPU from the start-up's imports.
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
    # Ray starts at most num_cpus workers at once (2 on a small machine): the learner rank's
    # process waited for the buffer's and the replica's to come up. The run starts its few
    # actors together.
    "worker_maximum_startup_concurrency": 16,
}


def init_ray(cfg: Config) -> bool:
    """Start a local Ray (or join ``runtime.address``); returns whether this call started it."""
    if ray.is_initialized():
        return False
    on_sigterm = signal.getsignal(signal.SIGTERM)
    own = cfg.runtime.address is None
    ray.init(
        # Unset: a cluster of the run's own. Ray's default (None) would join any cluster that
        # `ray start` or another test left on this machine, whose addresses are not loopback.
        address=cfg.runtime.address or "local",
        num_cpus=cfg.runtime.num_cpus if own else None,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": worker_env_vars(cfg)},
        # Only a cluster of the run's own takes raylet settings (one joined has its own).
        _system_config=LOCAL_RAY_SYSTEM_CONFIG if own else None,
    )
    # Ray's core worker replaces the driver's SIGTERM handler with one that aborts the process
    # (no clean-up, orphans left): keep the caller's (the CLI unwinds and stops every actor).
    if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    return True


def check_fits(cfg: Config, *, learners: bool = True) -> None:
    """Fail at once when the pools ``reserve_pools`` would ask for exceed the CPUs of the
    cluster ``init_ray`` starts or reuses (a cluster to join is sized only once joined)."""
    rt = cfg.runtime
    if ray.is_initialized():
        have = ray.cluster_resources().get("CPU", 0.0)
    elif rt.address is None:
        # Ray's own count (cgroup limits included): what ray.init would use.
        have = rt.num_cpus if rt.num_cpus is not None else ray._private.utils.get_num_cpus()
    else:
        return
    world = cfg.learner.world_size if learners else 0
    replicas = cfg.rollout.num_replicas
    learner_cpus, replica_cpus = (f"runtime.cpus_per_learner={rt.cpus_per_learner:g}",
                                  f"runtime.cpus_per_replica={rt.cpus_per_replica:g}")
    if rt.placement == "colocated" and world and replicas:
        needed = max(world, replicas) * (rt.cpus_per_learner + rt.cpus_per_replica)
        how = (f"max(learner.world_size={world}, rollout.num_replicas={replicas}) x "
               f"({learner_cpus} + {replica_cpus})")
    else:
        needed = world * rt.cpus_per_learner + replicas * rt.cpus_per_replica
        how = (f"{world} learner rank(s) x {learner_cpus} + rollout.num_replicas={replicas} x "
               f"{replica_cpus}")
    if round(needed, 4) > have:  # Ray counts CPUs in 1e-4 units: 3 x 0.1 fits 0.3
        raise ConfigError(
            f"the pools need {needed:g} CPUs, the Ray cluster has {have:g} (runtime."
            f"num_cpus={'null' if rt.num_cpus is None else rt.num_cpus}): {how}: lower "
            "runtime.cpus_per_replica / runtime.cpus_per_learner (fractions such as 0.5 share a "
            "core), or raise runtime.num_cpus")


def reserve_pools(cfg: Config, *, learners: bool = True
                  ) -> tuple[PlacementGroup | None, PlacementGroup | None]:
    """(train pool, rollout pool); the same group twice when colocated, None for a pool with
    nothing to place (no learners in a serve-only process, no replicas in a trainer fed by
    ``streamrl serve``)."""
    rt = cfg.runtime
    world = cfg.learner.world_size if learners else 0
    replicas = cfg.rollout.num_replicas
    if rt.placement == "colocated" and world and replicas:
        # A hybrid worker's learner rank and engine share its device.
        pg = _pool("train_pool", rt.train_pool, max(world, replicas),
                   rt.cpus_per_learner + rt.cpus_per_replica, gpus_per(cfg, "learner"))
        return pg, pg
    train = (_pool("train_pool", rt.train_pool, world, rt.cpus_per_learner,
                   gpus_per(cfg, "learner")) if world else None)
    rollout = (_pool("rollout_pool", rt.rollout_pool, replicas, rt.cpus_per_replica,
                     gpus_per(cfg, "replica")) if replicas else None)
    return train, rollout


def gpus_per(cfg: Config, role: str) -> float:
    """GPUs one ``role`` ("learner" rank or "replica") reserves in its bundle, and asks for as
    an actor (so Ray hands each its own device): ``runtime.gpus_per_<role>``, or 1 where the
    Ray cluster has GPUs, else 0."""
    chosen = getattr(cfg.runtime, f"gpus_per_{role}")
    if chosen is not None:
        return float(chosen)
    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def _pool(name: str, pool: PoolConfig, bundles: int, cpus: float, gpus: float = 0.0
          ) -> PlacementGroup:
    """``bundles`` bundles of ``cpus`` (and ``gpus``) laid out by ``pool``; an error naming the
    pool when the cluster has no room for it (wrong labels, too few nodes for STRICT_SPREAD,
    too few GPUs)."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle] * bundles, strategy=pool.strategy,
                         bundle_label_selector=[dict(pool.labels)] * bundles
                         if pool.labels else None)
    try:
        ray.get(pg.ready(), timeout=POOL_READY_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"runtime.{name}: {bundles} bundle(s) of {cpus:g} CPU and {gpus:g} GPU (runtime."
            f"gpus_per_*), strategy={pool.strategy}, "
            f"labels={dict(pool.labels)} found no room in the Ray cluster within "
            f"{POOL_READY_TIMEOUT_S} s (nodes: {_nodes()})") from None
    return pg


def _nodes() -> str:
    """The live nodes, their CPUs and user labels (Ray's own ``ray.io/`` labels left out)."""
    out = []
    for node in ray.nodes():
        if node["Alive"]:
            labels = {k: v for k, v in node.get("Labels", {}).items()
                      if not k.startswith("ray.io/")}
            res = node["Resources"]
            out.append(f"{node['NodeManagerAddress']} {res.get('CPU', 0):g} CPU "
                       f"{res.get('GPU', 0):g} GPU labels={labels}")
    return "; ".join(out)


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def pins_cpus(cfg: Config) -> bool:
    """``runtime.pin_cpus``; unset: only on machines without CUDA (CPU engines)."""
    if cfg.runtime.pin_cpus is not None:
        return cfg.runtime.pin_cpus
    import torch

    return not torch.cuda.is_available()


def engine_in_process(cfg: Config) -> bool:
    """``rollout.engine_in_process``; unset: on machines without CUDA where rollout overlaps
    learning (eta >= 1), so the replica's one core samples instead of serialising between two
    processes."""
    if cfg.rollout.engine_in_process is not None:
        return cfg.rollout.engine_in_process
    import torch

    return cfg.rollout.backend == "vllm" and not cfg.is_sync and not torch.cuda.is_available()


def threads_per(cfg: Config, role: str) -> int:
    """Torch (OpenMP) threads of one ``role`` ("learner" rank or "replica"): the whole CPUs
    its bundle reserves, ``runtime.cpus_per_<role>`` rounded, at least 1 (fractions share a
    core). Set explicitly: a worker's environment says ``OMP_NUM_THREADS=1`` (``WORKER_ENV``)."""
    return max(1, round(getattr(cfg.runtime, f"cpus_per_{role}")))


def pin_role(cfg: Config, role: str, index: int) -> None:
    """Bind learner rank ``index`` (``role`` "learner") or replica ``index`` ("replica") to
    ``threads_per(cfg, role)`` cores of its own: the learner ranks' runs of cores first, then
    the replicas' (modulo the cores this process may use). One thread each: rank r on core r,
    replica i on core world_size + i."""
    width = threads_per(cfg, role)
    if role == "learner":
        first = index * width
    else:
        first = cfg.learner.world_size * threads_per(cfg, "learner") + index * width
    _pin(first, width)


def pin_to_core(slot: int, width: int = 1) -> None:
    """Bind this process (and the engine processes it starts later) to ``width`` cores: the
    ``slot``-th run of them (modulo the cores it may use)."""
    _pin(slot * width, width)


def _pin(first: int, width: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[(first + i) % len(cores)] for i in range(width)})


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, tokenizer, engine) out of the garbage collector's
    reach. They live as long as the process, and a full collection that walks them pauses a
    serving process for hundreds of milliseconds (vLLM's server freezes its heap likewise)."""
    gc.collect()
    gc.freeze()
