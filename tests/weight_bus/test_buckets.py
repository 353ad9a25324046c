"""Bucket packing: lazy, per-dtype, pooled; unpacking returns views; bad input fails clearly;
the bucket plan later versions follow (segments, zero-copy, drift named)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamrl.types import BucketSpec, TensorSpec
from streamrl.weight_bus.buckets import (
    ALIGN,
    BucketPacker,
    BucketPlan,
    LayoutChanged,
    PlannedPacker,
    dtype_from_name,
    unpack,
)
from tests.support.weights import digest, make_state


def roundtrip(packer: BucketPacker, state: dict[str, torch.Tensor]):
    buckets = list(packer.pack(state.items()))
    out = [pair for b in buckets for pair in unpack(b.spec, b.data.clone())]
    return buckets, out


def test_roundtrip_groups_by_dtype_and_respects_bucket_size() -> None:
    state = make_state(0)
    buckets, out = roundtrip(BucketPacker(20_000), state)
    assert digest(sorted(out)) == digest(sorted(state.items()))
    for b in buckets:
        assert {t.dtype for t in b.spec.tensors} == {b.spec.dtype}
        assert all(t.offset % ALIGN == 0 for t in b.spec.tensors)
        # Only a tensor bigger than the bucket size may overflow it, alone.
        assert b.spec.nbytes <= 20_000 or len(b.spec.tensors) == 1
    assert any(b.spec.nbytes > 20_000 for b in buckets)  # the 300x64 bf16 embedding


def test_cast_dtype_casts_floats_only() -> None:
    state = make_state(0)
    _, out = roundtrip(BucketPacker(1 << 20, cast_dtype=torch.bfloat16), state)
    got = dict(out)
    assert got["layers.0.weight"].dtype == torch.bfloat16
    assert torch.equal(got["layers.0.weight"], state["layers.0.weight"].to(torch.bfloat16))
    assert got["step"].dtype == torch.int64 and got["step"].item() == 0


def test_pack_consumes_lazily_and_reuses_released_buffers() -> None:
    consumed = []

    def gen():
        for i in range(10):
            consumed.append(i)
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each

    packer = BucketPacker(2048)  # two tensors per bucket
    it = packer.pack(gen())
    first = next(it)
    # The third tensor did not fit: bucket 1 went out before w2 was packed anywhere.
    assert len(first.spec.tensors) == 2 and len(consumed) == 3
    assert first.buffer is not None
    storage = first.buffer.data_ptr()
    packer.release(first)  # bucket 1 left the wire: bucket 2 is packed into its buffer
    second = next(it)
    assert second.buffer is not None and second.buffer.data_ptr() == storage
    assert len(consumed) == 5
    assert dict(unpack(second.spec, second.data))["w2"][0].item() == 2.0
    third = next(it)  # bucket 2 not released (still "on the wire"): a second buffer
    assert third.buffer is not None and third.buffer.data_ptr() != storage


def test_a_weight_larger_than_a_bucket_goes_alone_as_a_view_of_itself() -> None:
    big, small = torch.arange(1024, dtype=torch.float32), torch.ones(16)
    packer = BucketPacker(2048)
    buckets = list(packer.pack([("a", small), ("big", big), ("b", small.clone())]))
    assert [[t.name for t in b.spec.tensors] for b in buckets] == [["a"], ["big"], ["b"]]
    alone = buckets[1]
    assert alone.buffer is None and alone.data.data_ptr() == big.data_ptr()  # no copy
    packer.release(alone)  # nothing to hand back
    assert torch.equal(dict(unpack(alone.spec, alone.data))["big"], big)
    # Not contiguous: copied into a buffer of its own size.
    [copied] = list(BucketPacker(2048).pack([("t", big.view(32, 32).t())]))
    assert copied.buffer is not None and copied.spec.nbytes == 4096


def test_unpacked_tensors_are_views() -> None:
    [bucket] = list(BucketPacker(1 << 20).pack([("a", torch.ones(4)), ("b", torch.zeros(3))]))
    (_, a), (_, b) = unpack(bucket.spec, bucket.data)
    assert a.untyped_storage().data_ptr() == bucket.data.untyped_storage().data_ptr()
    bucket.data.zero_()
    assert a.sum().item() == 0 and b.shape == (3,)


@pytest.mark.parametrize("pairs,error", [
    ([("a", torch.ones(1)), ("a", torch.ones(1))], "appears twice"),
    ([("a", [1.0])], "expected a torch.Tensor"),
    ([("", torch.ones(1))], "non-empty str"),
    ([("c", torch.ones(2, dtype=torch.complex64))], "not supported on the weight bus"),
])
def test_bad_input_names_the_weight(pairs, error) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        list(BucketPacker(1024).pack(pairs))


def test_bad_specs_are_rejected() -> None:
    [bucket] = list(BucketPacker(1024).pack([("a", torch.ones(4))]))
    spec = bucket.spec
    beyond = msgspec.structs.replace(spec, tensors=(TensorSpec(
        name="a", shape=(400,), dtype="float32", offset=0, numel=400),))
    with pytest.raises(ValueError, match="exceed the bucket"):
        unpack(beyond, bucket.data)
    with pytest.raises(ValueError, match="has 16 bytes but its spec says 8"):
        unpack(BucketSpec(dtype="float32", nbytes=8, tensors=()), bucket.data)
    with pytest.raises(ValueError, match="not a weight-bus dtype"):
        dtype_from_name("object")


# -- the bucket plan: made from the first version, followed by every later one ----------------
def planned(state: dict[str, torch.Tensor], bucket_bytes: int, chunk_bytes: int) -> BucketPlan:
    buckets = [b.spec for b in BucketPacker(bucket_bytes).pack(state.items())]
    return BucketPlan.build(buckets, list(state), chunk_bytes)


def test_plan_cuts_segments_at_weights_chunks_and_bucket_changes() -> None:
    state = {"a": torch.ones(16), "b": torch.ones(16), "big": torch.ones(100),
             "h": torch.ones(4, dtype=torch.bfloat16), "c": torch.ones(2)}
    plan = planned(state, bucket_bytes=1 << 20, chunk_bytes=160)
    assert [len(b.tensors) for b in plan.buckets] == [4, 1]  # float32, bfloat16
    # a+b merge (64 + 64 bytes); big (400 bytes) goes in 160-byte pieces, its tail alone since
    # the next weight is in the other bucket; c (after h) opens a new run.
    assert [(s.bucket, s.start, s.end) for s in plan.segments] == [
        (0, 0, 128), (0, 128, 288), (0, 288, 448), (0, 448, 528), (1, 0, 8), (0, 576, 584)]
    assert plan.tensor(3).name == "h" and plan.order[4] == (0, 3)


def test_planned_versions_roundtrip_staging_through_one_reused_buffer() -> None:
    """Sent one segment at a time (each released before the next is packed), a version needs
    one staging buffer, of the largest segment's size, whatever its runs of small weights."""
    def layers(seed: int) -> dict[str, torch.Tensor]:  # large weights, each after a small pair
        gen = torch.Generator().manual_seed(seed)
        return {name: torch.randn(shape, generator=gen) for i in range(6)
                for name, shape in ((f"{i}.w", (64, 48)), (f"{i}.a", (8,)), (f"{i}.b", (8,)))}

    state, plan = layers(1), planned(layers(0), bucket_bytes=20_000, chunk_bytes=4096)
    packer = PlannedPacker(plan, device=torch.device("cpu"))
    received = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]
    staging, staged = set(), 0
    for index, out in enumerate(packer.segments(state.items())):
        assert out.index == index  # in wire order
        seg = plan.segments[index]
        received[seg.bucket][seg.start: seg.end].copy_(out.data)
        if out.staging is not None:
            assert out.staging.numel() == packer.staging_bytes == 4096
            staging.add(out.staging.data_ptr())
            staged += 1
        packer.release(out)
    assert len(staging) == 1 and staged == 6  # each small pair, through the same buffer
    got = [pair for spec, data in zip(plan.buckets, received, strict=True)
           for pair in unpack(spec, data)]
    assert digest(sorted(got)) == digest(sorted(state.items()))


def test_contiguous_same_dtype_weights_go_out_zero_copy() -> None:
    flat = torch.arange(64 * 3, dtype=torch.float32)  # three weights laid out as in a bucket
    state = {f"w{i}": flat[64 * i: 64 * (i + 1)].view(8, 8) for i in range(3)}
    state["alone"] = torch.randn(8, 8).t()  # not contiguous: copied
    plan = planned(state, bucket_bytes=1 << 20, chunk_bytes=1 << 20)
    assert len(plan.segments) == 1
    packer = PlannedPacker(plan, device=torch.device("cpu"))
    [out] = list(packer.segments(state.items()))
    assert out.staging is not None  # "alone" lies elsewhere: the segment is staged
    plan = planned({k: v for k, v in state.items() if k != "alone"}, 1 << 20, 1 << 20)
    [out] = list(PlannedPacker(plan, device=torch.device("cpu")).segments(
        (k, v) for k, v in state.items() if k != "alone"))
    assert out.staging is None and out.data.data_ptr() == flat.data_ptr()
    assert torch.equal(out.data.view(torch.float32), flat)


@pytest.mark.parametrize("change,error", [
    (lambda s: {**s, "extra": torch.ones(1)}, "beyond the bucket plan"),
    (lambda s: dict(list(s.items())[:-1]), "the version has 9 weights, the bucket plan 10"),
    (lambda s: {**s, "layers.0.weight": torch.ones(3)}, "the bucket plan expects"),
    (lambda s: {**s, "step": torch.tensor(1.0)}, "the bucket plan expects"),
])
def test_a_version_that_leaves_the_plan_is_named(change, error) -> None:
    plan = planned(make_state(0), bucket_bytes=20_000, chunk_bytes=4096)
    packer = PlannedPacker(plan, device=torch.device("cpu"))
    with pytest.raises(LayoutChanged, match=error):
        list(packer.segments(change(make_state(1)).items()))
