"""Ray placement on a cluster with GPUs, the fleet's bounded validation, and the weight bus's
catch-up poll (rank 0 alone, every rank only for a re-send).

Ray counts GPUs as a resource: a local cluster started with ``num_gpus=2`` on this CPU machine
places bundles and actors exactly as a GPU node would (CUDA_VISIBLE_DEVICES per actor), so the
reservation is tested here for real, without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import ray

from streamrl.config import Config, replace
from streamrl.runtime.handles import Fleet, LearnerGroup, WeightBus
from streamrl.runtime.placement import gpus_per, in_bundle, reserve_pools
from streamrl.runtime.supervisor import Member


@pytest.fixture(scope="module")
def ray_with_gpus() -> Iterator[None]:
    from streamrl.runtime.placement import WORKER_ENV

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": dict(WORKER_ENV)})
    yield
    ray.shutdown()


@ray.remote
def _devices() -> tuple[list, str]:
    import os

    return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_learner_and_replica_each_get_their_own_gpu(ray_with_gpus: None) -> None:
    cfg = replace(Config(), **{"runtime.cpus_per_learner": 0.5, "runtime.cpus_per_replica": 0.5})
    assert gpus_per(cfg, "learner") == 1.0 and gpus_per(cfg, "replica") == 1.0
    train, rollout = reserve_pools(cfg)
    assert train is not None and rollout is not None
    assert train.bundle_specs == [{"CPU": 0.5, "GPU": 1.0}]
    assert rollout.bundle_specs == [{"CPU": 0.5, "GPU": 1.0}]
    seen = [ray.get(_devices.options(num_cpus=0.5, num_gpus=gpus_per(cfg, role),
                                     scheduling_strategy=in_bundle(pg, 0)).remote())
            for role, pg in (("learner", train), ("replica", rollout))]
    (learner_ids, learner_env), (replica_ids, replica_env) = seen
    assert len(learner_ids) == 1 and len(replica_ids) == 1 and learner_ids != replica_ids
    assert learner_env == learner_ids[0] and replica_env == replica_ids[0]
    for pg in (train, rollout):
        ray.util.remove_placement_group(pg)
    none = replace(cfg, **{"runtime.gpus_per_replica": 0.0})
    assert gpus_per(none, "replica") == 0.0


@ray.remote
class _SlowReplica:
    async def validate(self) -> dict[str, float]:
        import asyncio

        await asyncio.sleep(60)
        return {"reward/mean": 1.0}


def test_a_validation_that_overruns_is_cancelled_with_a_warning(
        ray_with_gpus: None, caplog: pytest.LogCaptureFixture) -> None:
    actor = _SlowReplica.options(num_cpus=0).remote()
    fleet = Fleet([Member(0, actor)])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert fleet.validate(timeout_s=1.0) == {}
    assert time.monotonic() - start < 10
    assert "validation on replica-0 did not finish within trainer.val_timeout_s=1 s" in caplog.text
    ray.kill(actor)


@ray.remote
class _Rank:
    """A learner rank's catch-up methods, recording the calls it gets; rank 0 holds the
    publisher and so answers ``behind``."""

    def __init__(self, behind: list[str]) -> None:
        self._behind = behind
        self.calls: list[str] = []

    def behind(self, version: int) -> list[str]:
        self.calls.append(f"behind {version}")
        return self._behind

    def catch_up(self, version: int) -> None:
        self.calls.append(f"catch_up {version}")

    def seen(self) -> list[str]:
        return self.calls


@pytest.mark.parametrize("behind", [[], ["replica-1"]])
def test_the_catch_up_poll_asks_rank_0_alone(ray_with_gpus: None, behind: list[str]) -> None:
    # The controller polls every take slice: the other ranks are woken only for a re-send,
    # which every rank's gather takes part in.
    ranks = [_Rank.options(num_cpus=0).remote(behind), _Rank.options(num_cpus=0).remote([])]
    WeightBus(LearnerGroup(ranks)).catch_up(3)
    resend = ["catch_up 3"] if behind else []
    assert ray.get([r.seen.remote() for r in ranks]) == [["behind 3", *resend], resend]
    for rank in ranks:
        ray.kill(rank)
