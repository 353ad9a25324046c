"""Which rows each rank trains on, in which micro-batch: the update's loop structure as data.

Parts:
- ``balanced_partition``: rows into k bins of near-equal token load (largest first onto the
  lightest bin; optionally equal row counts).
- ``split_by_token_budget``: the fewest bins (at least ``min_parts``) whose loads fit a budget.
- ``MicroBatching``: the micro-batch policy (token budget when dynamic, else fixed groups).
- ``plan_update``: mini-batches of whole groups -> this rank's rows -> micro-batches.

All ranks must run the same number of forward/backward passes (each is a sequence of FSDP
collectives), so micro-batch counts are agreed through ``sync_max`` (an all-reduce MAX in the
learner, the identity in single-process tests); a rank with fewer rows than that count gets
empty micro-batches, which the learner runs as zero-weight dummies. Pure Python + numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Plan = list[list[list[int]]]
"""mini-batch -> micro-batch -> row indices (of the full batch) this rank processes."""


def balanced_partition(
    lengths: Sequence[int], k: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Indices of ``lengths`` in ``k`` bins with near-equal sums (greedy LPT).

    With ``equal_size`` the bins' row counts differ by at most one. Each bin lists its indices
    in ascending order; bins come lightest-first is not promised, only determinism.
    """
    if k <= 0:
        raise ValueError(f"balanced_partition: k={k} must be > 0")
    n = len(lengths)
    cap = math.ceil(n / k) if equal_size else n
    # Equal sizes: the first n % k bins may take cap rows, the rest cap - 1 (when n % k != 0).
    caps = [cap if (not equal_size or n % k == 0 or b < n % k) else cap - 1 for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        open_bins = [b for b in range(k) if len(bins[b]) < caps[b]]
        b = min(open_bins, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def split_by_token_budget(
    lengths: Sequence[int], budget: int, *, min_parts: int = 1
) -> list[list[int]]:
    """The fewest (>= ``min_parts``) balanced bins whose token sums all fit ``budget``."""
    if lengths and max(lengths) > budget:
        raise ValueError(
            f"actor.ppo_max_token_len={budget} is below a sequence of {max(lengths)} tokens"
        )
    k = max(min_parts, math.ceil(sum(lengths) / budget) if lengths else 1)
    while True:
        bins = balanced_partition(lengths, k)
        if all(sum(lengths[i] for i in b) <= budget for b in bins) or k >= len(lengths):
            return bins
        k += 1


@dataclass(frozen=True)
class MicroBatching:
    dynamic: bool
    """True: micro-batches by token budget (packed); False: fixed number of groups (padded)."""
    max_token_len: int
    micro_groups: int
    micro_rows: int | None = None
    """Fixed micro-batches of this many rows on each rank (verl's
    ppo_micro_batch_size_per_gpu), in place of ``micro_groups`` groups' worth."""


def group_minibatches(group_ids: np.ndarray, groups_per_mini: int) -> list[list[int]]:
    """Rows of each mini-batch: consecutive runs of ``groups_per_mini`` whole groups (in order
    of first appearance); the last mini-batch may hold fewer groups."""
    order = list(dict.fromkeys(group_ids.tolist()))
    rows_of: dict[object, list[int]] = {g: [] for g in order}
    for row, gid in enumerate(group_ids.tolist()):
        rows_of[gid].append(row)
    minis = []
    for start in range(0, len(order), groups_per_mini):
        chunk = order[start : start + groups_per_mini]
        minis.append(sorted(r for g in chunk for r in rows_of[g]))
    return minis


def _micro_split(
    rows: list[int],
    lengths: Sequence[int],
    policy: MicroBatching,
    rows_per_micro: int,
    sync_max: Callable[[int], int],
) -> list[list[int]]:
    local = [lengths[r] for r in rows]
    if policy.dynamic:
        want = len(split_by_token_budget(local, policy.max_token_len)) if rows else 0
        k = max(1, sync_max(want))
        bins = split_by_token_budget(local, policy.max_token_len, min_parts=k) if rows else []
        bins = bins + [[]] * (k - len(bins))
    else:
        k = max(1, sync_max(math.ceil(len(rows) / rows_per_micro)))
        bins = [list(part) for part in np.array_split(np.arange(len(rows)), k)]
    return [[rows[i] for i in b] for b in bins]


def plan_update(
    group_ids: np.ndarray,
    lengths: Sequence[int],
    *,
    groups_per_mini: int,
    policy: MicroBatching,
    rank: int,
    world_size: int,
    sync_max: Callable[[int], int] = lambda x: x,
) -> Plan:
    """The rows this rank processes, per mini-batch and micro-batch.

    ``lengths`` are the real (prompt + response) token counts per row. A mini-batch's rows are
    dealt to ranks with equal counts and balanced tokens; fixed micro-batches hold
    ``micro_groups`` groups' worth of rows (a rank's share of a group counts fully).
    """
    if len(group_ids) != len(lengths):
        raise ValueError(f"{len(group_ids)} group ids but {len(lengths)} lengths")
    plan: Plan = []
    for mini_rows in group_minibatches(group_ids, groups_per_mini):
        shards = balanced_partition([lengths[r] for r in mini_rows], world_size, equal_size=True)
        mine = [mini_rows[i] for i in shards[rank]]
        num_groups = len(set(group_ids[mini_rows].tolist()))
        rows_per_micro = policy.micro_rows or max(
            1, round(policy.micro_groups * len(mini_rows) / num_groups))
        plan.append(_micro_split(mine, lengths, policy, rows_per_micro, sync_max))
    return plan
