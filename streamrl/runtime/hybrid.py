"""The co-located hybrid worker: one learner rank and its rollout engine in one process.

``runtime.placement=colocated weight_bus.backend=colocated`` places one ``HybridActor`` per
bundle (verl's ActorRolloutRef hybrid worker is the model). Each is a ``ReplicaActor`` (engine,
replica loop, prompts, rewards: everything the fleet calls) that also holds a learner rank
(``LearnerActor``: everything ``LearnerGroup`` calls), so the controller drives it through the
same two handles as a disaggregated run.

- The engine is an ``InprocVLLMEngine``: vLLM's core and worker live in this process, and it is
  built after the learner joined torch.distributed, inside that world.
- Learner work runs on one thread of its own, the engine on its own thread, the replica loop on
  the actor's event loop: in the asynchronous modes the engine generates while the learner
  trains (the two time-share the bundle's cores); in ``sync`` they take turns, and each phase
  gets every core of the bundle.
- ``publish(version)``: every rank gathers the full parameters one at a time and hands them to
  its own engine through a ``ColocatedPublisher`` whose sink is the replica's update policy
  (drain / pause / abort): no socket, no collective beyond the FSDP gather, and on GPU no
  second full copy.
- In ``sync`` the engine sleeps before training (vLLM sleep mode frees KV cache and weights on
  GPUs) and, with ``learner.offload``, the learner's state leaves the device while the engine
  generates; both are no-ops on CPU.
- A hybrid worker that dies takes a learner rank with it, so it is not re-created: the run
  stops naming it, and ``trainer.resume=auto`` continues from the last checkpoint.

Depends on actors (the two roles it merges), rollout_fleet (the in-process engine), weight_bus.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup

from streamrl.buffer.base import BufferProducer
from streamrl.config import Config, replace
from streamrl.runtime.actors import LearnerActor, ReplicaActor
from streamrl.runtime.placement import gpus_per, in_bundle, pin_to_core, pins_cpus
from streamrl.runtime.supervisor import holder_name


def bundle_cores(cfg: Config) -> int:
    """The whole cores of one hybrid worker's bundle (at least one)."""
    return max(1, round(cfg.runtime.cpus_per_learner + cfg.runtime.cpus_per_replica))


def threads_per_role(cfg: Config) -> tuple[int, int]:
    """(learner, engine) torch threads: the whole bundle for each in ``sync``, where they take
    turns; their own shares otherwise, where they run at the same time."""
    rt = cfg.runtime
    if cfg.is_sync:
        return bundle_cores(cfg), bundle_cores(cfg)
    return max(1, round(rt.cpus_per_learner)), max(1, round(rt.cpus_per_replica))


class HybridActor(ReplicaActor):
    """A learner rank and its engine (module docstring). Learner calls are awaited on the
    learner thread, so the replica loop and heartbeats go on while the rank trains."""

    def __init__(self, cfg: Config, rank: int, buffer: BufferProducer, holder: str | None = None,
                 reward_servers: dict[str, Any] | None = None) -> None:
        self.pinned = pins_cpus(cfg)
        # This actor pins itself to its bundle's cores; its two parts must not pin one each.
        cfg = replace(cfg, **{"runtime.pin_cpus": False})
        super().__init__(cfg, rank, buffer, None, holder, reward_servers)
        self.rank = rank
        self.learner = LearnerActor(cfg, rank, cfg.learner.world_size)
        learner_threads, self.engine_threads = threads_per_role(cfg)
        self.sync = cfg.is_sync
        self._learner_thread = ThreadPoolExecutor(
            1, thread_name_prefix="learner", initializer=torch.set_num_threads,
            initargs=(learner_threads,))
        self.publisher: Any = None

    async def _on_learner(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._learner_thread, fn, *args)

    # -- set-up: the learner first, then the engine inside its torch.distributed world --------

    async def rendezvous(self) -> tuple[str, int]:
        return self.learner.rendezvous()

    async def join_learners(self, master_addr: str, master_port: int) -> None:
        if self.pinned:
            pin_to_core(self.rank, bundle_cores(self.cfg))
        await self._on_learner(self.learner.start, master_addr, master_port)

    def _make_engine(self) -> Any:
        from streamrl.rollout_fleet.vllm_inproc_engine import InprocVLLMEngine

        return InprocVLLMEngine(self.model_path, self.cfg.rollout,
                                tokenizer_path=self.cfg.model.tokenizer_path,
                                threads=self.engine_threads)

    async def setup(self) -> None:
        from streamrl.weight_bus import make_publisher

        await super().setup()
        policy = self.cfg.weight_bus.update_policy

        async def sink(weights: Any, version: int) -> None:
            await self.replica.update_weights(weights, version, policy)

        self.publisher = make_publisher(self.cfg.weight_bus, engine=self.engine, sink=sink)
        if self._offloads:  # the engine generates first
            await self._on_learner(self.learner.worker.offload)

    @property
    def _offloads(self) -> bool:
        return self.sync and self.cfg.learner.offload

    # -- what LearnerGroup calls --------------------------------------------------------------

    async def behind(self, version: int) -> list[str]:
        """No replica is ever behind: each worker's engine takes every version in place."""
        return []

    async def get_version(self) -> int:
        return self.learner.get_version()

    async def prepare(self, batch: Any) -> Any:
        if self.sync:  # the engine waits for the next weights: give the device to the learner
            await self.publisher.asleep()
            if self._offloads:
                await self._on_learner(self.learner.worker.reload)
        return await self._on_learner(self.learner.prepare, batch)

    async def update(self, batch: Any) -> dict[str, float]:
        return dict(await self._on_learner(self.learner.update, batch))

    async def publish(self, version: int) -> dict[str, float]:
        """Every rank gathers the full weights (one tensor at a time, on the engine's thread as
        it loads them) into its own engine, under the mode's update policy."""
        dtype = getattr(torch, self.cfg.rollout.dtype)
        weights = self.learner.worker.named_full_parameters(dtype, every_rank=True)
        timeout = self.cfg.buffer.take_timeout_s  # a drain waits for the groups in flight
        try:
            stats = await asyncio.wait_for(self.publisher.apublish(version, weights), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"hybrid worker {self.rank}: its engine did not take weight version {version} "
                f"within buffer.take_timeout_s={timeout:g} s ({self.replica.stalled_s():.0f} s "
                "since an in-flight request last finished)") from None
        if self._offloads:  # the engine generates next: give it the device
            await self._on_learner(self.learner.worker.offload)
        return {"weight_bus/seconds": stats.seconds, "weight_bus/bytes": float(stats.nbytes),
                "weight_bus/receivers_died": 0.0}

    async def save_checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        return str(await self._on_learner(self.learner.save_checkpoint, step, extra))

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        return dict(await self._on_learner(self.learner.load_checkpoint, path))

    async def export_hf(self, path: str) -> str | None:
        return await self._on_learner(self.learner.export_hf, path)  # type: ignore[no-any-return]

    async def bound_addresses(self) -> dict[str, str]:
        return self.learner.bound_addresses()

    async def shutdown(self) -> None:
        await super().shutdown()  # the engine leaves the learner's world before it ends
        if self.learner.worker is not None:
            await self._on_learner(self.learner.shutdown)
        self._learner_thread.shutdown(wait=False)


def start_hybrid_workers(cfg: Config, pg: PlacementGroup, buffer: BufferProducer,
                         reward_servers: dict[str, Any]) -> list[Any]:
    """One ``HybridActor`` per learner rank, each in its bundle: learner ranks rendezvous and
    join first, then every rank builds its engine at the same time (vLLM's process groups are
    created collectively in the learner's world). None is left running if one fails."""
    world = cfg.learner.world_size
    cpus = cfg.runtime.cpus_per_learner + cfg.runtime.cpus_per_replica
    workers = [
        ray.remote(num_cpus=cpus, num_gpus=gpus_per(cfg, "learner"))(HybridActor).options(
            scheduling_strategy=in_bundle(pg, rank), max_concurrency=1024,
        ).remote(cfg, rank, buffer, holder_name(rank, 0), reward_servers)
        for rank in range(world)
    ]
    try:
        master_addr, master_port = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join_learners.remote(master_addr, master_port) for w in workers])
        ray.get([w.setup.remote() for w in workers])
    except BaseException:
        for worker in workers:
            ray.kill(worker)
        raise
    return workers
