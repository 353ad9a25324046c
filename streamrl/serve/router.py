"""Which replica answers a call: sticky per episode, least loaded for a new one.

An episode's calls go to the replica that served its first call, so the engine's prefix cache
holds the episode's tokens; a new episode goes to the replica with the fewest calls in flight.
A replica that fails a call is skipped for new episodes for ``cooldown_s``. With
``weight_bus.update_policy=rolling`` (replicas swap k at a time), a replica that reports it is
swapping weights (``Replica.swapping``) gets no call: another takes it, and the episode stays
pinned to the first for its later calls; while every replica is swapping the call waits, at
most ``swap_wait_s``. A replica that starts a swap after it was asked gets the call anyway: its
engine holds the request until the swap is done. A cancelled call (the client went away)
cancels the replica's request, so the engine stops sampling it.

Backends: ``ActorBackend`` (a replica Ray actor of the runtime: ``sample`` and the streaming
``sample_stream``) and ``LocalBackend`` (a ``Replica`` in this process, for tests and
embedding). Depends on engine.py (SamplingParams, Completion, TokenSink).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Protocol

from streamrl.rollout_fleet.engine import Completion, SamplingParams, TokenSink

STICKY_EPISODES = 100_000
"""Episode -> replica entries kept (least recently used dropped first)."""
SWAP_POLL_S = 0.02
"""How often a call waiting for a replica to end its weight swap asks again."""


class Backend(Protocol):
    name: str

    async def sample(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     on_tokens: TokenSink | None = None) -> Completion: ...

    async def version(self) -> int: ...

    async def swapping(self) -> bool:
        """In a weight update: paused, or about to be (``Replica.swapping``)."""


class ActorBackend:
    """A replica Ray actor (``runtime.actors.ReplicaActor``) of a fleet member: calls go to the
    member's current incarnation (its supervisor re-creates it after a death)."""

    def __init__(self, member: Any) -> None:
        self.member = member
        self.name = member.name

    @property
    def actor(self) -> Any:
        return self.member.actor

    async def sample(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     on_tokens: TokenSink | None = None) -> Completion:
        if on_tokens is None:
            ref = self.actor.sample.remote(prompt_ids, params, request_id)
            try:
                return await ref
            except asyncio.CancelledError:
                _cancel(ref)
                raise
        stream = self.actor.sample_stream.options(num_returns="streaming").remote(
            prompt_ids, params, request_id)
        try:
            async for ref in stream:
                item = await ref
                if isinstance(item, Completion):
                    return item
                on_tokens(item)
        except asyncio.CancelledError:
            _cancel(stream)
            raise
        raise RuntimeError(f"{self.name}: stream for {request_id} ended without a completion")

    async def version(self) -> int:
        return int(await self.actor.version.remote())

    async def swapping(self) -> bool:
        return bool(await self.actor.swapping.remote())


def _cancel(task: Any) -> None:
    """Cancel a replica actor's task: awaiting its reference stops only the wait, and the
    engine would go on sampling for a client that went away (an async actor's task is
    cancelled like an asyncio task; the engine aborts the request)."""
    import ray

    ray.cancel(task)


class LocalBackend:
    """A ``Replica`` running on this process's event loop."""

    def __init__(self, replica: Any, name: str = "local") -> None:
        self.replica = replica
        self.name = name

    async def sample(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     on_tokens: TokenSink | None = None) -> Completion:
        return await self.replica.sample_one(prompt_ids, params, request_id, on_tokens)

    async def version(self) -> int:
        return int(self.replica.engine.version)

    async def swapping(self) -> bool:
        return bool(self.replica.swapping)


class Router:
    def __init__(self, backends: list[Backend], cooldown_s: float = 5.0,
                 rolling: bool = False, swap_wait_s: float = 60.0) -> None:
        """``rolling``: replicas swap weights in turns (``weight_bus.update_policy=rolling``),
        so each call first asks its replica whether it is swapping; under the other policies
        every replica swaps at once and that round trip would buy nothing. ``swap_wait_s``:
        how long a call waits while every replica is swapping (a swap takes about as long as
        a load: weight_bus.timeout_s bounds it)."""
        if not backends:
            raise ValueError("Router: needs at least one backend (rollout.num_replicas >= 1)")
        self.backends = backends
        self.cooldown_s = cooldown_s
        self.rolling = rolling
        self.swap_wait_s = swap_wait_s
        self.inflight = [0] * len(backends)
        self.failed_at = [-float("inf")] * len(backends)
        self.sticky: OrderedDict[str, int] = OrderedDict()

    def pick(self, episode_id: str) -> int:
        index = self.sticky.get(episode_id)
        now = time.monotonic()
        if index is None or now - self.failed_at[index] < self.cooldown_s:
            healthy = [i for i in range(len(self.backends))
                       if now - self.failed_at[i] >= self.cooldown_s] or list(
                           range(len(self.backends)))
            index = min(healthy, key=lambda i: self.inflight[i])
        self.sticky[episode_id] = index
        self.sticky.move_to_end(episode_id)
        while len(self.sticky) > STICKY_EPISODES:
            self.sticky.popitem(last=False)
        return index

    async def ready(self, episode_id: str) -> int:
        """``pick``, unless that replica is swapping weights: then the least loaded healthy one
        that is not; while all are, ask again every ``SWAP_POLL_S`` for ``swap_wait_s``."""
        index = self.pick(episode_id)
        if not self.rolling:
            return index
        deadline = time.monotonic() + self.swap_wait_s
        while (free := await self._not_swapping(index)) is None:
            if time.monotonic() >= deadline:
                names = ", ".join(b.name for b in self.backends)
                raise TimeoutError(f"router: every replica ({names}) was still swapping weights "
                                   f"after {self.swap_wait_s:g} s")
            await asyncio.sleep(SWAP_POLL_S)
        return free

    async def _not_swapping(self, first: int) -> int | None:
        """``first`` if it is not swapping, else the least loaded healthy other that is not
        (one round trip each, in that order); None if every one asked is."""
        now = time.monotonic()
        others = sorted((i for i in range(len(self.backends))
                         if i != first and now - self.failed_at[i] >= self.cooldown_s),
                        key=lambda i: self.inflight[i])
        for i in (first, *others):
            try:
                if not await self.backends[i].swapping():
                    return i
            except Exception:  # it cannot say (died?): the call goes there and reports why
                return i
        return None

    async def sample(self, episode_id: str, prompt_ids: list[int], params: SamplingParams,
                     request_id: str, on_tokens: TokenSink | None = None) -> Completion:
        index = await self.ready(episode_id)
        self.inflight[index] += 1
        try:
            return await self.backends[index].sample(prompt_ids, params, request_id, on_tokens)
        except Exception:
            self.failed_at[index] = time.monotonic()
            raise
        finally:
            self.inflight[index] -= 1

    async def version(self) -> int:
        """The newest weight version any replica serves."""
        return max([await b.version() for b in self.backends])
