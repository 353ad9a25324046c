"""Partial rollouts as state (partials.py): the staleness rule a saved group is resumed under,
the snapshot's exact round trip through a checkpoint's JSON, the file and Redis stores, and the
``rollout.partial_flush_s`` check. The replica saving and resuming them on a real engine:
test_replica_partials.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from streamrl.config import ConfigError, RolloutConfig
from streamrl.rollout_fleet.partials import (
    FilePartialStore,
    PartialGroup,
    PartialSample,
    PartialSnapshot,
    RedisPartialStore,
    snapshot_of,
    usable,
)


def group(*versions: list[int], finish: str = "abort") -> PartialGroup:
    return PartialGroup(
        group_id="g", index=3, prompt_ids=[25, 31], data_source="toy/rep", ground_truth="7",
        extra={"task": "rep", "digit": 7},
        samples=[PartialSample(token_ids=[10 + i for i in range(len(v))],
                               logprobs=[-0.1 * (i + 1) for i in range(len(v))],
                               versions=list(v), finish_reason=finish) for v in versions])


def test_a_group_is_kept_while_its_oldest_token_is_within_the_bound():
    g = group([3, 3, 4], [4, 4])
    assert usable(g, learner_version=4, max_staleness=1) == g  # oldest 3: staleness 1
    assert usable(g, learner_version=5, max_staleness=1) is None  # staleness 2 > 1
    assert usable(g, learner_version=5, max_staleness=2) == g


def test_tokens_newer_than_the_learner_are_cut_and_the_sample_continues():
    """Tokens sampled after the checkpoint the learner resumed from are not its policy's."""
    g = group([2, 2, 3, 3], [2, 2], finish="stop")
    kept = usable(g, learner_version=2, max_staleness=0)
    assert kept is not None
    cut, whole = kept.samples
    assert cut.token_ids == [10, 11] and cut.versions == [2, 2] and cut.finish_reason == "abort"
    assert cut.logprobs == g.samples[0].logprobs[:2]
    assert whole == g.samples[1]  # finished within the version: kept as it is


def test_a_group_with_nothing_sampled_is_always_usable():
    g = msgspec.structs.replace(group([1]), samples=None)
    assert usable(g, learner_version=100, max_staleness=0) is g


def test_a_snapshot_survives_a_checkpoints_json_exactly():
    """A checkpoint carries the snapshot in extra.json (msgspec JSON): log-probs must come back
    bit for bit, or the resumed prefix would not be the behaviour policy's."""
    g = group([1, 1], [1])
    g.samples[0].logprobs[0] = -1.2345678901234567e-05
    snap = snapshot_of("replica-0", 17, [g])
    back = msgspec.convert(json.loads(msgspec.json.encode(msgspec.to_builtins(snap))),
                           PartialSnapshot)
    assert back == snap and back.num_tokens == 3


def test_file_store_saves_atomically_and_hands_a_snapshot_out_once(tmp_path):
    store = FilePartialStore(tmp_path / "partials")
    assert store.take("replica-0") is None
    first = snapshot_of("replica-0", 4, [group([0])])
    store.save(first)
    store.save(snapshot_of("replica-1", 9, []))
    second = snapshot_of("replica-0", 5, [group([0, 0])])
    store.save(second)  # the latest save wins
    assert sorted(p.name for p in (tmp_path / "partials").iterdir()) == [
        "replica-0.msgpack", "replica-1.msgpack"]  # no temp file left
    assert store.take("replica-0") == second
    assert store.take("replica-0") is None  # resumed once
    assert store.take("replica-1").cursor == 9


@pytest.mark.redis
def test_redis_store_keeps_one_snapshot_per_replica_with_a_ttl(redis_url):
    from streamrl.buffer.redis.connection import connect

    client = connect(redis_url)
    store = RedisPartialStore(client, "partials-unit", ttl_s=120)
    snap = snapshot_of("replica-0", 2, [group([0, 1])])
    store.save(snap)
    assert 0 < client.ttl("streamrl:partials-unit:partials") <= 120
    assert client.hkeys("streamrl:partials-unit:partials") == [b"replica-0"]
    assert store.take("replica-0") == snap
    assert store.take("replica-0") is None


@pytest.mark.redis
def test_redis_store_leaves_out_groups_the_buffer_holds_already(redis_url):
    """A group put after the last flush is in the buffer: resuming it would put its id twice."""
    from streamrl.buffer.redis.connection import connect
    from streamrl.buffer.redis.wire import RunKeys

    client = connect(redis_url)
    ids = RunKeys.of("partials-put").ids
    store = RedisPartialStore(client, "partials-put", put_ids=ids)
    groups = [msgspec.structs.replace(group([0]), group_id=f"g{i}") for i in range(3)]
    assert store.pending(groups) == groups  # nothing put yet (the set does not exist)
    client.sadd(ids, "g1")
    assert [g.group_id for g in store.pending(groups)] == ["g0", "g2"]
    assert FilePartialStore("unused").pending(groups) == groups


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_partial_flush_s_must_be_a_finite_number_of_seconds(value):
    with pytest.raises(ConfigError, match=r"rollout\.partial_flush_s"):
        RolloutConfig(partial_flush_s=value).validate()
    RolloutConfig(partial_flush_s=0.0).validate()
