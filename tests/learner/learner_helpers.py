"""Shared helpers for the learner tests: hand-made groups, a small config, a rank launcher.

Kept in a plain module (not conftest) so spawned rank processes can import it.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, replace, validate
from streamrl.types import Group, Trajectory

PAD = 0


def make_groups(
    num_groups: int, n: int, *, seed: int = 0, vocab: int = 300, observation: bool = True
) -> list[Group]:
    """Random token groups with ragged prompt/response lengths and a few observation tokens."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        gid = f"g{seed}-{g}"
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        trajs = []
        for i in range(n):
            r = rng.randint(2, 14)
            mask = [1] * r
            if observation and r > 6 and i % 2:
                mask[2:4] = [0, 0]  # an interior tool observation
            trajs.append(Trajectory(
                uid=f"{gid}-{i}", group_id=gid, prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(r)], loss_mask=mask,
                logprobs=[-rng.uniform(4.0, 7.0) if m else 0.0 for m in mask],
                versions=[0 if m else -1 for m in mask], reward=rng.random(),
            ))
        groups.append(Group(group_id=gid, trajectories=trajs))
    return groups


def make_batch(num_groups: int = 4, n: int = 4, seed: int = 0, **kw: Any) -> Batch:
    return Batch.from_groups(make_groups(num_groups, n, seed=seed, **kw), PAD)


def make_config(model_dir: str | Path, out_dir: str | Path, **overrides: Any) -> Config:
    base = {
        "model.path": str(model_dir),
        "trainer.output_dir": str(out_dir),
        "trainer.total_steps": 10,
        "task.train_batch_size": 4,
        "task.max_prompt_length": 16,
        "rollout.max_new_tokens": 16,
        "rollout.n": 4,
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size": 1,
        "actor.ppo_max_token_len": 64,
        "actor.ppo_epochs": 1,
        "actor.optim.lr": 1e-3,
        "learner.device": "cpu",
    }
    base.update(overrides)
    return validate(replace(Config(), **base))


def with_advantages(batch: Batch, cfg: Config) -> Batch:
    """GRPO (or GAE with a critic) advantages, as the controller computes them."""
    data = {**batch.tensors, "token_level_rewards": batch["token_level_scores"],
            "index": batch.non_tensors["index"]}
    adv, ret = algos.compute_advantage(
        data, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, index_key="index",
    )
    tensors = {**batch.tensors, "advantages": adv, "returns": ret}
    return Batch(tensors, dict(batch.non_tensors), dict(batch.meta))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result = fn(rank, world, port, *args)
    torch.save(result, f"{out}.rank{rank}")


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, tmp: Path) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; their results."""
    port = free_port()
    out = str(tmp / "result")
    torch.multiprocessing.spawn(_rank_main, args=(world, port, fn, args, out), nprocs=world,
                                join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]
