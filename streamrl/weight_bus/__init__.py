"""streamrl.weight_bus: learner -> rollout-fleet weight transfer (DESIGN.md §6).

``base`` holds the protocol (``WeightPublisher``, ``WeightReceiver``, ``WeightSink``, the
errors); ``make_publisher`` / ``make_receiver`` pick a backend from
``weight_bus.backend`` and, on the replica side, from what the engine can do
(``receiver_class``). Backends: ``collective/`` (bucketed broadcast on a dedicated gloo/NCCL
group, ``control`` for ZMQ announcements and acks), ``colocated`` (in-place swap in the
learner's process), and the receivers that land versions in an engine, ``vllm_receiver``
(inside the vLLM worker) and ``sglang_receiver`` (relayed into SGLang's distributed update API);
``adapter`` marks a LoRA adapter version received in the replica's process as hot (added
without a pause, docs/lora.md).

Dependencies point inward: backends import ``base``; this module imports backends only inside
the factories, when chosen, so importing the package stays cheap (vLLM's worker imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from streamrl.net import LOOPBACK
from streamrl.weight_bus.base import (
    GroupAborted,
    NamedTensors,
    PublishStats,
    ReceiverDied,
    WeightBusError,
    WeightBusTimeout,
    WeightPublisher,
    WeightReceiver,
    WeightSink,
)

if TYPE_CHECKING:
    from streamrl.config import WeightBusConfig
    from streamrl.weight_bus.collective import CollectiveReceiver

__all__ = [
    "GroupAborted",
    "NamedTensors",
    "PublishStats",
    "ReceiverDied",
    "WeightBusError",
    "WeightBusTimeout",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSink",
    "make_publisher",
    "make_receiver",
    "receiver_class",
]

def make_publisher(cfg: WeightBusConfig, *, engine: Any = None, **kwargs: Any) -> WeightPublisher:
    """The learner-side bus ``weight_bus.backend`` names.

    ``collective``: binds the control endpoint on ``cfg.master_addr:cfg.master_port`` (loopback
    when unset; the runtime sets the learner node's IP on a multi-node run); receivers connect
    to ``publisher.endpoint``, which carries the run token. NCCL when CUDA is available, else
    gloo; ``kwargs`` go to ``CollectivePublisher``.
    ``colocated``: needs ``engine`` (the engine living in this process).
    """
    if cfg.backend == "collective":
        from streamrl.weight_bus.collective import CollectivePublisher

        kwargs.setdefault("backend", "nccl" if torch.cuda.is_available() else "gloo")
        return CollectivePublisher(
            host=cfg.master_addr or LOOPBACK, port=cfg.master_port, bucket_mb=cfg.bucket_mb,
            timeout_s=cfg.timeout_s, **kwargs,
        )
    if cfg.backend == "colocated":
        from streamrl.weight_bus.colocated import ColocatedPublisher

        if engine is None:
            raise ValueError("weight_bus.backend='colocated' needs the in-process engine")
        return ColocatedPublisher(engine, **kwargs)
    raise ValueError(f"weight_bus.backend={cfg.backend!r}: must be 'collective' or 'colocated'")


def receiver_class(engine: Any) -> type[CollectiveReceiver]:
    """The collective-bus receiver for ``engine``, chosen by what the engine can do.

    - SGLang (``init_weights_update_group`` + ``update_weights_from_distributed``: the server
      joins a process group of its own): ``SGLangReceiver`` relays each version into it.
    - vLLM (``collective_rpc``: code runs inside its worker): ``VLLMReceiver`` lands buckets there.
    - Anything else, or no engine: ``CollectiveReceiver`` receives in this process.

    Capabilities, not types, so choosing never imports an engine package (SGLang is GPU-only).
    """
    if hasattr(engine, "init_weights_update_group") and hasattr(
            engine, "update_weights_from_distributed"):
        from streamrl.weight_bus.sglang_receiver import SGLangReceiver

        return SGLangReceiver
    if hasattr(engine, "collective_rpc"):
        from streamrl.weight_bus.vllm_receiver import VLLMReceiver

        return VLLMReceiver
    from streamrl.weight_bus.collective import CollectiveReceiver

    return CollectiveReceiver


def make_receiver(
    cfg: WeightBusConfig, *, endpoint: str, sink: WeightSink, engine: Any = None,
    receiver_id: str | None = None, **kwargs: Any,
) -> WeightReceiver:
    """The replica-side bus for ``weight_bus.backend=collective``: ``receiver_class(engine)``.

    With an SGLang or vLLM ``engine`` the receiver is built around the engine; otherwise buckets
    land in this process (``CollectiveReceiver``). Either way each version goes to ``sink`` whole
    (for SGLang and vLLM as staged weights with ``load_into(engine, version)``). ``kwargs`` go to
    the receiver (``loop``; ``tp_size`` for SGLang).

    ``cfg.receive="streamed"``: the sink gets each version before it is received and its load
    receives it bucket by bucket (``CollectiveReceiver``): only for an engine that declares
    ``streamed_load`` (``VLLMEngine``, in its worker; ``InprocVLLMEngine``, here). Adapter
    versions are not told apart then (config.py refuses adapter publishes with it).
    """
    if cfg.backend == "colocated":
        raise ValueError("weight_bus.backend='colocated' has no receiver: the learner hands "
                         "weights to the engine in its own process (ColocatedPublisher)")
    if cfg.backend != "collective":
        raise ValueError(f"weight_bus.backend={cfg.backend!r}: must be 'collective' or "
                         "'colocated'")
    from streamrl.weight_bus.collective import CollectiveReceiver

    cls = receiver_class(engine)
    if cfg.receive == "streamed":
        if not getattr(engine, "streamed_load", False):
            raise ValueError(f"weight_bus.receive='streamed': needs a vLLM engine, whose load "
                             f"copies each weight as it arrives; got {type(engine).__name__}")
        kwargs["receive"] = "streamed"
        if cls is CollectiveReceiver:  # every weight straight to the engine's load
            return CollectiveReceiver(endpoint, sink, receiver_id=receiver_id,
                                      timeout_s=cfg.timeout_s, **kwargs)
    if cls is CollectiveReceiver:
        from streamrl.weight_bus.adapter import hot_adapters

        # A LoRA adapter version reaches the sink marked hot (added without a pause).
        return CollectiveReceiver(endpoint, hot_adapters(sink), receiver_id=receiver_id,
                                  timeout_s=cfg.timeout_s, **kwargs)
    # The engine's receivers (subclasses of CollectiveReceiver) take (endpoint, engine, *, sink).
    engine_receiver: Callable[..., WeightReceiver] = cls
    return engine_receiver(endpoint, engine, sink=sink, receiver_id=receiver_id,
                           timeout_s=cfg.timeout_s, **kwargs)
