"""Learner test support: random groups and batches, a small config, a rank launcher.

Kept in a plain module (not conftest) so spawned rank processes can import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, replace, validate
from streamrl.net import free_port
from streamrl.testing import random_groups

PAD = 0


def make_batch(num_groups: int = 4, n: int = 4, seed: int = 0, **kw: Any) -> Batch:
    return Batch.from_groups(random_groups(num_groups, n, seed=seed, **kw), PAD)


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
