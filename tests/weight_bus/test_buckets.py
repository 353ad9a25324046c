"""Bucket packing: lazy, per-dtype, pooled; unpacking returns views; bad input fails clearly."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamrl.types import BucketSpec, TensorSpec
from streamrl.weight_bus.buckets import ALIGN, BucketPacker, dtype_from_name, unpack
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
    storage = first.buffer.data_ptr()
    packer.release(first)  # bucket 1 left the wire: bucket 2 is packed into its buffer
    second = next(it)
    assert second.buffer.data_ptr() == storage and len(consumed) == 5
    assert dict(unpack(second.spec, second.data))["w2"][0].item() == 2.0
    third = next(it)  # bucket 2 not released (still "on the wire"): a second buffer
    assert third.buffer.data_ptr() != storage


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
