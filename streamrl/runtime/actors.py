"""The two process roles the runtime places as Ray actors.

- ``LearnerActor``: one FSDP2 rank (``learner.worker.LearnerWorker``); rank 0 also owns the
  weight publisher, so ``publish(version)`` is every rank gathering full parameters in lockstep
  and rank 0 putting them on the bus.
- ``ReplicaActor``: one rollout replica (engine + continuous ``Replica`` loop + prompt stream +
  reward scorer) and its weight receiver, whose sink applies the mode's update policy.

Both are plain classes: ``runtime.build_runtime`` wraps them with ``ray.remote``; tests may
use them in-process. Depends on learner, rollout_fleet, weight_bus, data and the buffer protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from streamrl.buffer.base import BufferProducer, HeldBuffer
from streamrl.config import Config
from streamrl.net import free_port, interface_of, node_host
from streamrl.runtime.placement import (
    engine_in_process,
    freeze_startup_heap,
    pin_role,
    pins_cpus,
    threads_per,
)
from streamrl.runtime.supervisor import holder_name
from streamrl.types import fits_float32

log = logging.getLogger(__name__)


class LearnerActor:
    """Started in two calls so every rendezvous binds on the node that hosts it: rank 0's
    ``rendezvous()`` picks the FSDP group's address and port on its own node, then ``start``
    on every rank joins the group (and builds rank 0's weight publisher there too)."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.host = node_host(cfg.runtime.address)  # here: the node Ray placed this rank on
        self.bound: dict[str, str] = {}
        """What this rank's rendezvous bind on, by component (``bound_addresses``)."""
        self.worker: Any = None
        self.publisher: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) of the FSDP group's store, free on this node (rank 0)."""
        port = free_port(self.host)
        self.bound["learner.rendezvous"] = self.host
        return self.host, port

    def start(self, master_addr: str, master_port: int) -> None:
        """Join the FSDP group on this rank's cores: ``threads_per(cfg, "learner")`` torch
        threads, pinned to as many cores of its own (``runtime.pin_cpus``). A hybrid worker
        (``weight_bus.backend=colocated``) calls this on its learner thread, whose threads and
        cores it sets itself."""
        import torch

        from streamrl.learner.worker import LearnerWorker
        from streamrl.weight_bus import make_publisher

        if pins_cpus(self.cfg):
            pin_role(self.cfg, "learner", self.rank)
        if self.cfg.weight_bus.backend != "colocated":
            torch.set_num_threads(threads_per(self.cfg, "learner"))
        if self.cfg.runtime.address is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo binds where the hostname resolves (often loopback): use the node's interface.
            interface = interface_of(self.host)
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
                self.bound["learner.gloo"] = self.host
        self.worker = LearnerWorker(self.cfg, self.rank, self.world_size, master_addr,
                                    master_port)
        if self.rank == 0 and self.cfg.weight_bus.backend == "collective":
            bus = self.cfg.weight_bus
            self.publisher = make_publisher(
                dataclasses.replace(bus, master_addr=bus.master_addr or self.host))
            self.bound["weight_bus.control"] = str(self.publisher.control.address)
            self.bound["weight_bus.store"] = str(self.publisher.host)

    def bound_addresses(self) -> dict[str, str]:
        """This rank's Ray node IP (``node``) and where each of its rendezvous bound."""
        import ray

        return {"node": str(ray.util.get_node_ip_address()), **self.bound}

    def bus_endpoint(self) -> str:
        assert self.publisher is not None, "only rank 0 publishes"
        return str(self.publisher.endpoint)

    def get_version(self) -> int:
        return int(self.worker.version)

    def prepare(self, batch: Any) -> Any:
        return self.worker.prepare(batch)

    def update(self, batch: Any) -> dict[str, float]:
        return self.worker.update(batch)

    def wait_for_receivers(self, count: int) -> None:
        assert self.publisher is not None, "only rank 0 publishes"
        self.publisher.wait_for_receivers(count)

    def publish(self, version: int) -> dict[str, float]:
        """Send ``version`` and return once every replica has received it; they load it while
        the learner goes on. A replica starts no group while a version it received is not
        loaded (``ReplicaActor``), so admission may open for ``version`` now. The previous
        version's loads are awaited first: a failed or stuck load stops the run here."""
        import torch

        dtype = getattr(torch, self.cfg.rollout.dtype)
        params = self.worker.named_full_parameters(dtype)
        if self.publisher is None:
            for _ in params:  # the other ranks take part in each gather
                pass
            return {}
        from streamrl.weight_bus.base import ReceiverDied

        start = time.perf_counter()
        if self.publisher.version >= 0:
            # A drain waits for in-flight groups to finish, which may take a whole generation.
            self.publisher.wait_loaded(self.publisher.version,
                                       timeout=self.cfg.buffer.take_timeout_s)
        loads_s = time.perf_counter() - start
        try:
            nbytes, died = self.publisher.publish(version, params).nbytes, 0
        except ReceiverDied as exc:
            # A replica died mid-broadcast: its supervisor re-creates it; the new incarnation
            # and the survivors are behind this version until a catch-up or the next publish.
            log.warning("%s", exc)
            nbytes, died = 0, len(exc.dead)
        seconds = time.perf_counter() - start
        return {"weight_bus/seconds": seconds, "weight_bus/bytes": float(nbytes),
                "weight_bus/receivers_died": float(died),
                "weight_bus/previous_load_wait_s": loads_s}

    def behind(self, version: int) -> list[str]:
        """The replicas a ``catch_up(version)`` would serve: asked of rank 0 alone, which holds
        the publisher (none once the learner's weights have moved on from ``version``)."""
        if self.publisher is None or self.publisher.version != version:
            return []
        return self.publisher.behind()

    def catch_up(self, version: int) -> None:
        """Every rank gathers the weights again; rank 0 re-sends ``version`` to the replicas
        behind it. A failure is logged: the next catch-up or publish tries again."""
        import torch

        from streamrl.weight_bus.base import WeightBusError

        params = self.worker.named_full_parameters(getattr(torch, self.cfg.rollout.dtype))
        if self.publisher is None:
            for _ in params:  # the other ranks take part in each gather
                pass
            return
        try:
            stats = self.publisher.catch_up(version, params)
            log.info("weight bus: version %d re-sent to %s, behind it", version, stats.receivers)
        except WeightBusError as exc:
            log.warning("weight bus: catch-up of version %d failed: %s", version, exc)

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        return self.worker.save_checkpoint(step, extra)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.worker.load_checkpoint(path)

    def export_hf(self, path: str) -> str | None:
        return self.worker.export_hf(path)

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.worker.shutdown()


SWAP_TOKENS_ACTOR = "streamrl-swap-tokens"
"""The named actor holding the fleet's ``SwapTokens``: Ray scopes names to the driver's
namespace, so every run has its own."""


def start_swap_tokens(k: int, timeout_s: float) -> Any:
    """The fleet's ``SwapTokens`` (``weight_bus.update_policy=rolling``) in a named actor,
    made by the driver before any replica. Why the driver: an actor lives as long as its
    maker, and one a replica made died with it, taking the tokens held there along (the next
    swap could overlap one still running). Owned by the driver, a token held by a replica that
    dies stays held until its re-created incarnation takes it over (``SwapTokens``)."""
    import ray

    from streamrl.rollout_fleet.replica import SwapTokens

    return ray.remote(SwapTokens).options(name=SWAP_TOKENS_ACTOR, num_cpus=0).remote(
        k, timeout_s)


class RaySwapTokens:
    """A replica actor's way to the fleet's ``SwapTokens``: the named actor the driver made
    (``start_swap_tokens``), found by name. In-process replicas share a ``SwapTokens`` object
    instead."""

    def __init__(self) -> None:
        import ray

        try:
            self._handle = ray.get_actor(SWAP_TOKENS_ACTOR)
        except ValueError:
            raise RuntimeError(
                f"weight_bus.update_policy=rolling: no swap tokens actor {SWAP_TOKENS_ACTOR!r} "
                "in this run (the driver makes it: runtime.actors.start_swap_tokens)") from None

    async def take(self, holder: str) -> str | None:
        return await self._handle.take.remote(holder)  # type: ignore[no-any-return]

    async def give_back(self, holder: str) -> None:
        await self._handle.give_back.remote(holder)


class ReplicaActor:
    """An async actor: the replica loop and the weight receiver share its event loop."""

    def __init__(self, cfg: Config, index: int, buffer: BufferProducer | None,
                 bus_endpoint: str | None, holder: str | None = None,
                 reward_servers: dict[str, Any] | None = None) -> None:
        """``buffer``: None for a replica that only answers requests (``streamrl serve``).
        ``holder``: the name this incarnation's admissions are counted under, so its
        supervisor can give them back if it dies (``runtime.supervisor``).
        ``reward_servers``: the run's reward-model / judge actors (``start_reward_servers``)."""
        self.cfg = cfg
        self.model_path = cfg.model.path
        self.index = index
        self.buffer = (HeldBuffer(buffer, holder or holder_name(index, 0))
                       if buffer is not None else None)
        self.bus_endpoint = bus_endpoint
        self.reward_servers = reward_servers or {}
        self.replica: Any = None
        self.receiver: Any = None

    async def setup(self) -> None:
        """Build engine, replica and receiver on the actor's event loop."""
        from transformers import AutoTokenizer

        from streamrl.data import make_prompt_source
        from streamrl.rollout_fleet.replica import Replica
        from streamrl.rollout_fleet.rewards import make_reward_scorer

        cfg = self.cfg
        cores = os.sched_getaffinity(0)
        if pins_cpus(cfg):
            pin_role(cfg, "replica", self.index)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or self.model_path)
        self.engine = self._make_engine()  # its engine thread or process keeps this core
        if pins_cpus(cfg) and cfg.is_sync:
            # Sync: the learner's cores idle while the replica samples, so its client side
            # (request streams, detokenising, rewards) runs there too: ~15% shorter rollouts.
            # Where rollout and learning overlap, it stays off the learner's core, whose
            # update bounds the step.
            os.sched_setaffinity(0, cores)
        self.source = make_prompt_source(cfg.task, self.tokenizer, "train")
        self.val_source = make_prompt_source(cfg.task, self.tokenizer, "val")
        sources = {p.data_source for prompts in (self.source, self.val_source) for p in prompts}
        self.scorer = make_reward_scorer(cfg.reward, self.reward_servers, tuple(sorted(sources)))
        self.prompts = self._prompt_stream(cursor=0)
        self.replica = Replica(self.engine, self.buffer, self.prompts, self.scorer, self.tokenizer,
                               cfg.rollout, name=f"replica-{self.index}",
                               trace=cfg.trainer.trace, weights_pending=self._weights_pending,
                               partials=self._partial_store(),
                               partial_flush_s=(cfg.rollout.partial_flush_s
                                                if cfg.buffer.backend == "redis" else 0.0),
                               swap_tokens=(RaySwapTokens()
                                            if cfg.weight_bus.update_policy == "rolling"
                                            else None))
        if self.bus_endpoint is not None:
            await self.connect_bus(self.bus_endpoint)
        freeze_startup_heap()

    def _weights_pending(self) -> bool:
        """A version received (the learner may already admit groups for it) but not loaded.
        Not ``pending > engine.version``: after a resume the version may go back (12 -> 10)."""
        if self.receiver is None:
            return False
        pending = self.receiver.pending_version
        return pending >= 0 and pending != self.engine.version

    def _make_engine(self) -> Any:
        from streamrl.rollout_fleet import make_engine

        # The tokenizer directory, not the loaded tokenizer: vLLM loads its own from it.
        lora = self.cfg.actor.lora  # adapter-only publishes need an engine serving adapters
        adapters = lora.publishes_adapter(self.cfg.rollout.backend, self.cfg.weight_bus.backend)
        return make_engine(self.cfg.rollout, self.model_path, self.cfg.model.tokenizer_path,
                           in_process=engine_in_process(self.cfg),
                           lora=lora if adapters else None,
                           threads=threads_per(self.cfg, "replica"))

    async def connect_bus(self, endpoint: str) -> None:
        """Receive weights from the publisher at ``endpoint``, leaving any earlier one (a
        ``streamrl serve`` replica follows a restarted trainer's new endpoint)."""
        from streamrl.weight_bus import make_receiver

        if self.receiver is not None:
            await self.receiver.aclose()
        policy = self.cfg.weight_bus.update_policy

        async def sink(weights: Any, version: int) -> None:
            await self.replica.update_weights(weights, version, policy)

        self.bus_endpoint = endpoint
        self.receiver = make_receiver(
            self.cfg.weight_bus, endpoint=endpoint, sink=sink, engine=self.engine,
            # Unique per process: a restarted replica must not pass for the one that died.
            receiver_id=f"replica-{self.index}-{uuid.uuid4().hex[:8]}",
            loop=asyncio.get_running_loop(),
        )

    async def sample(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        """One sample for ``streamrl serve`` through the replica's request machinery."""
        return await self.replica.sample_one(prompt_ids, params, request_id)

    async def sample_stream(self, prompt_ids: list[int], params: Any, request_id: str
                            ) -> AsyncIterator[Any]:
        """``sample`` as a Ray streaming generator: lists of new token ids as they arrive,
        then the finished Completion (exact versions)."""
        from streamrl.rollout_fleet.engine import arriving

        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(
            self.replica.sample_one(prompt_ids, params, request_id, queue.put_nowait))
        try:
            async for ids in arriving(task, queue):
                yield ids
            yield task.result()
        finally:
            task.cancel()  # the client went away: vLLM aborts a cancelled request

    async def swapping(self) -> bool:
        """In a weight update (``Replica.swapping``): the router prefers another replica."""
        return self.replica is not None and bool(self.replica.swapping)

    async def version(self) -> int:
        return int(self.engine.version)

    async def health(self) -> dict[str, Any]:
        """The supervisor's heartbeat: is the engine alive, how long have requests in flight
        gone without one finishing, and the prompt cursor a replacement resumes from."""
        return {"engine_ok": await self.engine.health(), "stalled_s": self.replica.stalled_s(),
                "state": await self.state()}

    async def start(self) -> None:
        self.replica.start()

    async def stop(self) -> None:
        """Stop the loop, saving its groups in flight (SIGTERM unwinds through here)."""
        if self.replica is not None and self.replica.running:
            await self.replica.stop(cancel=True, timeout=60, save=self.buffer is not None)

    async def metrics(self) -> dict[str, float]:
        out = self.replica.metrics()
        # The reward pool scores its failures 0 itself; its counts complete the replica's.
        pool = getattr(self.scorer, "metrics", dict)()
        out["reward_failures"] += pool.get("failures", 0.0)
        out["reward_timeouts"] = pool.get("timeouts", 0.0)
        return out

    async def trace_spans(self) -> list[tuple[str, float, float]]:
        return self.replica.drain_spans()

    async def validate(self) -> dict[str, float]:
        """Greedy answers (or greedy agent episodes) to every validation prompt, scored: mean
        reward and length."""
        from streamrl.rollout_fleet.replica import greedy_params
        from streamrl.rollout_fleet.rewards.prompt import PROMPT_KEY, reward_prompt

        if self.replica.agent is not None:
            from streamrl.rollout_fleet.agent import validate_episodes

            return await validate_episodes(self.replica.agent, self.engine, self.val_source,
                                           greedy_params(self.cfg.rollout))

        params = greedy_params(self.cfg.rollout)
        start = time.perf_counter()

        async def one(i: int) -> tuple[float, int]:
            prompt = self.val_source[i]
            [completion] = await self.engine.generate(prompt.prompt_ids, params, f"val-{i}")
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            extra = {"max_new_tokens": params.max_tokens, **prompt.extra,
                     PROMPT_KEY: reward_prompt(prompt, self.tokenizer)}
            reward = await self.scorer.score(prompt.data_source, text, prompt.ground_truth, extra)
            if not fits_float32(reward):  # the scorers pass it on; training drops such a group
                log.warning("validation prompt %d: the reward function for data_source %r "
                            "returned %r, not finite in float32; scored 0", prompt.index,
                            prompt.data_source, reward)
                reward = 0.0
            return reward, len(completion.token_ids)

        results = await asyncio.gather(*(one(i) for i in range(len(self.val_source))))
        if not results:
            return {}
        rewards = [r for r, _ in results]
        return {
            "reward/mean": sum(rewards) / len(rewards),
            "response_length/mean": sum(n for _, n in results) / len(results),
            "seconds": time.perf_counter() - start,
        }

    async def state(self, partials: bool = False) -> dict[str, Any]:
        """The prompt cursor; with ``partials`` (a checkpoint) also the groups in flight with
        their tokens so far, read at the same instant as the cursor."""
        if not partials or self.buffer is None:  # serve replicas sample no groups of their own
            return {"cursor": int(self.prompts.cursor)}
        import msgspec

        snapshot = await self.replica.snapshot()
        try:
            return {"cursor": snapshot.cursor, "partials": msgspec.to_builtins(snapshot)}
        except TypeError as exc:  # a prompt's extra_info holds a type msgspec cannot encode
            log.warning("%s: groups in flight left out of the checkpoint (a resume skips "
                        "their prompts): %s", self.replica.name, exc)
            return {"cursor": int(self.prompts.cursor)}

    async def load_state(self, state: dict[str, Any]) -> None:
        """Resume the cursor and the partial groups of ``state`` (a checkpoint's or a heartbeat's)
        or, when newer, of the partial store (saved at a stop or flush after the checkpoint)."""
        import msgspec

        from streamrl.rollout_fleet.partials import PartialSnapshot

        saved = [msgspec.convert(state["partials"], PartialSnapshot)] if "partials" in state else []
        store = self.replica.partials
        # The store is read on a trainer resume (a checkpoint's state), and on a re-creation by
        # the supervisor only where the dead incarnation flushed into it (Redis): a file left by
        # an earlier run's stop must not pass for this run's.
        stored = (store.take(self.replica.name)
                  if store is not None and (saved or self.replica.partial_flush_s > 0) else None)
        snapshot = max([*saved, *([stored] if stored else [])], key=lambda s: s.saved_ts,
                       default=None)
        cursor = snapshot.cursor if snapshot is not None else int(state.get("cursor", 0))
        self.prompts = self._prompt_stream(cursor=cursor)
        self.replica.prompts = self.prompts
        if snapshot is not None:
            groups = snapshot.groups if store is None else store.pending(snapshot.groups)
            self.replica.resume(groups, self.cfg.buffer.max_staleness)
            log.info("%s: resuming %d partial groups (%d tokens) saved at cursor %d",
                     self.replica.name, len(groups), sum(g.num_tokens for g in groups), cursor)

    def _partial_store(self) -> Any:
        """Where this replica saves its groups in flight: a hash in the run's Redis, or files
        beside the run's checkpoints (the memory buffer; a checkpoint carries them too)."""
        from streamrl.rollout_fleet.partials import FilePartialStore, RedisPartialStore

        if self.buffer is None:  # streamrl serve: its episodes are not partial rollouts
            return None
        if self.cfg.buffer.backend == "redis":
            from streamrl.buffer.redis.connection import connect
            from streamrl.buffer.redis.wire import RunKeys

            redis = self.cfg.buffer
            return RedisPartialStore(connect(redis.redis_url, redis.redis_outage_s), redis.run,
                                     put_ids=RunKeys.of(redis.run).ids)
        return FilePartialStore(os.path.join(self.cfg.trainer.output_dir, "partials"))

    def _prompt_stream(self, cursor: int) -> Any:
        from streamrl.data import PromptStream

        # Each replica walks its own shuffled order, so replicas don't sample the same prompt.
        return PromptStream(self.source, self.cfg.task.shuffle,
                            self.cfg.task.seed + 7919 * self.index, cursor=cursor)

    async def shutdown(self) -> None:
        await self.stop()
        if self.receiver is not None:
            await self.receiver.aclose()
        self.scorer.close()
        await self.engine.close()
