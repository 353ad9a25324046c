"""Wire types of the data plane: trajectories, groups and weight manifests.

Everything that crosses a process boundary on the data plane is one of these msgspec structs,
encoded as MessagePack. Decoding never runs code (no pickle): a corrupt or hostile buffer entry
raises :class:`DecodeError` naming what was wrong.

A trajectory's per-token fields are packed arrays (``Int32Array``, ``UInt8Array``,
``Float32Array``: ``array.array`` of a fixed item type), one MessagePack ``bin`` each on the
wire, little-endian. Decoding one is a copy of its bytes, not one Python object per token (a
group of 4 x 128 tokens: 12 instead of 58 us), and the learner turns them into tensors with
``torch.frombuffer``. Log-probs and token rewards are float32, what the engine computes and the
learner trains on. Lists given to ``Trajectory`` are converted; entries written as lists
(streamrl before packed arrays) still decode.

Dependencies point inward: this module imports nothing from the rest of streamrl.
"""

from __future__ import annotations

import array
import math
import sys
import uuid
from collections.abc import Callable
from itertools import compress
from typing import Any, ClassVar

import msgspec

OBSERVATION_VERSION = -1
"""Version stamped on tokens the policy did not sample (tool output, environment observations)."""
FLOAT32_MAX = 3.4028234663852886e38


def fits_float32(value: float) -> bool:
    """Whether ``value`` stays finite as a float32, the dtype of the learner's reward tensors:
    NaN, +-inf and magnitudes past ``FLOAT32_MAX`` (1e39 is finite in Python, inf there) do not."""
    return abs(value) <= FLOAT32_MAX


class DecodeError(ValueError):
    """Raised when bytes on the data plane are not a valid encoded struct."""


class PackedArray(array.array):  # type: ignore[type-arg]
    """An ``array.array`` of the subclass's item type: list-like (len, index, iterate, count;
    slices and concatenations stay packed; equal to an array, list or tuple of the same
    values), and a buffer (``torch.frombuffer``, ``bytes``)."""

    TYPECODE: ClassVar[str]
    __slots__ = ()  # no per-array __dict__: decoding makes one per field per trajectory
    __hash__ = None  # type: ignore[assignment]

    def __new__(cls, values: Any = ()) -> PackedArray:
        return super().__new__(cls, cls.TYPECODE, values)

    def __getitem__(self, key: Any) -> Any:  # a slice stays packed (and equal to a list)
        got = super().__getitem__(key)
        return type(self)(got) if isinstance(key, slice) else got

    def __add__(self, other: Any) -> PackedArray:  # so does a concatenation, with a list too
        return type(self)([*self, *other] if isinstance(other, list | tuple)
                          else super().__add__(other))

    def __radd__(self, other: Any) -> PackedArray:
        return type(self)([*other, *self])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list | tuple):
            return self.tolist() == list(other)
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _unpack, (type(self), self.tobytes())


class Int32Array(PackedArray):
    __slots__ = ()
    TYPECODE = "i"


class UInt8Array(PackedArray):
    __slots__ = ()
    TYPECODE = "B"


class Float32Array(PackedArray):
    __slots__ = ()
    TYPECODE = "f"


assert Int32Array().itemsize == 4 and Float32Array().itemsize == 4  # the wire's item sizes
_BIG_ENDIAN = sys.byteorder == "big"  # the wire is little-endian


def _unpack(kind: type[PackedArray], data: Any) -> PackedArray:
    """A packed array from its little-endian bytes (or, as old entries hold it, a list): the
    decoders' ``dec_hook`` itself (the wire structs' only custom types are packed arrays; 20
    calls per group decoded, so no wrapper frame) and pickle's constructor."""
    if type(data) is bytes:  # msgpack bin and pickle give bytes: one copy
        out = array.array.__new__(kind, kind.TYPECODE, data)  # ValueError: not whole items
        if _BIG_ENDIAN:
            out.byteswap()
        return out  # type: ignore[return-value]
    if isinstance(data, list):  # strict: a bool or a str is no token id
        try:
            values = msgspec.convert(data, list[float] if kind is Float32Array else list[int])
        except msgspec.ValidationError as exc:  # msgspec adds the field's path to ours
            raise TypeError(str(exc).replace(" - at `$", " at `")) from None
        return kind(values)
    raise TypeError(f"expected bytes for {kind.__name__}, got {type(data).__name__}")


def _convert(kind: type[PackedArray], name: str, values: Any, uid: str) -> PackedArray:
    try:
        return kind(values)
    except (TypeError, OverflowError) as exc:
        if kind is UInt8Array and isinstance(exc, OverflowError):  # the loss mask, -1 or 256
            bad = next(v for v in values if v not in (0, 1))
            raise ValueError(f"Trajectory {uid}: {name} must hold only 0 and 1, got {bad}"
                             ) from None
        raise ValueError(f"Trajectory {uid}: {name} must hold {kind.__name__[:-5].lower()} "
                         f"values ({exc})") from None


class Trajectory(msgspec.Struct, kw_only=True):
    """One sampled response (possibly multi-turn) to one prompt, token-in/token-out.

    ``response_ids`` holds generated *and* observation tokens in the order the engine saw them;
    ``loss_mask`` is 1 for policy tokens and 0 for observation tokens; ``logprobs`` is the
    behaviour log-prob of each response token (0.0 for observation tokens); ``versions`` the
    policy version that sampled each token (``OBSERVATION_VERSION`` for observation tokens).
    """

    uid: str
    group_id: str
    prompt_ids: Int32Array
    response_ids: Int32Array
    loss_mask: UInt8Array
    logprobs: Float32Array
    versions: Int32Array
    reward: float = 0.0
    token_rewards: Float32Array | None = None
    finish_reason: str = "length"
    data_source: str = ""
    ground_truth: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Runs on every decode (4 per group taken): each check is one expression that loops in
        # C (len, translate, map), written out rather than looped over field names; the slow
        # path that names the offending field or value runs only when a check fails. Decoded
        # fields are packed already; lists (a caller's) are converted.
        if (type(self.prompt_ids) is not Int32Array or type(self.response_ids) is not Int32Array
                or type(self.loss_mask) is not UInt8Array
                or type(self.logprobs) is not Float32Array
                or type(self.versions) is not Int32Array
                or (type(self.token_rewards) is not Float32Array
                    and self.token_rewards is not None)):
            for name, kind in _PACKED_FIELDS:
                values = getattr(self, name)
                if type(values) is not kind and values is not None:
                    setattr(self, name, _convert(kind, name, values, self.uid))
        n = len(self.response_ids)
        token_rewards = self.token_rewards
        if (len(self.loss_mask) != n or len(self.logprobs) != n or len(self.versions) != n
                or (token_rewards is not None and len(token_rewards) != n)):
            for name in ("loss_mask", "logprobs", "versions", "token_rewards"):
                values = getattr(self, name)
                if values is not None and len(values) != n:
                    raise ValueError(f"Trajectory {self.uid}: {name} has {len(values)} entries "
                                     f"but response_ids has {n}")
        mask = self.loss_mask
        if bytes(mask).translate(None, b"\x00\x01"):  # a byte other than 0 and 1 is left
            bad = next(m for m in mask if m not in (0, 1))
            raise ValueError(f"Trajectory {self.uid}: loss_mask must hold only 0 and 1, got {bad}")
        if not fits_float32(self.reward):
            raise ValueError(f"Trajectory {self.uid}: reward={self.reward} is not finite in "
                             "float32 (the learner's reward tensors)")
        if self.token_rewards is not None and not all(map(math.isfinite, self.token_rewards)):
            raise ValueError(f"Trajectory {self.uid}: token_rewards holds a non-finite value")

    @property
    def policy_versions(self) -> list[int]:
        """Versions of the tokens the policy sampled (observation tokens excluded)."""
        return list(compress(self.versions, self.loss_mask))

    @property
    def min_version(self) -> int | None:
        """Oldest policy version that contributed a token, or None if no token was sampled."""
        return self._policy_version(min)

    @property
    def max_version(self) -> int | None:
        """Newest policy version that contributed a token, or None if no token was sampled."""
        return self._policy_version(max)

    def _policy_version(self, pick: Callable[..., int | None]) -> int | None:
        versions = self.versions
        if b"\x00" not in bytes(self.loss_mask):  # all policy tokens (common): no filtering
            packed = versions.tobytes()
            if packed and packed == packed[:versions.itemsize] * len(versions):
                return versions[0]  # one version throughout (common): a memcmp, not a loop
            return pick(versions, default=None)
        return pick(compress(versions, self.loss_mask), default=None)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


_PACKED_FIELDS = (("prompt_ids", Int32Array), ("response_ids", Int32Array),
                  ("loss_mask", UInt8Array), ("logprobs", Float32Array),
                  ("versions", Int32Array), ("token_rewards", Float32Array))
_PACKED_KINDS = frozenset({Int32Array, UInt8Array, Float32Array})


class Group(msgspec.Struct, kw_only=True):
    """The n trajectories sampled for one prompt: the unit the buffer moves (GRPO needs all n)."""

    group_id: str
    trajectories: list[Trajectory]
    prompt_index: int = -1
    created_ts: float = 0.0
    baseline_reward: float | None = None
    """ReMax: the reward of one greedy response to the prompt (rollout.greedy_baseline)."""

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError(f"Group {self.group_id}: has no trajectories")
        for traj in self.trajectories:
            if traj.group_id != self.group_id:
                raise ValueError(
                    f"Group {self.group_id}: trajectory {traj.uid} has group_id={traj.group_id!r}"
                )
        if self.baseline_reward is not None and not fits_float32(self.baseline_reward):
            raise ValueError(f"Group {self.group_id}: baseline_reward={self.baseline_reward} is "
                             "not finite in float32 (the learner's reward tensors)")

    @property
    def min_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.min_version) is not None]
        return min(versions) if versions else None

    @property
    def max_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.max_version) is not None]
        return max(versions) if versions else None

    def staleness(self, learner_version: int) -> int:
        """How many updates this group's oldest policy token lags behind ``learner_version``."""
        oldest = self.min_version
        return 0 if oldest is None else learner_version - oldest

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


class TensorSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Where one named tensor lives inside a flat bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int


class BucketSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One flat buffer on the wire: all tensors in it share ``dtype``."""

    dtype: str
    nbytes: int
    tensors: tuple[TensorSpec, ...]


class WeightManifest(msgspec.Struct, kw_only=True, frozen=True):
    """Announces a weight version: the bucket layout receivers must allocate, in wire order."""

    version: int
    buckets: tuple[BucketSpec, ...]
    total_bytes: int
    publish_id: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)


def _enc_hook(obj: Any) -> Any:
    if type(obj) in _PACKED_KINDS:
        if _BIG_ENDIAN:
            obj = type(obj)(obj)
            obj.byteswap()
        return memoryview(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(obj: msgspec.Struct) -> bytes:
    """MessagePack-encode a wire struct."""
    return _encoder.encode(obj)


def decode(data: bytes | bytearray | memoryview, kind: type[Any]) -> Any:
    """Decode MessagePack bytes into ``kind``; any malformed input raises :class:`DecodeError`."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind, dec_hook=_unpack)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise DecodeError(f"cannot decode {kind.__name__} from {len(data)} bytes: {exc}") from exc


def new_uid() -> str:
    return uuid.uuid4().hex
