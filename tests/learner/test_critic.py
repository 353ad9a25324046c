"""The critic (value model) learns a constant return; GAE forces it on; critic.loss_agg_mode."""

from __future__ import annotations

import pytest
import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config


def test_critic_learns_a_constant_return(tiny_model_dir, tmp_path) -> None:
    cfg = make_config(tiny_model_dir, tmp_path, **{
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-2, "critic.ppo_epochs": 2,
        "critic.cliprange_value": 0.5, "actor.optim.lr": 1e-6, "trainer.total_steps": 100,
    })
    assert cfg.use_critic
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    batch = make_batch(seed=7)
    mask = batch["response_mask"]
    target = 1.0
    history = []
    for _ in range(8):
        prepared = worker.prepare(batch)
        values = prepared["values"]
        returns = torch.full_like(values, target) * mask
        tensors = {**prepared.tensors, "returns": returns, "advantages": torch.zeros_like(values)}
        metrics = worker.update(Batch(tensors, prepared.non_tensors, prepared.meta))
        history.append((metrics["critic/vf_loss"], float(algos.masked_mean(values, mask))))
    final = worker.prepare(batch)["values"]
    assert history[0][1] == 0.0  # zero-initialised head
    assert history[-1][0] < 0.05 * history[0][0], history
    assert abs(float(algos.masked_mean(final, mask)) - target) < 0.1
    assert float((final - target).abs()[mask.bool()].max()) < 0.3


def test_critic_loss_agg_mode_reaches_the_value_loss(tiny_model_dir, tmp_path) -> None:
    """Zero head, returns 1: every valid token's clipped loss is 0.5 * 1, so token-mean gives
    0.5 and token-sum 0.5 x the mini-batch's valid tokens, and the gradient scales alike."""
    batch = make_batch(seed=7)
    mask = batch["response_mask"]
    tokens = float(mask.sum())
    results = {}
    for mode in ("token-mean", "token-sum"):
        cfg = make_config(tiny_model_dir, tmp_path, **{
            "algorithm.adv_estimator": "gae", "critic.loss_agg_mode": mode,
            "critic.ppo_epochs": 1, "actor.grad_clip": 0.0,
        })
        worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
        prepared = worker.prepare(batch)
        assert float(prepared["values"].abs().max()) == 0.0  # zero-initialised head
        returns = torch.ones_like(prepared["values"]) * mask
        tensors = {**prepared.tensors, "returns": returns,
                   "advantages": torch.zeros_like(returns)}
        results[mode] = worker.update(Batch(tensors, prepared.non_tensors, prepared.meta))
    mean, total = results["token-mean"], results["token-sum"]
    assert mean["critic/vf_loss"] == pytest.approx(0.5)
    assert total["critic/vf_loss"] == pytest.approx(0.5 * tokens)
    assert total["critic/grad_norm"] == pytest.approx(tokens * mean["critic/grad_norm"], rel=1e-4)
