"""Property: every config that validates can make progress, over modes x admissible overrides.

The known failure is a bound the weight sync cannot meet: ``trainer.mode=sync
weight_bus.sync_every=2`` leaves replicas sampling with weights one version old, every group is
too stale to take, and ``take`` waits out its timeout. For each generated config that
``load_config`` accepts, a run is simulated step by step on the real ``MemoryBuffer`` with the
controller's rules: replicas sample with the last published weights (stamping that version),
admit while the buffer's bound allows, and finish their groups; the learner takes B groups at
version V, updates, publishes every ``weight_bus.sync_every`` steps (replicas serve the new
version before admission opens, as the loaded acks guarantee), then ``set_version``. The
learner must be served within a bounded number of replica rounds at every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import MODES, UPDATE_POLICIES, Config, ConfigError, load_config
from streamrl.testing import make_group


def learner_steps_served(cfg: Config, steps: int) -> int:
    """How many of ``steps`` training steps get their batch (== steps unless a step starves)."""
    b, eta = cfg.task.train_batch_size, cfg.buffer.max_staleness
    buffer = MemoryBuffer(b, eta)
    weights = 0  # the version every replica serves (one publish reaches all of them)
    slots = cfg.rollout.num_replicas * cfg.rollout.max_inflight_groups
    for version in range(steps):
        for _ in range(4 * (eta + 2)):  # replica rounds; a starving step never gets served
            for _ in range(slots):
                if not buffer.try_admit():
                    break
                buffer.put(make_group(weights, n=1, obs_tokens=0))
            try:
                groups = buffer.take(b, version, timeout=0)
                break
            except TimeoutError:
                continue
        else:
            return version
        buffer.ack([g.group_id for g in groups])
        if (version + 1) % cfg.weight_bus.sync_every == 0:
            weights = version + 1
        buffer.set_version(version + 1)
    return steps


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(MODES),
    eta=st.none() | st.integers(0, 4),
    sync_every=st.none() | st.integers(1, 6),
    policy=st.none() | st.sampled_from(UPDATE_POLICIES),
    batch=st.integers(1, 4),
    replicas=st.integers(1, 3),
    inflight=st.integers(1, 4),
)
def test_every_valid_config_makes_progress(
    mode: str, eta: int | None, sync_every: int | None, policy: str | None, batch: int,
    replicas: int, inflight: int,
) -> None:
    overrides = [f"trainer.mode={mode}", f"task.train_batch_size={batch}",
                 "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1",
                 f"rollout.num_replicas={replicas}", f"rollout.max_inflight_groups={inflight}"]
    for key, value in (("buffer.max_staleness", eta), ("weight_bus.sync_every", sync_every),
                       ("weight_bus.update_policy", policy)):
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        assert "=" in str(exc)  # the message names the key and its value
        return
    steps = 3 * (cfg.weight_bus.sync_every + cfg.buffer.max_staleness + 1)
    assert learner_steps_served(cfg, steps) == steps, overrides


@pytest.mark.parametrize(("mode", "eta", "sync_every"), [("sync", 0, 2), ("fully_async", 1, 3)])
def test_the_simulation_sees_a_starving_bound(mode: str, eta: int, sync_every: int) -> None:
    """The property above can fail: a config validate() rejects starves in the simulation."""
    from streamrl.config import replace, with_mode

    cfg = replace(with_mode(Config(), mode, eta if mode == "fully_async" else None),
                  **{"weight_bus.sync_every": sync_every, "task.train_batch_size": 2})
    with pytest.raises(ConfigError, match=r"weight_bus\.sync_every"):
        load_config([f"trainer.mode={mode}", f"buffer.max_staleness={eta}",
                     f"weight_bus.sync_every={sync_every}"])
    assert learner_steps_served(cfg, 10) < 10
