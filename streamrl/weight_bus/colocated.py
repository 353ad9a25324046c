"""Co-located hybrid mode: learner and engine share a process and device; the swap is in place.

Parts:
- ``ColocatedPublisher``: ``publish(version, named_tensors)`` wakes the engine (where the backend
  can sleep) and hands the full tensors straight to ``sink`` (default ``engine.load_weights``;
  the hybrid worker passes its replica's ``update_weights`` under the mode's update policy),
  without any copy or network on the learner's side: with ``InprocVLLMEngine`` the tensors
  reach the vLLM worker's reload as they are. ``sleep()`` frees the engine's KV cache and
  weights before training (``engine.sleep``; a no-op where unsupported, e.g. vLLM on CPU).
- ``apublish`` / ``asleep``: the same from inside the engine's event loop.

The engine is async and bound to its event loop; the sync methods run on ``loop`` (the loop the
engine lives on, running in another thread) and must not be called from that loop's own thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from streamrl.weight_bus.base import NamedTensors, PublishStats, WeightPublisher, check_version

Sink = Callable[[NamedTensors, int], Awaitable[None]]


class ColocatedPublisher(WeightPublisher):
    def __init__(self, engine: Any, *, sink: Sink | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.engine = engine
        self.sink: Sink = sink or engine.load_weights
        self.loop = loop
        self._version = -1

    @property
    def version(self) -> int:
        return self._version

    async def apublish(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        check_version(version, self._version)
        start = time.monotonic()
        counted: list[int] = [0, 0]

        def count(pairs: NamedTensors) -> NamedTensors:
            for name, tensor in pairs:
                counted[0] += 1
                counted[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        await self.engine.wake_up()
        await self.sink(count(named_tensors), version)
        self._version = version
        return PublishStats(version=version, nbytes=counted[1], num_tensors=counted[0],
                            num_buckets=0, seconds=time.monotonic() - start,
                            receivers=("colocated",))

    async def asleep(self) -> None:
        """Before training: free what the engine can (KV cache, and weights where supported)."""
        await self.engine.sleep()

    def publish(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        return self._run(self.apublish(version, named_tensors))

    def sleep(self) -> None:
        self._run(self.asleep())

    def _run(self, coro: Any) -> Any:
        if self.loop is None:
            coro.close()
            raise RuntimeError("ColocatedPublisher: pass loop= (the engine's event loop, running "
                               "in another thread) to use the sync methods, or await apublish")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        return None
