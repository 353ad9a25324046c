"""Pure tests of the update plan: partitions, token budgets, rank shards, mini-batches."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.learner.batching import (
    MicroBatching,
    balanced_partition,
    group_minibatches,
    plan_update,
    split_by_token_budget,
)


def test_balanced_partition_equal_sizes_and_balance() -> None:
    lengths = [50, 10, 40, 20, 30, 30, 5, 15]
    bins = balanced_partition(lengths, 2, equal_size=True)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert [len(b) for b in bins] == [4, 4]
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert abs(loads[0] - loads[1]) <= 10
    odd = balanced_partition([1, 2, 3, 4, 5], 2, equal_size=True)
    assert sorted(len(b) for b in odd) == [2, 3]


def test_token_budget_split_fits_and_uses_few_bins() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=40).tolist()
    bins = split_by_token_budget(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= int(np.ceil(sum(lengths) / 128)) + 2
    assert len(split_by_token_budget(lengths, 128, min_parts=len(bins) + 3)) == len(bins) + 3
    with pytest.raises(ValueError, match="ppo_max_token_len=10"):
        split_by_token_budget([11], 10)


def test_minibatches_keep_groups_whole() -> None:
    ids = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)
    assert group_minibatches(ids, 2) == [[0, 1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("dynamic", [True, False])
def test_plan_covers_each_row_once_across_ranks(dynamic: bool) -> None:
    rng = np.random.default_rng(1)
    ids = np.repeat(np.arange(8), 4).astype(object)
    lengths = rng.integers(4, 30, size=32).tolist()
    policy = MicroBatching(dynamic=dynamic, max_token_len=64, micro_groups=1)
    plans = [plan_update(ids, lengths, groups_per_mini=4, policy=policy, rank=r, world_size=2,
                         sync_max=lambda v: v + 1)  # force an extra (possibly empty) micro
             for r in range(2)]
    for mini in range(2):
        rows = sorted(r for plan in plans for micro in plan[mini] for r in micro)
        assert rows == list(range(mini * 16, mini * 16 + 16))
        for plan in plans:
            for micro in plan[mini]:
                if dynamic:
                    assert sum(lengths[r] for r in micro) <= 64
    assert len(plans[0][0]) == len(plans[1][0])
