"""Wire types: msgpack round trips, multi-turn masks, validation and hostile-input decoding."""

from __future__ import annotations

import array
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from streamrl.testing import make_trajectory as traj
from streamrl.types import (
    OBSERVATION_VERSION,
    BucketSpec,
    DecodeError,
    Float32Array,
    Group,
    Int32Array,
    TensorSpec,
    Trajectory,
    UInt8Array,
    WeightManifest,
    decode,
    encode,
)


def multi_turn(uid: str = "mt", group_id: str = "g0") -> Trajectory:
    """Two policy turns around a 3-token tool observation (an interior hole in the loss mask)."""
    return Trajectory(
        uid=uid, group_id=group_id, prompt_ids=[1, 2, 3],
        response_ids=[20, 21, 90, 91, 92, 22, 23],
        loss_mask=[1, 1, 0, 0, 0, 1, 1],
        logprobs=[-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4],
        versions=[7, 7, OBSERVATION_VERSION, OBSERVATION_VERSION, OBSERVATION_VERSION, 8, 9],
        reward=1.0, finish_reason="stop", data_source="toy", ground_truth="42",
        extra={"turns": 2, "tools": ["calc"]}, metrics={"gen_s": 0.25},
    )


def raw(obj: msgspec.Struct) -> dict[str, Any]:
    """The encoded struct as a plain dict, to tamper with fields on the wire."""
    return msgspec.msgpack.decode(encode(obj))


# ---- round trips ---------------------------------------------------------------------------
def test_trajectory_round_trip_keeps_every_field() -> None:
    t = multi_turn()
    t.token_rewards = Float32Array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    back = decode(encode(t), Trajectory)
    assert back == t
    assert back.extra == {"turns": 2, "tools": ["calc"]}
    assert back.token_rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_ragged_group_round_trip() -> None:
    group = Group(
        group_id="g0", prompt_index=3, created_ts=12.5,
        trajectories=[traj("a", n=1), traj("b", n=5), multi_turn("c"), traj("d", n=2)],
    )
    back = decode(encode(group), Group)
    assert back == group
    assert [len(t.response_ids) for t in back.trajectories] == [1, 5, 7, 2]
    # decode accepts the buffer types a transport hands over
    assert decode(memoryview(encode(group)), Group) == group
    assert decode(bytearray(encode(group)), Group) == group


def test_weight_manifest_round_trip() -> None:
    manifest = WeightManifest(
        version=3, total_bytes=96,
        buckets=(BucketSpec(dtype="bfloat16", nbytes=96, tensors=(
            TensorSpec(name="w", shape=(4, 8), dtype="bfloat16", offset=0, numel=32),
            TensorSpec(name="b", shape=(16,), dtype="bfloat16", offset=64, numel=16),
        )),),
    )
    back = decode(encode(manifest), WeightManifest)
    assert back == manifest
    assert back.buckets[0].tensors[0].shape == (4, 8)
    assert back.publish_id == manifest.publish_id
    assert WeightManifest(version=3, total_bytes=0, buckets=()).publish_id != manifest.publish_id


# ---- multi-turn masks and versions -----------------------------------------------------------
def test_multi_turn_versions_ignore_observation_tokens() -> None:
    t = multi_turn()
    assert t.policy_versions == [7, 7, 8, 9]
    assert t.min_version == 7
    assert t.num_policy_tokens == 4
    # an observation token is never the oldest, whatever it is stamped with
    t_old_obs = multi_turn()
    t_old_obs.versions = Int32Array([7, 7, 0, 0, 0, 8, 9])
    assert t_old_obs.min_version == 7


def test_min_version_of_a_response_sampled_across_weight_swaps() -> None:
    # all policy tokens: one version throughout is the fast path, mixed ones are not
    assert traj("one", versions=[5, 5, 5]).min_version == 5
    assert traj("swapped", versions=[5, 5, 6]).min_version == 5
    assert traj("late", versions=[6, 6, 5]).min_version == 5
    assert traj("wide", versions=[257, 1, 257]).min_version == 1


def test_group_min_version_and_staleness() -> None:
    only_obs = traj("o", n=2, loss_mask=[0, 0], versions=[OBSERVATION_VERSION] * 2)
    assert only_obs.min_version is None
    group = Group(group_id="g0", trajectories=[multi_turn("a"), traj("b", versions=[9, 9, 9]),
                                               only_obs])
    assert group.min_version == 7
    assert group.staleness(10) == 3
    assert group.rewards == [1.0, 0.0, 0.0]
    empty = Group(group_id="g0", trajectories=[only_obs])
    assert empty.min_version is None and empty.staleness(10) == 0


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["loss_mask", "logprobs", "versions", "token_rewards"])
def test_mismatched_lengths_name_the_field(field: str) -> None:
    kw = {field: [0] * 2 if field != "logprobs" else [0.0] * 2}
    with pytest.raises(ValueError, match=f"{field} has 2 entries but response_ids has 3"):
        traj(**kw)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e39, -1e39])
def test_reward_not_finite_in_float32_rejected(value: float) -> None:
    """1e39 is a finite Python float but inf in the learner's float32 tensors."""
    with pytest.raises(ValueError, match=r"reward=.* is not finite in float32"):
        traj(reward=value)
    with pytest.raises(ValueError, match="token_rewards holds a non-finite value"):
        traj(token_rewards=[0.0, value, 1.0])
    with pytest.raises(ValueError, match=r"baseline_reward=.* is not finite in float32"):
        Group(group_id="g0", trajectories=[traj()], baseline_reward=value)
    assert traj(reward=-3.4e38).reward == -3.4e38  # the float32 range itself is fine


@pytest.mark.parametrize("bad", [2, -1])
def test_loss_mask_only_zero_one(bad: int) -> None:
    with pytest.raises(ValueError, match=f"loss_mask must hold only 0 and 1, got {bad}"):
        traj(loss_mask=[1, bad, 0])


def test_group_validation() -> None:
    with pytest.raises(ValueError, match="trajectory x has group_id='other'"):
        Group(group_id="g0", trajectories=[traj("a"), traj("x", group_id="other")])
    with pytest.raises(ValueError, match="Group g0: has no trajectories"):
        Group(group_id="g0", trajectories=[])


# ---- packed per-token fields -----------------------------------------------------------------
def test_per_token_fields_are_packed_arrays_on_the_wire() -> None:
    t = traj(token_rewards=[0.0, 0.0, 1.0])
    assert [type(getattr(t, f)) for f in ("prompt_ids", "response_ids", "loss_mask", "logprobs",
                                          "versions", "token_rewards")] == [
        Int32Array, Int32Array, UInt8Array, Float32Array, Int32Array, Float32Array]
    wire = raw(t)  # one bin per field: the little-endian items
    assert wire["response_ids"] == struct.pack("<3i", *t.response_ids)
    assert wire["logprobs"] == struct.pack("<3f", *t.logprobs)
    assert wire["loss_mask"] == bytes(t.loss_mask)
    assert t.response_ids == list(t.response_ids) and t.response_ids != [*t.response_ids, 0]
    ids = t.response_ids.tolist()  # slices and concatenations stay packed and list-equal
    assert t.response_ids[1:] == ids[1:] and type(t.response_ids[1:]) is Int32Array
    assert t.prompt_ids + t.response_ids == t.prompt_ids.tolist() + ids
    assert t.response_ids + [7] == [*ids, 7] and [7] + t.response_ids == [7, *ids]  # noqa: RUF005


def test_entries_written_with_lists_still_decode() -> None:
    t = traj(token_rewards=[0.0, 0.0, 1.0])
    wire = {k: (v.tolist() if isinstance(v, array.array) else v)
            for k, v in msgspec.structs.asdict(t).items()}
    back = decode(msgspec.msgpack.encode(wire), Trajectory)
    assert back == t and type(back.versions) is Int32Array


def test_packed_fields_survive_pickling() -> None:  # Ray moves groups between actors
    g = Group(group_id="g0", trajectories=[traj("a"), traj("b", token_rewards=[0.0, 0.5, 1.0])])
    back = pickle.loads(pickle.dumps(g))
    assert back == g and type(back.trajectories[1].token_rewards) is Float32Array


@pytest.mark.parametrize(("field", "value", "message"), [
    ("response_ids", [1, 2**40, 3], "response_ids must hold int32 values"),
    ("versions", ["a", "b", "c"], "versions must hold int32 values"),
    ("logprobs", [None, 0.0, 0.0], "logprobs must hold float32 values"),
])
def test_values_a_packed_field_cannot_hold_are_refused(field: str, value: Any,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=f"Trajectory t0: {message}"):
        traj(**{field: value})


# ---- decoding hostile bytes ------------------------------------------------------------------
@pytest.mark.parametrize(("data", "message"), [
    (b"\xc1\xc1 not msgpack", "malformed"),
    (b"", "truncated"),
    (b"\x83\xa3uid", "truncated"),  # a map cut off after its first key
])
def test_garbage_bytes_raise_decode_error(data: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=f"cannot decode Trajectory from {len(data)} bytes.*"
                                          f"{message}"):
        decode(data, Trajectory)


def test_truncated_and_padded_bytes_raise_decode_error() -> None:
    data = encode(Group(group_id="g0", trajectories=[multi_turn()]))
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(DecodeError, match="truncated"):
            decode(data[:cut], Group)
    with pytest.raises(DecodeError, match="trailing characters"):
        decode(data + b"\x00", Group)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prompt_ids", ["x"], r"Expected `int`, got `str` at `\[0\]` - at `\$.prompt_ids`"),
    ("prompt_ids", b"\x01\x00\x00", r"not a multiple of item size - at `\$.prompt_ids`"),
    ("logprobs", 5, r"expected bytes for Float32Array, got int - at `\$.logprobs`"),
    ("reward", "high", r"Expected `float`, got `str` - at `\$.reward`"),
    ("loss_mask", [True, False, True],
     r"Expected `int`, got `bool` at `\[0\]` - at `\$.loss_mask`"),
    ("uid", None, r"Expected `str`, got `None` - at `\$.uid`"),
])
def test_wrong_type_fields_raise_decode_error(field: str, value: Any, message: str) -> None:
    wire = raw(traj())
    wire[field] = value
    with pytest.raises(DecodeError, match=message):
        decode(msgspec.msgpack.encode(wire), Trajectory)


def test_decode_runs_validation() -> None:
    """Invariants hold for decoded structs too: tampered bytes cannot smuggle in a bad value."""
    wire = raw(traj())
    wire["loss_mask"] = [1, 3, 1]
    with pytest.raises(DecodeError, match="loss_mask must hold only 0 and 1, got 3"):
        decode(msgspec.msgpack.encode(wire), Trajectory)
    wire = raw(traj())
    wire["reward"] = float("nan")
    with pytest.raises(DecodeError, match="reward=nan is not finite"):
        decode(msgspec.msgpack.encode(wire), Trajectory)
    group = raw(Group(group_id="g0", trajectories=[traj()]))
    group["trajectories"][0]["group_id"] = "g1"
    with pytest.raises(DecodeError, match="trajectory t0 has group_id='g1'"):
        decode(msgspec.msgpack.encode(group), Group)


class _Payload:
    """A pickle that creates a directory when unpickled: proof of code execution."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.target),))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_is_rejected_without_running(tmp_path: Path, protocol: int) -> None:
    target = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(target), protocol=protocol)
    for kind in (Trajectory, Group, WeightManifest):
        with pytest.raises(DecodeError, match=f"cannot decode {kind.__name__}"):
            decode(payload, kind)
    assert not target.exists()
    # the payload is live: unpickling it (what decode must never do) runs the code
    pickle.loads(payload)
    assert target.is_dir()


def test_pickled_trajectory_is_not_a_trajectory() -> None:
    with pytest.raises(DecodeError, match="cannot decode Trajectory"):
        decode(pickle.dumps(multi_turn()), Trajectory)
