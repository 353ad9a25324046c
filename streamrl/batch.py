"""The learner's transport: `Batch` (verl's DataProto) and its packed view, `PackedBatch`.

Parts:
- `Batch`: named tensors sharing batch dim 0, named numpy side arrays of the same length, and
  batch-wide `meta`. Row operations (`index`, `chunk`, `concat`), key operations (`select`,
  `pop`, `union`), `to(device)`, and `Batch.from_groups`, which lays groups out as verl does:
  prompts LEFT-padded to P, responses RIGHT-padded to R.
- `PackedBatch` (from `Batch.pack`): rows concatenated without padding into one [1, T] sequence,
  plus the index maps that bring per-token results back to the padded [n, R] response grid.

Dependencies point inward: this module imports only `streamrl.types`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from streamrl.types import OBSERVATION_VERSION, Group

__all__ = ["Batch", "PackedBatch"]

_ROW_META = ("num_groups", "group_ids", "min_version")
"""Meta keys summarising the rows: recomputed (or dropped) whenever the rows change."""


def _baselines(groups: Sequence[Group]) -> torch.Tensor | None:
    """``reward_baselines`` [B]: each row's group's greedy reward (ReMax), or None when no
    group carries one. A batch mixing groups with and without one cannot be trained."""
    carried = [g.baseline_reward is not None for g in groups]
    if not any(carried):
        return None
    if not all(carried):
        missing = next(g.group_id for g in groups if g.baseline_reward is None)
        raise ValueError(f"Group {missing}: has no baseline_reward while others in the batch "
                         "do (rollout.greedy_baseline must be on for every producer)")
    return torch.tensor([g.baseline_reward for g in groups for _ in g.trajectories],
                        dtype=torch.float32)


def _packed(trajs: Sequence[Any], name: str, where: Tensor, pad: Any, dtype: torch.dtype
            ) -> Tensor:
    """Each trajectory's packed array ``name`` laid into the rows of a ``where``-shaped tensor
    at its True cells (row-major: a row's cells in order), ``pad`` elsewhere. One copy of the
    bytes, no Python object per token."""
    first = getattr(trajs[0], name)
    flat = torch.frombuffer(bytearray().join(getattr(t, name) for t in trajs),
                            dtype=_TORCH_DTYPES[first.typecode])
    out = torch.full(where.shape, pad, dtype=dtype)
    out[where] = flat.to(dtype)
    return out


_TORCH_DTYPES = {"i": torch.int32, "B": torch.uint8, "f": torch.float32}


def _column(values: list[Any], dtype: Any = object) -> np.ndarray:
    out = np.empty(len(values), dtype=dtype)
    out[:] = values  # element-wise, so tuples/None never become extra dimensions
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)


def _merge_meta(metas: Iterable[dict[str, Any]], skip: Sequence[str] = ()) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key in skip:
                continue
            if key in merged and not _same(merged[key], value):
                raise ValueError(f"meta[{key!r}] conflicts: {merged[key]!r} vs {value!r}")
            merged[key] = value
    return merged


@dataclass
class Batch:
    """Rows of training data: ``tensors`` and ``non_tensors`` share dim 0; ``meta`` is batch-wide.

    Operations return new batches (sharing tensor storage where torch does) except ``pop``,
    which removes keys from this batch. ``meta`` holds batch-wide constants (``pad_token_id``)
    that row operations carry unchanged, and row summaries (``num_groups``, ``group_ids``,
    ``min_version``) that ``index``/``chunk``/``concat`` recompute from the ``index``,
    ``versions`` and ``response_mask`` columns (or drop when those columns are gone).
    """

    tensors: dict[str, Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        size: tuple[str, int] | None = None
        for kind, store, cls in (("tensor", self.tensors, Tensor),
                                 ("non-tensor", self.non_tensors, np.ndarray)):
            for key, value in store.items():
                if not isinstance(value, cls):
                    raise TypeError(f"{kind} {key!r} must be a {cls.__name__}, got "
                                    f"{type(value).__name__}")
                if value.ndim == 0:
                    raise ValueError(f"{kind} {key!r} is 0-dimensional: it needs a batch dim 0")
                if size is None:
                    size = (key, value.shape[0])
                elif value.shape[0] != size[1]:
                    raise ValueError(f"{kind} {key!r} has batch size {value.shape[0]} but "
                                     f"{size[0]!r} has {size[1]}")
        both = self.tensors.keys() & self.non_tensors.keys()
        if both:
            raise ValueError(f"keys {sorted(both)} are both tensors and non-tensors")

    # ---- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        for value in (*self.tensors.values(), *self.non_tensors.values()):
            return int(value.shape[0])
        return 0

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> Tensor | np.ndarray:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"no key {key!r} in batch (have {sorted(self.keys())}); "
                       f"use .index() to select rows")

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype)) for k, v in self.tensors.items()}
        return (f"Batch(len={len(self)}, tensors={tensors}, "
                f"non_tensors={list(self.non_tensors)}, meta={list(self.meta)})")

    def _check_keys(self, keys: Iterable[str]) -> list[str]:
        keys = list(keys)
        for key in keys:
            if key not in self:
                raise KeyError(f"no key {key!r} in batch (have {sorted(self.keys())})")
        return keys

    # ---- rows -----------------------------------------------------------------------------
    def _with_rows(self, tensors: dict[str, Tensor], non_tensors: dict[str, np.ndarray],
                   meta: dict[str, Any]) -> Batch:
        """A batch over new rows, with the row summaries in ``meta`` recomputed or dropped."""
        derived: dict[str, Any] = {}
        if "index" in non_tensors:
            group_ids = list(dict.fromkeys(non_tensors["index"].tolist()))
            derived.update(group_ids=group_ids, num_groups=len(group_ids))
        if "versions" in tensors and "response_mask" in tensors:
            versions = tensors["versions"]
            policy = versions[(tensors["response_mask"] > 0) & (versions >= 0)]
            derived["min_version"] = int(policy.min()) if policy.numel() else None
        # a summary whose columns are gone would be stale: drop it
        meta = {k: derived.get(k, v) for k, v in meta.items() if k not in _ROW_META or k in derived}
        return Batch(tensors, non_tensors, meta)

    def index(self, idx: Sequence[int] | Sequence[bool] | slice | Tensor | np.ndarray) -> Batch:
        """Rows by a list/array of ints, a slice, or a bool mask of length ``len(self)``."""
        n = len(self)
        if isinstance(idx, slice):
            rows = torch.arange(n)[idx]
        else:
            rows = torch.as_tensor(np.asarray(idx.cpu() if isinstance(idx, Tensor) else idx))
            if rows.ndim != 1:
                raise IndexError(f"index must be 1-D (got shape {tuple(rows.shape)}); "
                                 f"wrap a single row as [i]")
            if rows.dtype == torch.bool:
                if rows.numel() != n:
                    raise IndexError(f"bool mask has {rows.numel()} entries, batch has {n}")
                rows = rows.nonzero().flatten()
            elif rows.numel() and (rows.is_floating_point() or rows.is_complex()):
                raise IndexError(f"index must hold ints or bools, got {rows.dtype}")
            rows = rows.long()
            if rows.numel() and (rows.max() >= n or rows.min() < -n):
                raise IndexError(f"row index out of range for batch of {n}: "
                                 f"{rows.min().item()}..{rows.max().item()}")
        np_rows = rows.numpy()
        return self._with_rows(
            {k: v[rows.to(v.device)] for k, v in self.tensors.items()},
            {k: v[np_rows] for k, v in self.non_tensors.items()},
            self.meta,
        )

    def chunk(self, k: int) -> list[Batch]:
        """Split into ``k`` equal consecutive parts; ``len(self)`` must be divisible by ``k``."""
        n = len(self)
        if k <= 0 or n % k:
            raise ValueError(f"cannot chunk a batch of {n} rows into k={k} equal parts")
        size = n // k
        return [self.index(slice(i * size, (i + 1) * size)) for i in range(k)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order. Keys must match; widths beyond dim 0 must match;
        batch-wide meta must agree (row summaries are recomputed)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(first.keys()):
                diff = sorted(set(b.keys()) ^ set(first.keys()))
                raise ValueError(f"concat: batch {i} keys differ from batch 0 in {diff}")
            for key, value in b.tensors.items():
                if value.shape[1:] != first.tensors[key].shape[1:]:
                    raise ValueError(f"concat: tensor {key!r} has shape {tuple(value.shape)} in "
                                     f"batch {i} but {tuple(first.tensors[key].shape)} in batch "
                                     f"0 (beyond dim 0 they must match)")
        meta = _merge_meta((b.meta for b in batches), skip=_ROW_META)
        meta.update({k: v for k, v in first.meta.items() if k in _ROW_META})
        return first._with_rows(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            meta,
        )

    # ---- keys -----------------------------------------------------------------------------
    def select(self, keys: Iterable[str]) -> Batch:
        """A batch with only ``keys`` (tensor or non-tensor) and a copy of ``meta``."""
        keys = self._check_keys(keys)
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
                     dict(self.meta))

    def pop(self, keys: Iterable[str]) -> Batch:
        """Remove ``keys`` from this batch and return them as a batch (with a copy of ``meta``)."""
        out = self.select(keys)
        for key in [*out.tensors, *out.non_tensors]:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
        return out

    def union(self, other: Batch) -> Batch:
        """All keys of both batches (same rows). A key in both must hold equal values."""
        if len(self) != len(other):
            raise ValueError(f"union: batches have {len(self)} and {len(other)} rows")
        for key in sorted(set(self.keys()) & set(other.keys())):
            if not _same(self[key], other[key]):
                raise ValueError(f"union: key {key!r} has different values in the two batches")
        return Batch({**self.tensors, **other.tensors},
                     {**self.non_tensors, **other.non_tensors},
                     _merge_meta([self.meta, other.meta]))

    def to(self, device: torch.device | str) -> Batch:
        """Tensors moved to ``device`` (numpy side arrays stay on the host)."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()},
                     dict(self.non_tensors), dict(self.meta))

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_groups(cls, groups: Sequence[Group], pad_token_id: int) -> Batch:
        """verl's padded layout; rows group by group, trajectories in group order.

        Tensors: ``prompts`` [B,P] (left-padded), ``responses`` [B,R] (right-padded),
        ``input_ids``/``attention_mask``/``position_ids`` [B,P+R] (position = cumsum(mask)-1,
        clamped at 0), and over responses [B,R]: ``response_mask`` (the loss mask, float32),
        ``rollout_log_probs`` (float32), ``versions`` (long, -1 on observation tokens and
        padding), ``token_level_scores`` (float32: ``token_rewards`` if given, else the reward at
        the last policy token, or the last response token when no token is a policy token).
        ``reward_baselines`` [B] (float32) when the groups carry a greedy baseline (ReMax).
        Every trajectory needs a non-empty prompt and response.
        """
        trajs = [t for g in groups for t in g.trajectories]
        if not trajs:
            raise ValueError("from_groups needs at least one group")
        for t in trajs:
            for name in ("prompt_ids", "response_ids"):
                if not getattr(t, name):
                    raise ValueError(f"Trajectory {t.uid}: {name} is empty")
        P = max(len(t.prompt_ids) for t in trajs)
        R = max(len(t.response_ids) for t in trajs)
        # One tensor per field from the trajectories' packed arrays: one copy of their bytes
        # and a masked assignment, whatever the number of rows.
        prompt_lens = torch.tensor([len(t.prompt_ids) for t in trajs])
        response_lens = torch.tensor([len(t.response_ids) for t in trajs])
        in_prompt = torch.arange(P) >= P - prompt_lens[:, None]  # left-padded
        in_response = torch.arange(R) < response_lens[:, None]  # right-padded
        prompts = _packed(trajs, "prompt_ids", in_prompt, pad_token_id, torch.long)
        responses = _packed(trajs, "response_ids", in_response, pad_token_id, torch.long)
        prompt_mask, resp_attn = in_prompt.long(), in_response.long()
        response_mask = _packed(trajs, "loss_mask", in_response, 0, torch.float32)
        log_probs = _packed(trajs, "logprobs", in_response, 0.0, torch.float32)
        # Padding has mask 0 too, so it gets the observation version with observation tokens.
        versions = _packed(trajs, "versions", in_response, OBSERVATION_VERSION,
                           torch.long).masked_fill(response_mask == 0, OBSERVATION_VERSION)
        scores = torch.zeros(len(trajs), R, dtype=torch.float32)
        dense = [i for i, t in enumerate(trajs) if t.token_rewards is not None]
        if dense:
            scores[dense] = _packed([trajs[i] for i in dense], "token_rewards",
                                    in_response[dense], 0.0, torch.float32)
        sparse = torch.ones(len(trajs), dtype=torch.bool)
        sparse[dense] = False
        if bool(sparse.any()):
            # The reward sits at the last policy token, or the last response token when no token
            # is a policy token (response_mask is 0 on padding: argmax finds the last 1).
            positions = torch.arange(1, R + 1, dtype=torch.float32)
            last_policy = (response_mask * positions).argmax(dim=1)
            last = torch.where(response_mask.any(dim=1), last_policy, response_lens - 1)
            rows = sparse.nonzero().squeeze(1)
            scores[rows, last[rows]] = torch.tensor([t.reward for t in trajs],
                                                    dtype=torch.float32)[rows]
        attention_mask = torch.cat([prompt_mask, resp_attn], dim=1)
        min_versions = [v for g in groups if (v := g.min_version) is not None]
        baselines = _baselines(groups)

        return cls(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                "response_mask": response_mask,
                "rollout_log_probs": log_probs,
                "versions": versions,
                "token_level_scores": scores,
                **({"reward_baselines": baselines} if baselines is not None else {}),
            },
            non_tensors={
                "uid": _column([t.uid for t in trajs]),
                "index": _column([t.group_id for t in trajs]),
                "data_source": _column([t.data_source for t in trajs]),
                "ground_truth": _column([t.ground_truth for t in trajs]),
                "reward": _column([t.reward for t in trajs], np.float64),
                "finish_reason": _column([t.finish_reason for t in trajs]),
            },
            meta={
                "pad_token_id": pad_token_id,
                "num_groups": len(groups),
                "group_ids": [g.group_id for g in groups],
                "min_version": min(min_versions) if min_versions else None,
            },
        )

    def pack(self, rows: Sequence[int] | None = None) -> PackedBatch:
        """The real tokens of ``rows`` (default: all, in order) concatenated, see `PackedBatch`.

        Needs ``input_ids``, ``attention_mask`` (real tokens of a row contiguous: left-padded
        prompt then right-padded response, as `from_groups` makes) and ``responses`` (for R).
        """
        for key in ("input_ids", "attention_mask", "responses"):
            if key not in self.tensors:
                raise KeyError(f"pack needs tensor {key!r} (have {sorted(self.tensors)})")
        ids_all, attn_all = self.tensors["input_ids"], self.tensors["attention_mask"]
        n_all, R = len(self), self.tensors["responses"].shape[1]
        rows = list(range(n_all)) if rows is None else [int(r) for r in rows]
        if not rows or any(not 0 <= r < n_all for r in rows):
            raise IndexError(f"pack: rows {rows} must be a non-empty list within 0..{n_all - 1}")
        sel = torch.tensor(rows, device=ids_all.device)
        ids, attn = ids_all[sel], attn_all[sel].bool()
        P = ids.shape[1] - R
        prompt_lens, resp_lens = attn[:, :P].sum(1), attn[:, P:].sum(1)
        if ((prompt_lens == 0) & (resp_lens > 0)).any():
            bad = rows[int(((prompt_lens == 0) & (resp_lens > 0)).nonzero()[0])]
            raise ValueError(f"pack: row {bad} has an empty prompt, so no position predicts its "
                             f"first response token")
        seq_lens = prompt_lens + resp_lens
        cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device=ids.device)
        cu[1:] = seq_lens.cumsum(0)
        starts = cu[:-1].long()
        flat = ids[attn]  # row-major: each row's prompt then response, rows in order
        T = flat.numel()
        position_ids = torch.arange(T, device=ids.device) - starts.repeat_interleave(seq_lens)
        targets = flat.roll(-1)
        targets[cu[1:].long() - 1] = 0  # the last token of a sequence predicts nothing
        j = torch.arange(R, device=ids.device)
        valid = j[None, :] < resp_lens[:, None]
        # Response token j of a row sits at start + p + j; the position before it predicts it.
        index = torch.where(valid, (starts + prompt_lens - 1)[:, None] + j, -1)
        predict_mask = torch.zeros(T, dtype=torch.bool, device=ids.device)
        predict_mask[index[valid]] = True
        return PackedBatch(
            input_ids=flat[None], position_ids=position_ids[None], cu_seqlens=cu,
            max_seqlen=int(seq_lens.max()), rows=rows,
            targets=targets[None], predict_mask=predict_mask[None], response_token_index=index,
        )


@dataclass
class PackedBatch:
    """n rows packed into one sequence of T tokens, no padding.

    - ``input_ids`` [1,T] long: each row's real prompt+response tokens, rows concatenated in
      ``rows`` order; sequence i spans ``cu_seqlens[i]:cu_seqlens[i+1]`` ([n+1] int32).
    - ``position_ids`` [1,T] long: restart at 0 for each sequence. Given ``attention_mask=None``
      and ``use_cache=False``, HF transformers reads the restarts as packed sequences and builds
      a block-diagonal causal mask (a cache turns that detection off); varlen attention
      (flash-attention's kernels, ``learner.varlen_attention``) takes ``cu_seqlens`` and
      ``max_seqlen`` instead: ``attention_kwargs``.
    - ``targets`` [1,T] long: the token after each position in the same sequence (0 at a
      sequence's last position), so ``log_softmax(logits).gather(-1, targets[..., None])`` is the
      log-prob of the next token at every position.
    - ``predict_mask`` [1,T] bool: True at positions whose target is a response token, i.e. the
      positions whose log-probs belong to the response (prompt-internal predictions excluded).
    - ``response_token_index`` [n,R] long: for response token j of row i, the packed position
      that PREDICTS it (the position of the token just before it: for j=0 the prompt's last
      token), or -1 where the padded grid has padding. R is the source batch's response width,
      so `unpack_response` lines up with ``batch.index(rows)``'s [n,R] tensors.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    rows: list[int]
    targets: Tensor
    predict_mask: Tensor
    response_token_index: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def attention_kwargs(self) -> dict[str, Tensor | int]:
        """The sequence bounds, as transformers' varlen attention functions read them."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}

    @property
    def response_valid(self) -> Tensor:
        """[n,R] bool: True on real response tokens (policy and observation), False on padding."""
        return self.response_token_index >= 0

    def unpack_response(self, values: Tensor) -> Tensor:
        """Scatter per-position ``values`` ([T] or [1,T], computed at packed positions, e.g. the
        next-token log-probs) into the padded [n,R] response grid, zeros on padding."""
        flat = values.reshape(-1) if values.dim() == 2 and values.shape[0] == 1 else values
        if flat.dim() != 1 or flat.numel() != self.num_tokens:
            raise ValueError(f"unpack_response: values must be [T] or [1,T] with "
                             f"T={self.num_tokens}, got shape {tuple(values.shape)}")
        index = self.response_token_index.to(flat.device)
        valid = index >= 0
        out = flat.new_zeros(index.shape)
        out[valid] = flat[index[valid]]
        return out

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: v.to(device) if isinstance(v, Tensor)
                              else list(v) if isinstance(v, list) else v
                              for k, v in moved.items()})
