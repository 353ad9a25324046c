"""Admission arithmetic (the staleness bound in one place) and the backend factory."""

from __future__ import annotations

import pytest

from streamrl.buffer import MemoryBuffer, make_buffer
from streamrl.buffer.base import Admission
from streamrl.config import Config, replace, with_mode
from streamrl.testing import make_group


def test_capacity_is_v_plus_eta_plus_one_steps() -> None:
    adm = Admission(groups_per_step=4, max_staleness=2)
    assert [adm.capacity(v) for v in range(3)] == [12, 16, 20]
    assert adm.may_start(11, 0) and not adm.may_start(12, 0)
    assert adm.may_start(12, 1)
    assert adm.slots_left(10, 0) == 2 and adm.slots_left(13, 0) == 0


def test_sync_mode_admits_exactly_one_step() -> None:
    adm = Admission(groups_per_step=3, max_staleness=0)
    assert adm.capacity(0) == 3 and adm.capacity(5) == 18
    assert not adm.may_start(3, 0)


def test_freshness_uses_oldest_policy_token() -> None:
    adm = Admission(groups_per_step=1, max_staleness=1)
    group = make_group([3, 4, 5])  # started at 3, weights swapped twice mid-group
    assert group.staleness(4) == 1 and adm.is_fresh(group, 4)
    assert group.staleness(5) == 2 and not adm.is_fresh(group, 5)
    only_obs = make_group([], obs_tokens=2)  # no policy token: never stale
    assert adm.is_fresh(only_obs, 100)


@pytest.mark.parametrize(("b", "eta", "field"), [(0, 1, "groups_per_step"),
                                                 (2, -1, "max_staleness")])
def test_bad_arguments_name_the_field(b: int, eta: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Admission(b, eta)


def test_make_buffer_picks_the_backend_with_the_mode_bound(redis_url: str) -> None:
    cfg = with_mode(replace(Config(), **{"task.train_batch_size": 2}), "fully_async", 3)
    buf = make_buffer(cfg)
    assert isinstance(buf, MemoryBuffer) and buf.admission == Admission(2, 3)
    from streamrl.buffer.redis import RedisBuffer

    cfg = with_mode(replace(cfg, **{"buffer.backend": "redis", "buffer.redis_url": redis_url,
                                    "buffer.run": "factory"}), "sync")
    rbuf = make_buffer(cfg)
    try:
        assert isinstance(rbuf, RedisBuffer) and rbuf.keys.groups == "streamrl:factory:groups"
        assert rbuf.admission == Admission(2, 0)
    finally:
        rbuf.purge()
        rbuf.close()
    with pytest.raises(ValueError, match=r"buffer.backend='kafka'"):
        make_buffer(replace(cfg, **{"buffer.backend": "kafka"}))
