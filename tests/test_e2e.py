"""End to end: `streamrl train` with real vLLM replicas, FSDP2 learner, gloo weight bus, Ray.

Each mode must raise the toy task's mean reward over its first steps while every consumed
batch respects the mode's staleness bound (fully_async on an emulated three-node Ray cluster,
where no rendezvous may bind loopback), and so must ``algorithm=dapo`` while training on
informative groups only (``algorithm=remax`` too, run by hand: it learns slowly on the sparse
toy task); one run uses a real redis-server buffer; a run killed mid-training (SIGKILL of the
whole process group) resumes from its checkpoint; a co-located hybrid run (learner and engine in
one actor, weights swapped in place) learns, validates, checkpoints and resumes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from streamrl.config import load_config
from streamrl.controller import Controller, TrainResult, run_training
from tests.support.cluster import emulated_cluster, node_of

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 30
DAPO_STEPS = 16
REMAX_STEPS = 60
# A faster learning rate than the demo default so the rise shows within STEPS updates.
COMMON = ["runtime.num_cpus=2", "trainer.logger=[jsonl]", "actor.optim.lr=3e-3",
          "task.train_batch_size=16", "actor.ppo_mini_batch_size=16"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize(("mode", "eta"), [("sync", 0), ("one_step_off", 1)])
def test_mode_learns_within_staleness_bound(
    mode: str, eta: int, tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", f"trainer.mode={mode}",
                       f"trainer.total_steps={STEPS}", f"trainer.output_dir={tmp_path}"])
    assert cfg.buffer.max_staleness == eta
    _assert_learns(run_training(cfg), mode, eta, tmp_path)


def test_fully_async_learns_across_nodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The fully_async case of the test above, on three emulated nodes placed by labels: the
    learner on A, one replica on each of B and C. Every rendezvous binds on its node's Ray IP,
    none on loopback."""
    import ray

    from streamrl.net import address_towards
    from streamrl.runtime import build_runtime

    mode, eta = "fully_async", 2
    with emulated_cluster({"num_cpus": 1, "labels": {"pool": "train"}},
                          {"num_cpus": 1, "labels": {"pool": "rollout"}},
                          {"num_cpus": 1, "labels": {"pool": "rollout"}}) as cluster:
        node_a = cluster.head_node.node_id
        cfg = load_config([
            *COMMON, f"model.path={tiny_model_dir}", f"trainer.mode={mode}",
            f"buffer.max_staleness={eta}", f"trainer.total_steps={STEPS}",
            f"trainer.output_dir={tmp_path}", f"runtime.address={cluster.address}",
            "runtime.train_pool.labels={pool:train}", "runtime.rollout_pool.labels={pool:rollout}",
            "runtime.rollout_pool.strategy=STRICT_SPREAD", "rollout.num_replicas=2"])
        torch.manual_seed(cfg.trainer.seed)  # as run_training, which keeps no runtime to ask
        with build_runtime(cfg) as runtime:
            result = Controller(cfg, runtime).fit()
            assert runtime.learner is not None
            [learner] = runtime.learner.actors
            bound = ray.get(learner.bound_addresses.remote(), timeout=60)
            replica_nodes = [node_of(r) for r in runtime.fleet.replicas]
            # What a replica's weight-group socket binds: its route to the learner's store.
            replica_binds = ray.get([r.__ray_call__.remote(
                lambda _self, host=bound["weight_bus.store"]: address_towards(host))
                for r in runtime.fleet.replicas], timeout=60)
            learner_node = node_of(learner)
    assert learner_node == node_a
    assert len(set(replica_nodes)) == 2 and node_a not in replica_nodes
    node_ip = bound.pop("node")
    assert sorted(bound) == ["learner.gloo", "learner.rendezvous", "weight_bus.control",
                             "weight_bus.store"]
    for what, address in [*bound.items(), *(("replica weight group", a) for a in replica_binds)]:
        host = address.removeprefix("tcp://").rsplit(":", 1)[0]
        assert host == node_ip and not ipaddress.ip_address(host).is_loopback, (what, address)
    _assert_learns(result, mode, eta, tmp_path)


def test_colocated_sync_learns_validates_and_resumes(tmp_path: Path, tiny_model_dir: Path
                                                    ) -> None:
    """``runtime.placement=colocated weight_bus.backend=colocated``: one hybrid worker holds
    the learner rank and its engine; the same guard as the disaggregated modes, plus
    validation, checkpoints and a resume, which behave as they do there."""
    args = [*COMMON, f"model.path={tiny_model_dir}", "trainer.mode=sync",
            "runtime.placement=colocated", "weight_bus.backend=colocated",
            f"trainer.output_dir={tmp_path}", "trainer.test_freq=15", "trainer.save_freq=15"]
    result = run_training(load_config([*args, f"trainer.total_steps={STEPS}"]))
    _assert_learns(result, "sync", 0, tmp_path)
    validated = [h for h in result.history if "val/reward/mean" in h]
    assert [h["step"] for h in validated] == [15, 30]
    assert result.checkpoint is not None and result.checkpoint.endswith(f"_{STEPS}")
    assert all(h["weight_bus/seconds"] > 0 for h in result.history)
    resumed = run_training(load_config([*args, "trainer.resume=auto",
                                        f"trainer.total_steps={STEPS + 2}"]))
    assert [h["step"] for h in resumed.history] == [STEPS + 1, STEPS + 2]
    # On-policy from the resumed weights: the engine got them in place at resume.
    assert max(h["rollout/logprob_abs_diff"] for h in resumed.history) < 1e-3


def _assert_learns(result: TrainResult, mode: str, eta: int, tmp_path: Path) -> None:
    history = result.history
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    rewards = [h["reward/mean"] for h in history]
    first, last = _mean(rewards[:3]), _mean(rewards[-5:])
    print(f"{mode}: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.02 and last > 2 * first, rewards
    assert max(h["staleness/max"] for h in history) <= eta
    assert history[-1]["buffer/dropped"] == 0
    if mode == "sync":  # on-policy: the engine's log-probs are the learner's own
        assert max(h["rollout/logprob_abs_diff"] for h in history) < 1e-3
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS and json.loads(lines[-1])["step"] == STEPS


# Measured 38 s, reward -0.935 -> -0.459 (length 7.72 -> 3.57; 256 groups filtered of 526
# sampled). It ran ~1 group/s, 6.5 min, until the buffer actor stopped being an async actor.
def test_dapo_learns_with_dynamic_sampling(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", "algorithm=dapo",
                       f"trainer.total_steps={DAPO_STEPS}", f"trainer.output_dir={tmp_path}"])
    assert cfg.rollout.filter_groups and cfg.rollout.overlong_buffer.enable
    result = run_training(cfg)
    history = result.history
    assert [h["step"] for h in history] == list(range(1, DAPO_STEPS + 1))
    # Dynamic sampling: no zero-variance group was trained on, yet every batch was full, and
    # every filtered group's admission came back.
    assert all(h["groups/with_signal"] == 1.0 for h in history)
    assert history[-1]["replica/groups_filtered"] > 0
    for h in history:
        assert h["buffer/started"] == h["buffer/consumed"] + h["buffer/queued"] + h[
            "buffer/in_flight"], h
    assert max(h["staleness/max"] for h in history) <= cfg.buffer.max_staleness
    rewards = [h["reward/mean"] for h in history]
    first, last = _mean(rewards[:3]), _mean(rewards[-5:])
    lengths = [h["response_length/mean"] for h in history]
    print(f"dapo: reward {first:.3f} -> {last:.3f}, length {lengths[0]:.2f} -> {lengths[-1]:.2f}, "
          f"{history[-1]['replica/groups_filtered']:.0f} groups filtered, "
          f"{history[-1]['replica/groups']:.0f} put")
    assert last > first + 0.1, rewards


# Run by hand (pytest -m manual tests/test_e2e.py -k remax): ReMax's advantage is the reward
# minus the greedy response's, unnormalized, so on the sparse toy task (most rewards 0, a hit
# 1/8) it learns slowly and unreliably: in one run of these 60 sync steps (70 s) the reward went
# 0.005 over the first 10 steps -> 0.057 over the last 10 (late steps bouncing between 0.0 and
# 0.17); a second run failed the bar; 40 steps rose only to 0.02; lr 1e-2 / 3e-2 did not learn;
# with the dense tiny reward model (reward.kind=model) the greedy baseline rose to 0.28 while the
# samples stayed near 0.01, so nearly every advantage was negative. GRPO passes in 30 steps.
@pytest.mark.manual
def test_remax_learns_against_its_greedy_baseline(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", "algorithm=remax",
                       "trainer.mode=sync", f"trainer.total_steps={REMAX_STEPS}",
                       f"trainer.output_dir={tmp_path}"])
    history = run_training(cfg).history
    assert [h["step"] for h in history] == list(range(1, REMAX_STEPS + 1))
    assert all(0.0 <= h["reward/greedy_baseline"] <= 1.0 for h in history)
    rewards = [h["reward/mean"] for h in history]
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    print(f"remax: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.02 and last > 2 * first, rewards


def test_redis_buffer_end_to_end(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    import redis

    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", "buffer=redis",
                       f"buffer.redis_url={redis_url}", "buffer.run=e2e", "trainer.total_steps=4",
                       f"trainer.output_dir={tmp_path}"])
    result = run_training(cfg)
    assert result.steps == 4
    stats = redis.Redis.from_url(redis_url, decode_responses=True).hgetall("streamrl:e2e:stats")
    assert int(stats["learner_version"]) == 4
    assert int(stats["consumed"]) == 4 * 16
    assert int(stats["dropped"]) == 0


def test_killed_run_resumes_from_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    args = [*COMMON, f"model.path={tiny_model_dir}", "trainer.save_freq=2",
            f"trainer.output_dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "train", *args, "trainer.total_steps=200"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    latest = tmp_path / "latest"
    try:
        deadline = time.monotonic() + 300
        while not (latest.exists() and latest.read_text().strip().endswith("_4")):
            assert proc.poll() is None, "training exited before its checkpoint at step 4"
            assert time.monotonic() < deadline, "no checkpoint at step 4 within 300 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # driver, Ray head and every actor: no clean-up
        proc.wait()
    saved = int(latest.read_text().strip().rsplit("_", 1)[1])
    assert saved >= 4
    cfg = load_config([*args, "trainer.resume=auto", f"trainer.total_steps={saved + 2}"])
    result = run_training(cfg)
    assert [h["step"] for h in result.history] == [saved + 1, saved + 2]
    assert result.checkpoint is not None and result.checkpoint.endswith(f"_{saved + 2}")
