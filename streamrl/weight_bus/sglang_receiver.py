"""SGLang receiver (GPU only): relay each received version into an SGLang server.

SGLang receives weights itself, in its scheduler process, through ``/init_weights_update_group``
(it joins a process group as ranks ``rank_offset..``) and ``/update_weights_from_distributed``
(names, dtypes and shapes announced up front, then one broadcast per tensor). Our bus announces
bucket layouts in-band, so this receiver is a relay in the replica process:

- ``SGLangReceiver`` = ``CollectiveReceiver`` (NCCL backend: buckets land on this process's GPU)
  whose sink hands ``RelayedWeights`` to the replica's update entry point;
- ``RelayedWeights.load_into(engine, version)`` (the ``load_into`` protocol the replica uses for
  staged weights) opens the relay group once (this process is rank 0, the server's TP ranks
  follow), then for each version posts ``update_weights_from_distributed`` and broadcasts the
  tensors in the same order concurrently; SGLang swaps under its own lock and flushes its cache.

``make_receiver`` picks it for an engine with that API (``SGLangEngine``). The relay costs one
extra device-to-device pass per version. Not runnable on CPU machines (SGLang needs CUDA); tests
skip there and ``scripts/gpu_check.sh`` runs them on a GPU.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from streamrl.net import LOOPBACK, address_towards, free_port
from streamrl.weight_bus.collective import CollectiveReceiver


class SGLangRelay:  # pragma: no cover - needs CUDA and sglang
    """Rank 0 of a process group shared with one SGLang server (its TP ranks are 1..tp)."""

    def __init__(self, engine: Any, *, tp_size: int = 1,
                 group_name: str = "streamrl_weight_relay", timeout_s: float = 60.0) -> None:
        # The group binds where the server reaches this process: loopback for the server a
        # replica launched itself, this node's address on the route to a server elsewhere.
        self.host = address_towards(urlparse(engine.base_url).hostname or LOOPBACK)
        self.engine, self.tp_size = engine, tp_size
        self.group_name, self.timeout_s = group_name, timeout_s
        self.group: Any = None

    async def _ensure_group(self) -> None:
        if self.group is not None:
            return
        from datetime import timedelta

        from sglang.srt.utils import init_custom_process_group

        port = free_port(self.host)
        world_size = 1 + self.tp_size
        joined = self.engine.init_weights_update_group(self.host, port, 1, world_size,
                                                       self.group_name, "nccl")
        self.group, _ = await asyncio.gather(
            asyncio.to_thread(
                init_custom_process_group, backend="nccl",
                init_method=f"tcp://{self.host}:{port}", world_size=world_size, rank=0,
                group_name=self.group_name, timeout=timedelta(seconds=self.timeout_s)),
            joined,
        )

    async def push(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        import torch.distributed as dist

        await self._ensure_group()
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]

        def broadcast_all() -> None:
            for _, t in tensors:
                dist.broadcast(t.contiguous(), src=0, group=self.group)
            torch.cuda.synchronize()

        await asyncio.gather(
            self.engine.update_weights_from_distributed(names, dtypes, shapes, version,
                                                        self.group_name),
            asyncio.to_thread(broadcast_all),
        )


@dataclass(frozen=True)
class RelayedWeights:  # pragma: no cover - needs CUDA and sglang
    """A version received in the replica process, to be relayed into the SGLang server."""

    tensors: list[tuple[str, torch.Tensor]]
    relay: SGLangRelay

    async def load_into(self, engine: Any, version: int) -> None:
        if engine is not self.relay.engine:
            raise ValueError("RelayedWeights: engine is not the one this relay feeds")
        await self.relay.push(self.tensors, version)

    def __iter__(self):  # plain (name, tensor) pairs, for sinks that want them
        return iter(self.tensors)


class SGLangReceiver(CollectiveReceiver):  # pragma: no cover - needs CUDA and sglang
    """Weight receiver for an ``SGLangEngine``: NCCL buckets here, relayed into the server."""

    def __init__(self, endpoint: str, engine: Any, *, sink: Any = None, tp_size: int = 1,
                 receiver_id: str | None = None, timeout_s: float = 60.0,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("SGLangReceiver needs a CUDA GPU (SGLang is GPU-only)")
        relay = SGLangRelay(engine, tp_size=tp_size, timeout_s=timeout_s)

        async def load(staged: RelayedWeights, version: int) -> None:
            await staged.load_into(engine, version)

        def wrap(weights: Any, version: int) -> Any:
            return (sink or load)(RelayedWeights(list(weights), relay), version)

        super().__init__(endpoint, wrap, receiver_id=receiver_id, timeout_s=timeout_s,
                         loop=loop)
