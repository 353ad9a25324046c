"""Adapter-only versions (``actor.lora.publish=adapter``, docs/lora.md) received in the
replica's own process, for an engine stepped there (``InprocVLLMEngine``); a vLLM engine in its
own process gets them staged in its worker instead (``vllm_receiver.StagedAdapter``).

Parts:
- ``AdapterWeights``: one received adapter version. ``hot``: a replica hands it to its engine
  at once, without pausing or draining (``Replica.update_weights``); ``load_into(engine,
  version)`` is ``engine.load_weights``, which for an engine serving LoRA adapters registers it
  beside the adapter in use: requests in flight finish on the version they started with.
- ``hot_adapters(sink)``: the sink ``make_receiver`` gives a ``CollectiveReceiver``: adapter
  versions reach ``sink`` as ``AdapterWeights``, full weights as they came.

Dependencies: ``base`` (types), ``rollout_fleet.vllm_engine.is_adapter`` (the names test).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from streamrl.rollout_fleet.vllm_engine import is_adapter
from streamrl.weight_bus.base import NamedTensors, WeightSink


class AdapterWeights:
    """A LoRA adapter's PEFT-named tensors, views into the receive buffers: valid until the
    sink returns, and the engine copies them as it registers the adapter."""

    hot = True

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    async def load_into(self, engine: Any, version: int) -> None:
        await engine.load_weights(self.tensors, version)


def hot_adapters(sink: Any) -> WeightSink:
    """``sink``, with adapter versions wrapped in ``AdapterWeights``."""

    def deliver(weights: NamedTensors, version: int) -> Any:
        tensors = list(weights)
        if is_adapter(name for name, _ in tensors):
            return sink(AdapterWeights(tensors), version)
        return sink(tensors, version)

    return deliver
