"""Learner test support: random groups and batches, a small config, a rank launcher.

Kept in a plain module (not conftest) so spawned rank processes can import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, replace, validate
from streamrl.learner.forward import MicroBatch
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


def logits_policy_forward(
    model: nn.Module,
    mb: MicroBatch,
    device: torch.device,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference: (log_probs, entropy or None) from the model's full logits (what
    ``logprobs.policy_log_probs`` computes in the LM head), each [n, R] fp32, zeros on padding.

    Logits are divided by the sampling ``temperature`` first and cut to the ``top_k`` /
    ``top_p`` set, so the log-probs are those of the distribution the rollout sampled from.
    """

    def scored(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor | None]:
        return algos.chunked_log_probs(logits, labels, top_k=top_k, top_p=top_p,
                                       with_entropy=with_entropy, entropy_grad=with_entropy)

    if mb.packed:
        pb = mb.batch.pack(mb.rows).to(device)
        keep = pb.predict_mask[0].nonzero().squeeze(-1)
        logits = model(
            input_ids=pb.input_ids, position_ids=pb.position_ids, use_cache=False,
            logits_to_keep=keep, **pb.attention_kwargs,
        ).logits[0]
        logits = logits / temperature if temperature != 1.0 else logits
        total = pb.num_tokens
        lp, ent = scored(logits, pb.targets[0, keep])
        log_probs = pb.unpack_response(logits.new_zeros(total).index_put((keep,), lp))
        entropy = (pb.unpack_response(logits.new_zeros(total).index_put((keep,), ent))
                   if ent is not None else None)
        return log_probs, entropy
    responses = mb.column("responses", device)
    width = responses.shape[1]
    logits = model(
        input_ids=mb.column("input_ids", device),
        attention_mask=mb.column("attention_mask", device),
        position_ids=mb.column("position_ids", device),
        use_cache=False,
        logits_to_keep=width + 1,
    ).logits[:, :-1]
    logits = logits / temperature if temperature != 1.0 else logits
    log_probs, entropy = scored(logits, responses)
    # Zero the padding positions, as the packed layout does, so both layouts agree exactly.
    valid = mb.column("attention_mask", device)[:, -width:].to(log_probs.dtype)
    return log_probs * valid, (entropy * valid if entropy is not None else None)
