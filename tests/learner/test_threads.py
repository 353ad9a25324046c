"""A learner rank uses the cores it is given: ``runtime.cpus_per_learner`` torch threads, pinned
to as many cores of its own; the replicas' cores come after every rank's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.config import Config, replace
from streamrl.runtime import placement
from streamrl.runtime.actors import LearnerActor
from streamrl.runtime.placement import pin_role, threads_per
from tests.support.learner import make_batch, make_config, with_advantages


def _cfg(**overrides: Any) -> Config:
    return replace(Config(), **overrides)


def test_threads_are_the_whole_cpus_of_the_bundle() -> None:
    assert threads_per(_cfg(), "learner") == 1 and threads_per(_cfg(), "replica") == 1
    two = _cfg(**{"runtime.cpus_per_learner": 2.0, "runtime.cpus_per_replica": 3.0})
    assert threads_per(two, "learner") == 2 and threads_per(two, "replica") == 3
    shared = _cfg(**{"runtime.cpus_per_learner": 0.5, "runtime.cpus_per_replica": 1.6})
    assert threads_per(shared, "learner") == 1 and threads_per(shared, "replica") == 2


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """Record the core sets pinned, on a pretend 8-core machine."""
    calls: list[set[int]] = []
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda pid, cores: calls.append(cores))
    return calls


def test_each_role_pins_cores_of_its_own(pinned: list[set[int]]) -> None:
    one = _cfg(**{"learner.world_size": 2})
    for role, index in (("learner", 0), ("learner", 1), ("replica", 0), ("replica", 1)):
        pin_role(one, role, index)
    assert pinned == [{0}, {1}, {2}, {3}]  # as before: rank r on core r, replica i on 2 + i
    pinned.clear()
    wide = _cfg(**{"learner.world_size": 2, "runtime.cpus_per_learner": 2.0,
                   "runtime.cpus_per_replica": 3.0})
    for role, index in (("learner", 0), ("learner", 1), ("replica", 0), ("replica", 1)):
        pin_role(wide, role, index)
    assert pinned == [{0, 1}, {2, 3}, {4, 5, 6}, {7, 0, 1}]  # modulo the cores


class _Probe(LearnerActor):
    """A learner rank that also says how many threads its update ran with, and on which cores."""

    def update(self, batch: Any) -> dict[str, float]:
        metrics = super().update(batch)
        return {**metrics, "threads": float(torch.get_num_threads()),
                "cores": float(len(os.sched_getaffinity(0)))}

    def prepare_and_update(self, batch: Any) -> dict[str, float]:
        return self.update(with_advantages(self.prepare(batch), self.cfg))


def test_a_learner_actor_with_two_cpus_runs_two_threads(ray_local: Any, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    ray = ray_local
    cfg = make_config(tiny_model_dir, tmp_path, **{"runtime.cpus_per_learner": 2.0,
                                                   "runtime.pin_cpus": True,
                                                   "weight_bus.backend": "collective"})
    actor = ray.remote(num_cpus=2)(_Probe).remote(cfg, 0, 1)
    try:
        addr, port = ray.get(actor.rendezvous.remote())
        ray.get(actor.start.remote(addr, port))
        metrics = ray.get(actor.prepare_and_update.remote(make_batch()))
    finally:
        ray.kill(actor)
    assert metrics["threads"] == 2  # the worker's environment says OMP_NUM_THREADS=1
    assert metrics["cores"] == min(2, len(os.sched_getaffinity(0)))
