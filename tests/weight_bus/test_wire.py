"""The wire format of one version, over an in-memory group (no processes): what a streamed and
a planned version put on the wire, and that a receiver assembles the same weights from it,
whole or bucket by bucket."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from streamrl.weight_bus.base import WeightBusError
from streamrl.weight_bus.buckets import BucketPacker, BucketPlan, BufferPool, PlannedPacker
from streamrl.weight_bus.collective.wire import (
    Streaming,
    recv_buckets,
    recv_version,
    send_planned,
    send_streamed,
)
from streamrl.weight_bus.groups import Pending
from tests.support.weights import digest, make_state


class _Done(Pending):
    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None


class _SizeMismatch(Pending):
    """What gloo reports when a receive was posted for a message of another size."""

    def __init__(self, posted: int, sent: int) -> None:
        self.message = f"receive of {posted} bytes matched a broadcast of {sent} bytes"

    def done(self) -> bool:
        return True

    def result(self) -> None:
        raise RuntimeError(self.message)


class Loopback:
    """Both ends of a group: rank 0's broadcasts are recorded, then replayed to a receiver in
    the order its receives are posted, as gloo pairs them."""

    device = torch.device("cpu")
    generation = 1

    def __init__(self) -> None:
        self.wire: deque[torch.Tensor] = deque()
        self.sending = True

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self.sending:
            self.wire.append(tensor.clone())
            return _Done()
        sent = self.wire.popleft()
        if sent.nbytes != tensor.nbytes:
            return _SizeMismatch(tensor.nbytes, sent.nbytes)
        tensor.copy_(sent)
        return _Done()

    def receive(self, plan: BucketPlan | None):
        self.sending = False
        got = recv_version(self, plan, timeout_s=1, check=lambda: None, pool=BufferPool())
        assert not self.wire, "the receiver left broadcasts unread"
        return got


def _send(group: Loopback, plan: BucketPlan, state: dict, announce: bool) -> None:
    packer = PlannedPacker(plan, device=torch.device("cpu"))
    send_planned(group, plan, packer.segments(state.items()), announce_plan=announce,
                 window_bytes=1 << 20, timeout_s=1, check=lambda: None, sent=packer.release)


def test_a_planned_version_is_one_header_and_its_segments() -> None:
    v1, v2 = make_state(1), make_state(2)
    group = Loopback()
    buckets = list(BucketPacker(20_000).pack(v1.items()))
    send_streamed(group, iter(buckets), bucket_bytes=20_000, timeout_s=1, check=lambda: None,
                  sent=lambda b: None)
    # Streamed: a version header, then per bucket a header, a spec and the data; an end marker.
    assert len(group.wire) == 1 + 3 * len(buckets) + 1
    streamed = group.receive(None)
    assert streamed.plan is None and digest(streamed.tensors) == digest(v1.items())

    plan = BucketPlan.build([b.spec for b in buckets], list(v1), chunk_bytes=4096)
    for announce, plan_known, extra in ((True, None, 2), (False, plan, 1)):
        group = Loopback()
        _send(group, plan, v2, announce)
        # The version header (and the plan, once per generation), then only segment data.
        assert len(group.wire) == extra + len(plan.segments)
        assert [t.numel() for t in list(group.wire)[extra:]] == [s.nbytes for s in plan.segments]
        got = group.receive(plan_known)
        assert got.plan == plan and got.specs == [b.spec for b in buckets]
        assert [name for name, _ in got.tensors] == list(v2)  # in the learner's order
        assert digest(got.tensors) == digest(v2.items())


def _planned_on_wire(announce: bool) -> tuple[BucketPlan, Loopback]:
    v1 = make_state(1)
    buckets = [b.spec for b in BucketPacker(20_000).pack(v1.items())]
    plan = BucketPlan.build(buckets, list(v1), chunk_bytes=4096)
    group = Loopback()
    _send(group, plan, v1, announce)
    return plan, group


def test_a_planned_version_on_a_generation_without_the_plan_fails_clearly() -> None:
    _plan, group = _planned_on_wire(announce=False)
    with pytest.raises(WeightBusError, match="has no bucket plan"):
        group.receive(None)


def test_a_plan_announced_again_on_a_generation_that_holds_it_fails_clearly() -> None:
    # A receiver holding the plan posts every segment's receive with the header's: a second
    # PLAN_FOLLOWS on that generation would land the plan's bytes in segment buffers.
    plan, group = _planned_on_wire(announce=True)
    group.sending = False
    with pytest.raises(WeightBusError, match="which announced its bucket plan"):
        recv_version(group, plan, timeout_s=1, check=lambda: None, pool=BufferPool())


def _stream(group: Loopback, plan: BucketPlan | None) -> tuple[Streaming, dict, set[int]]:
    """Receive bucket by bucket as a streamed receiver's engine would: copying each weight
    before asking for the next; returns the state, the copies and the buffers they came in."""
    group.sending = False
    state, got, buffers = Streaming(plan=plan), {}, set()
    for tensors in recv_buckets(group, state, timeout_s=1, check=lambda: None,
                                pool=BufferPool()):
        for name, tensor in tensors:
            if tensor.numel():
                buffers.add(tensor.untyped_storage().data_ptr())
            got[name] = tensor.clone()
    assert state.complete and not group.wire, "the receiver left broadcasts unread"
    return state, got, buffers


def test_a_version_received_bucket_by_bucket_reuses_one_buffer() -> None:
    v1, v2 = make_state(1), make_state(2)
    group = Loopback()
    buckets = list(BucketPacker(20_000).pack(v1.items()))
    send_streamed(group, iter(buckets), bucket_bytes=20_000, timeout_s=1, check=lambda: None,
                  sent=lambda b: None)
    state, got, buffers = _stream(group, None)
    assert state.plan is None and state.specs == [b.spec for b in buckets]
    assert digest(got.items()) == digest(v1.items())
    assert len(buffers) == 2  # of the bucket size, then of the one weight larger than it

    plan = BucketPlan.build([b.spec for b in buckets], list(v1), chunk_bytes=4096)
    for announce, plan_known in ((True, None), (False, plan)):
        group = Loopback()
        _send(group, plan, v2, announce)
        state, got, buffers = _stream(group, plan_known)
        assert state.plan == plan and state.specs == [b.spec for b in buckets]
        assert digest(got.items()) == digest(v2.items())  # the empty tensor included
        assert len(plan.buckets) > 3 and len(buffers) == 1  # one bucket's buffer, reused
