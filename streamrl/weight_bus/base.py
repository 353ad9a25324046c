"""The two sides of the weight bus: the protocol every backend implements.

Parts:
- ``WeightPublisher`` (learner rank 0): ``publish(version, named_tensors) -> PublishStats``,
  ``close()``. ``named_tensors`` is consumed lazily, one full (unsharded) HF-named tensor at a
  time, and always to the end (FSDP ranks gather in lockstep, even when a receiver fails).
- ``WeightReceiver`` (replica side): receives each announced version and hands the whole version
  to a ``WeightSink`` (``engine.load_weights`` or a replica's update entry point), ``close()``.
- ``WeightSink``: ``async (weights, version) -> None``; the same shape as
  ``RolloutEngine.load_weights``, so an engine is a sink and a replica adapts its
  ``update_weights(weights, version, policy)`` with a lambda.
- Errors: ``WeightBusError`` > ``WeightBusTimeout``, ``GroupAborted``, ``ReceiverDied``.
- ``PublishStats``; ``check_version`` (versions strictly increase from 0).

Backends (``collective/``, ``colocated.py``, ``vllm_receiver.py``, ``sglang_receiver.py``) import
this module; it imports none of them. The factories that choose one live in the package's
``__init__``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]
WeightSink = Callable[[NamedTensors, int], Awaitable[None]]
"""Where a received version goes: ``await sink(weights, version)`` must swap atomically.

The tensors are views into receive buffers that are reused for the next version (no copy on
the way in): a sink copies what it keeps, as every engine's ``load_weights`` does.
"""


class WeightBusError(RuntimeError):
    """A weight transfer failed; the message says which version, generation and receivers."""


class WeightBusTimeout(WeightBusError):
    """A bounded wait on the weight bus ran out (``weight_bus.timeout_s``)."""


class GroupAborted(WeightBusError):
    """The learner gave a generation up (a peer died); receivers wait for the next announcement."""


class ReceiverDied(WeightBusError):
    """Receivers were lost during a publish (dead, or alive but silent); survivors whose part of
    the aborted broadcast had not completed are ``behind`` the version: the next publish, or a
    ``catch_up`` of this one, reaches them."""

    def __init__(self, message: str, *, dead: dict[str, str], survivors: list[str],
                 version: int) -> None:
        super().__init__(message)
        self.dead = dead
        """Receiver id -> why it counts as dead."""
        self.survivors = survivors
        self.version = version


@dataclass(frozen=True)
class PublishStats:
    version: int
    nbytes: int
    num_tensors: int
    num_buckets: int
    seconds: float
    """Wall time of ``publish`` (packing, wire and the ``received`` acks)."""
    receivers: tuple[str, ...] = ()
    """Receivers that acknowledged the version."""
    generation: int = -1
    """Weight-group generation the version went out on (-1: no group was needed)."""


class WeightPublisher(abc.ABC):
    """Learner side of the bus."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The latest version published (-1 before the first)."""

    @abc.abstractmethod
    def publish(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        """Send ``version`` to every receiver; versions must strictly increase."""

    def behind(self) -> list[str]:
        """Receivers that have not received the latest version (none on a bus that reaches
        every receiver with every publish)."""
        return []

    def catch_up(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        """Re-send the latest ``version`` (its weights again) to the receivers ``behind`` it."""
        raise NotImplementedError(f"{type(self).__name__} has no receivers to catch up")

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightReceiver(abc.ABC):
    """Replica side of the bus: receives versions in the background and feeds its sink."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Latest version the sink loaded from this receiver's publisher (-1 before the first;
        what the engine held before, from an earlier publisher, does not count)."""

    @property
    @abc.abstractmethod
    def pending_version(self) -> int:
        """The version being received or loaded (-1 when none); set before the publisher's
        ``publish`` of it can return."""

    @abc.abstractmethod
    def close(self) -> None: ...

    async def aclose(self) -> None:
        """``close`` from the event loop the receiver loads through (a replica's): waits for
        a version being loaded without blocking the loop that loads it."""
        self.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_version(version: object, last: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version={version!r}: must be an int >= 0")
    if version <= last:
        raise ValueError(f"version={version}: must be greater than the last published {last}")
    return version

