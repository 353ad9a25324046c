"""The critic (value model) learns a constant return; GAE forces it on."""

from __future__ import annotations

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
