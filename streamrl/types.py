"""Wire types of the data plane: trajectories, groups and weight manifests.

Everything that crosses a process boundary on the data plane is one of these msgspec structs,
encoded as MessagePack. Decoding never runs code (no pickle): a corrupt or hostile buffer entry
raises :class:`DecodeError` naming what was wrong.

Dependencies point inward: this module imports nothing from the rest of streamrl.
"""

from __future__ import annotations

import math
import uuid
from itertools import compress
from typing import Any

import msgspec

OBSERVATION_VERSION = -1
"""Version stamped on tokens the policy did not sample (tool output, environment observations)."""


class DecodeError(ValueError):
    """Raised when bytes on the data plane are not a valid encoded struct."""


class Trajectory(msgspec.Struct, kw_only=True):
    """One sampled response (possibly multi-turn) to one prompt, token-in/token-out.

    ``response_ids`` holds generated *and* observation tokens in the order the engine saw them;
    ``loss_mask`` is 1 for policy tokens and 0 for observation tokens; ``logprobs`` is the
    behaviour log-prob of each response token (0.0 for observation tokens); ``versions`` the
    policy version that sampled each token (``OBSERVATION_VERSION`` for observation tokens).
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    token_rewards: list[float] | None = None
    finish_reason: str = "length"
    data_source: str = ""
    ground_truth: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Runs on every decode: each check loops in C (len, list.count, map); the slow path
        # that names the offending field or value runs only when a check fails.
        n = len(self.response_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory {self.uid}: {name} has {len(getattr(self, name))} entries "
                    f"but response_ids has {n}"
                )
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise ValueError(
                f"Trajectory {self.uid}: token_rewards has {len(self.token_rewards)} entries "
                f"but response_ids has {n}"
            )
        mask = self.loss_mask
        if mask.count(1) + mask.count(0) != n:  # no value equals both: n iff all are 0 or 1
            bad = next(m for m in mask if m not in (0, 1))
            raise ValueError(f"Trajectory {self.uid}: loss_mask must hold only 0 and 1, got {bad}")
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory {self.uid}: reward={self.reward} is not finite")
        if self.token_rewards is not None and not all(map(math.isfinite, self.token_rewards)):
            raise ValueError(f"Trajectory {self.uid}: token_rewards holds a non-finite value")

    @property
    def policy_versions(self) -> list[int]:
        """Versions of the tokens the policy sampled (observation tokens excluded)."""
        return list(compress(self.versions, self.loss_mask))

    @property
    def min_version(self) -> int | None:
        """Oldest policy version that contributed a token, or None if no token was sampled."""
        if 0 not in self.loss_mask:  # all policy tokens (the common case): no filtering
            return min(self.versions, default=None)
        return min(compress(self.versions, self.loss_mask), default=None)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


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

    @property
    def min_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.min_version) is not None]
        return min(versions) if versions else None

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


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(obj: msgspec.Struct) -> bytes:
    """MessagePack-encode a wire struct."""
    return _encoder.encode(obj)


def decode(data: bytes | bytearray | memoryview, kind: type[Any]) -> Any:
    """Decode MessagePack bytes into ``kind``; any malformed input raises :class:`DecodeError`."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise DecodeError(f"cannot decode {kind.__name__} from {len(data)} bytes: {exc}") from exc


def new_uid() -> str:
    return uuid.uuid4().hex
