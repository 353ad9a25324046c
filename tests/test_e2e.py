"""End to end: `streamrl train` with real vLLM replicas, FSDP2 learner, gloo weight bus, Ray.

Each mode must raise the toy task's mean reward over its first steps while every consumed
batch respects the mode's staleness bound, and so must ``algorithm=dapo`` while training on
informative groups only; one run uses a real redis-server buffer; a run killed
mid-training (SIGKILL of the whole process group) resumes from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.config import load_config
from streamrl.controller import run_training

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 30
DAPO_STEPS = 16
# A faster learning rate than the demo default so the rise shows within STEPS updates.
COMMON = ["runtime.num_cpus=2", "trainer.logger=[jsonl]", "actor.optim.lr=3e-3",
          "task.train_batch_size=16", "actor.ppo_mini_batch_size=16"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize(("mode", "eta"), [("sync", 0), ("one_step_off", 1), ("fully_async", 2)])
def test_mode_learns_within_staleness_bound(
    mode: str, eta: int, tmp_path: Path, tiny_model_dir: Path
) -> None:
    bound = ["buffer.max_staleness=2"] if mode == "fully_async" else []
    cfg = load_config([*COMMON, *bound, f"model.path={tiny_model_dir}", f"trainer.mode={mode}",
                       f"trainer.total_steps={STEPS}", f"trainer.output_dir={tmp_path}"])
    assert cfg.buffer.max_staleness == eta
    result = run_training(cfg)
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


# Run by hand (pytest -m manual tests/test_e2e.py -k dapo) until it fits the suite: on the toy
# "rep" task ~3 in 4 groups are filtered early on, and under Ray the fleet then delivered ~1
# group/s (the first step alone took ~130 s in both measured runs; not yet understood: the same
# Replica and engine in one process sample > 20 groups/s). Measured while a benchmark shared
# the 2 cores: 16 steps took ~6.5 min and the reward rose -0.93 -> -0.39 (mostly by stopping
# before the overlong zone: length 7.7 -> 3.3); at 12 steps another run rose only
# -0.92 -> -0.87, below the bar.
@pytest.mark.manual
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
