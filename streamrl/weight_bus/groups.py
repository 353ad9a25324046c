"""The weight group: a dedicated process group (rank 0 = learner, ranks 1.. = receivers).

Parts:
- ``GroupSpec``: how a receiver joins generation ``g`` (sent to it in an ``Announce``).
- ``WeightGroup`` with two backends: ``GlooGroup`` (CPU: ``ProcessGroupGloo`` over a
  ``PrefixStore`` of the learner's ``TCPStore``) and ``NcclGroup`` (GPU: vLLM's
  ``StatelessProcessGroup`` + ``PyNcclCommunicator``). Neither touches torch.distributed's default
  group, so FSDP's group and the weight group never interfere.
- ``Pending.wait(deadline, check)``: every wait on a collective is bounded and polls ``check``
  (a dead peer, or the learner's abort flag) so a broken broadcast becomes an error, not a hang.
- ``run_bounded(fn, deadline, check)``: the same guarantee for blocking calls such as the
  rendezvous inside a process-group constructor.

Each membership change gets a new generation: a fresh ``PrefixStore`` namespace (gloo) or a fresh
store port (NCCL). The learner sets ``abort`` in the generation's namespace when it gives a
generation up; receivers blocked in that generation see it within ``POLL_S`` and leave.
Groups that failed mid-collective are kept alive in ``_GRAVEYARD`` instead of destroyed: a gloo
group's destructor waits for its pending work, which would turn a dead peer into a hang.
"""

from __future__ import annotations

import abc
import datetime
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from streamrl.net import address_towards, is_loopback
from streamrl.weight_bus.base import GroupAborted, WeightBusTimeout

POLL_S = 0.02
T = TypeVar("T")
_GRAVEYARD: list[Any] = []


class GroupSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Where and how rank ``rank`` joins generation ``generation`` of the weight group."""

    generation: int
    backend: str
    """gloo | nccl"""
    host: str
    store_port: int
    """The learner's TCPStore (rendezvous namespace and abort flags of every generation)."""
    world_size: int
    rank: int
    timeout_s: float
    nccl_port: int = 0
    """NCCL only: the port of this generation's StatelessProcessGroup store."""
    run: str = ""
    """The run token (``control``): the run's keys live under it, and only members are told
    it. A namespace, not authentication: the TCPStore admits any process that reaches its
    port (docs/scale-out.md, Security)."""

    @property
    def prefix(self) -> str:
        return f"streamrl-weight-bus/{self.run}/g{self.generation}/"


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A fresh client of the learner's TCPStore for one generation.

    Never shared between threads: a client blocked in a rendezvous ``wait`` would stall another
    receiver of the same process (in-process tests, several engines per process).
    """
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def run_bounded(fn: Callable[[], T], deadline: float, check: Callable[[], None], what: str) -> T:
    """Run a blocking call in a helper thread; give up at ``deadline`` or when ``check`` raises.

    A call given up on keeps running in its daemon thread until its own timeout ends it.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"weight-bus-{what}", daemon=True).start()
    while not done.wait(POLL_S):
        check()
        if time.monotonic() > deadline:
            raise WeightBusTimeout(f"weight bus: {what} did not finish in time")
    if "error" in box:
        raise box["error"]
    return box["value"]


class Pending(abc.ABC):
    """One collective in flight."""

    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def result(self) -> None:
        """Raise the collective's error, if any (called once ``done``)."""

    def wait(self, deadline: float, check: Callable[[], None], what: str) -> None:
        while not self._wait_slice():
            check()
            if time.monotonic() > deadline:
                raise WeightBusTimeout(f"weight bus: {what} did not finish in time")
        self.result()

    def _wait_slice(self) -> bool:
        time.sleep(POLL_S / 4)
        return self.done()


class _EventPending(Pending):
    """Done once ``_event`` is set (by whatever learns of the completion)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def _wait_slice(self) -> bool:
        return self._event.wait(POLL_S)


class _GlooPending(_EventPending):
    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work
        work.get_future().add_done_callback(lambda _: self._event.set())

    def result(self) -> None:
        self.work.wait()


class WeightGroup(abc.ABC):
    """A formed weight group; the learner is rank 0 and the source of every broadcast."""

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        self.spec = spec
        self.store = dist.PrefixStore(spec.prefix, store)
        self.broken = False

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def rank(self) -> int:
        return self.spec.rank

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor) -> Pending:
        """Start broadcasting ``tensor`` from rank 0 (receivers: into ``tensor``)."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the buckets of this backend live."""

    def abort(self, reason: str) -> None:
        """Learner side: tell every receiver still in this generation to leave it."""
        self.broken = True
        self.store.set("abort", reason)

    def aborted(self) -> str | None:
        if self.store.check(["abort"]):
            return self.store.get("abort").decode(errors="replace")
        return None

    def check_abort(self) -> None:
        reason = self.aborted()
        if reason is not None:
            self.broken = True
            raise GroupAborted(f"weight bus generation {self.generation} aborted: {reason}")

    def close(self) -> None:
        """Drop the group; a broken one is parked instead (its destructor could block)."""
        if self.broken:
            _GRAVEYARD.append(self)


class _PointToPointPending(_EventPending):
    """Gloo's send and recv works, completed by the group's ``_Waiter``."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works
        self._error: Exception | None = None

    def complete(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except Exception as exc:  # gloo's own timeout, or a peer gone: re-raised by result()
            self._error = exc
        finally:
            self._event.set()

    def result(self) -> None:
        if self._error is not None:
            raise self._error


class _Waiter:
    """Completes a group's point-to-point works on a thread of its own, in the order they were
    posted: gloo's send and recv works have no future and finish only inside a blocking
    ``wait`` (which ends at the group's timeout at the latest), while the caller's waits must
    stay bounded and keep polling its check."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_PointToPointPending | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def add(self, pending: _PointToPointPending) -> _PointToPointPending:
        self._queue.put(pending)
        return pending

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            pending.complete()


class GlooGroup(WeightGroup):
    """CPU backend: ``ProcessGroupGloo`` on a per-generation ``PrefixStore``.

    A broadcast is a send from rank 0 to every other rank (a star) where that costs no more
    than gloo's tree: on one host (every copy crosses the same memory either way) or with at
    most 3 ranks (the tree is a star there too). Gloo runs collectives on its 2 worker threads,
    so a receiver has at most 2 broadcasts posted and the wire waits for a recv-ready round trip
    at each broadcast's end; sends and recvs are posted by the caller, all at once, and the
    segments of a version follow each other without a gap (95 MiB in 25 weights, 256 MB
    buckets, handed over: 0.64-0.69 of one raw broadcast -> 0.89-0.98 with 1 receiver,
    0.69-0.71 -> 0.95-0.98 with 2).
    Both ends tag their point-to-point works by their count: every rank broadcasts the same
    sequence, as collectives require anyway.
    """

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        super().__init__(spec, store)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        pg_store = dist.PrefixStore("pg/", self.store)
        star = is_loopback(spec.host) or spec.world_size <= 3
        self._tags = itertools.count(1)
        # None: a tree, gloo's own broadcast
        self._waiter = _Waiter(f"weight-bus-gloo-g{spec.generation}-r{spec.rank}") if star else None
        if is_loopback(spec.host):  # single node: gloo's default device
            self.pg = dist.ProcessGroupGloo(pg_store, spec.rank, spec.world_size, timeout)
            return
        # Across nodes, bind on this process's route to the learner: the default device
        # binds where the hostname resolves, which /etc/hosts often maps to loopback.
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(spec.host))]
        opts._timeout = timeout
        self.pg = dist.ProcessGroupGloo(pg_store, spec.rank, spec.world_size, opts)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self._waiter is None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            return _GlooPending(self.pg.broadcast([tensor], opts))
        tag = next(self._tags)
        if self.rank == 0:
            works = [self.pg.send([tensor], r, tag) for r in range(1, self.spec.world_size)]
        else:
            works = [self.pg.recv([tensor], 0, tag)]
        return self._waiter.add(_PointToPointPending(works))

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        super().close()


class _CudaPending(Pending):
    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def result(self) -> None:
        return None


class NcclGroup(WeightGroup):  # pragma: no cover - needs CUDA; tests skip without a GPU
    """GPU backend: vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` on a side stream.

    NCCL kernels cannot be cancelled: after a peer dies the communicator is given up and parked,
    and its stream may stay blocked; the next generation gets a new communicator and stream.
    """

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        super().__init__(spec, store)
        pg = StatelessProcessGroup.create(spec.host, spec.nccl_port, spec.rank, spec.world_size,
                                          store_timeout=int(spec.timeout_s))
        self._device = torch.device("cuda", torch.cuda.current_device())
        self.comm = PyNcclCommunicator(pg, device=self._device)
        self.stream = torch.cuda.Stream(device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        # The side stream must see the packing done on the current stream before sending.
        self.stream.wait_stream(torch.cuda.current_stream(self._device))
        self.comm.broadcast(tensor, src=0, stream=self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        tensor.record_stream(self.stream)
        return _CudaPending(event)



BACKENDS: dict[str, type[WeightGroup]] = {"gloo": GlooGroup, "nccl": NcclGroup}


def join_group(spec: GroupSpec, store: dist.Store, deadline: float,
               check: Callable[[], None]) -> WeightGroup:
    """Form (rank 0) or join (ranks > 0) generation ``spec.generation``, bounded by ``deadline``."""
    try:
        cls = BACKENDS[spec.backend]
    except KeyError:
        raise ValueError(f"weight group backend={spec.backend!r}: must be one of "
                         f"{sorted(BACKENDS)}") from None
    return run_bounded(lambda: cls(spec, store), deadline, check,
                       f"joining weight group generation {spec.generation} as rank {spec.rank}")
