"""Actor / reference policy / LearnerWorker at world size 1 (real FSDP2 on a gloo group)."""

from __future__ import annotations

import dataclasses
import logging
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.learner.actor import policy_loss_config
from streamrl.learner.forward import MicroBatch, value_forward
from streamrl.learner.fsdp import load_causal_lm, load_value_model
from streamrl.learner.logprobs import policy_log_probs
from streamrl.learner.optim import lr_factor
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config, with_advantages

CPU = torch.device("cpu")


def make_worker(model_dir: Path, out: Path, **overrides) -> LearnerWorker:
    cfg = make_config(model_dir, out, **overrides)
    return LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())


def weights(worker: LearnerWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.named_full_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_packed_and_padded_forward_agree(tiny_model_dir: Path) -> None:
    batch = make_batch(3, 4, seed=3)
    rows = [0, 2, 5, 7, 11]
    model = load_causal_lm(tiny_model_dir, CPU)
    packed = policy_log_probs(model, MicroBatch.of(batch, rows, True), CPU, with_entropy=True)
    padded = policy_log_probs(model, MicroBatch.of(batch, rows, False), CPU, with_entropy=True)
    valid = batch["attention_mask"][rows, -batch["responses"].shape[1]:].bool()
    assert valid.sum() > 20 and (~valid).any()  # ragged: both layouts see padding
    torch.testing.assert_close(packed[0], padded[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(packed[1], padded[1], atol=2e-5, rtol=0)
    assert (packed[0][~valid] == 0).all() and (packed[0][valid] < 0).all()
    # Without the block-diagonal mask, later sequences would attend to earlier ones.
    solo = policy_log_probs(model, MicroBatch.of(batch, [rows[-1]], True), CPU)[0]
    torch.testing.assert_close(packed[0][-1:], solo, atol=2e-5, rtol=0)
    critic = load_value_model(tiny_model_dir, CPU)
    torch.nn.init.normal_(critic.score.weight)
    v_packed = value_forward(critic, MicroBatch.of(batch, rows, True), CPU)
    v_padded = value_forward(critic, MicroBatch.of(batch, rows, False), CPU)
    torch.testing.assert_close(v_packed, v_padded, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dynamic", [True, False])
def test_ratio_is_exactly_one_at_first_inner_step(tiny_model_dir, tmp_path, dynamic) -> None:
    # One mini-batch: prepare leaves the proximal log-probs to the update's first forward.
    worker = make_worker(tiny_model_dir, tmp_path, **{"actor.use_dynamic_bsz": dynamic})
    batch = worker.prepare(make_batch())
    assert "old_log_probs" not in batch and not worker.cfg.prepare_adds_tensors
    start = worker.actor.compute_log_prob(batch)
    metrics = worker.update(with_advantages(batch, worker.cfg))
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/grad_norm"] > 0 and worker.version == 1
    mismatch = algos.masked_mean((batch["rollout_log_probs"] - start).abs(),
                                 batch["response_mask"])
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(float(mismatch), rel=1e-5)
    # Two mini-batches: prepare recomputes them; later inner steps see moved weights.
    worker2 = make_worker(tiny_model_dir, tmp_path, **{"actor.use_dynamic_bsz": dynamic,
                                                       "actor.ppo_mini_batch_size": 2,
                                                       "actor.ppo_epochs": 2})
    batch = worker2.prepare(make_batch())
    assert not torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert worker2.update(with_advantages(batch, worker2.cfg))["actor/ppo_kl"] != 0.0


@pytest.mark.parametrize("overrides", [
    {},
    {"actor.use_dynamic_bsz": False, "actor.policy_loss": "decoupled", "actor.tis_cap": None},
], ids=["packed-tis", "padded-decoupled"])
def test_proximal_from_the_first_forward_equals_a_pass_of_its_own(
        tiny_model_dir, tmp_path, overrides) -> None:
    """Two epochs: the second one's proximal log-probs come from the first one's forward; the
    update is the one it makes with them recomputed by a separate pass beforehand."""
    torch.manual_seed(0)
    batch = with_advantages(make_batch(seed=2), make_config(tiny_model_dir, tmp_path))
    cfg = {"actor.ppo_epochs": 2, **overrides}
    results = {}
    for name in ("fused", "separate"):
        worker = make_worker(tiny_model_dir, tmp_path, **cfg)
        given = batch
        if name == "separate":
            old = worker.actor.compute_log_prob(batch)
            given = batch.union(Batch({"old_log_probs": old}))
        results[name] = (worker.update(given), weights(worker))
    (fused, w_fused), (separate, w_separate) = results["fused"], results["separate"]
    assert fused["actor/ppo_kl"] != 0.0  # the second epoch trains on moved weights
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "rollout/logprob_abs_diff"):
        assert fused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-7), key
    assert max_diff(w_fused, w_separate) < 1e-6


def test_micro_batch_split_does_not_change_the_update(tiny_model_dir, tmp_path) -> None:
    splits = {
        "budget": {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len": 40},
        "one_group": {"actor.use_dynamic_bsz": False, "actor.ppo_micro_batch_size": 1},
        "whole": {"actor.use_dynamic_bsz": False, "actor.ppo_micro_batch_size": 4},
    }
    batch = make_batch()
    results = {}
    for name, overrides in splits.items():
        # Without the (default) truncated IS weights: this is about the split, not the weights.
        worker = make_worker(tiny_model_dir, tmp_path, **{
            "actor.grad_clip": 0.0, "actor.tis_cap": None, **overrides})
        old = worker.actor.compute_log_prob(batch)
        metrics = worker.update(with_advantages(worker.prepare(batch), worker.cfg))
        results[name] = (metrics, weights(worker), old)
    ref_metrics, ref_weights, ref_lp = results["whole"]
    initial = weights(make_worker(tiny_model_dir, tmp_path))
    moved = max_diff(ref_weights, initial)
    for name in ("budget", "one_group"):
        metrics, w, lp = results[name]
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        # AdamW's first step is ~lr * sign(g): coordinates with |g| ~ eps amplify fp noise
        assert max_diff(w, ref_weights) < 1e-2 * moved, name


@pytest.mark.parametrize("overrides", [
    {"actor.policy_loss": "gspo"},
    {"actor.policy_loss": "cispo"},
    {"actor.policy_loss": "decoupled", "actor.tis_cap": None},
    {"actor.tis_cap": 2.0, "actor.clip_ratio_high": 0.28},
    {"actor.icepop_low": 0.5, "actor.icepop_high": 2.0, "actor.recompute_log_prob": False,
     "actor.tis_cap": None},
    {"actor.rejection_low": 0.5, "actor.rejection_high": 2.0,
     "actor.loss_agg_mode": "seq-mean-token-sum-norm", "actor.entropy_coeff": 0.01},
    {"actor.rollout_rs": "token_k1,seq_mean_k3", "actor.rollout_rs_threshold": "0.95_1.05,0.01",
     "actor.loss_agg_mode": "token-sum"},
], ids=["gspo", "cispo", "decoupled", "tis", "icepop-bypass", "rejection", "rollout-rs"])
def test_policy_loss_modes_train(tiny_model_dir, tmp_path, overrides) -> None:
    worker = make_worker(tiny_model_dir, tmp_path, **overrides)
    before = weights(worker)
    batch = make_batch(seed=5)
    # behaviour log-probs near the model's own, so corrections keep most tokens
    batch.tensors["rollout_log_probs"] = worker.actor.compute_log_prob(batch) + 0.05 * (
        torch.randn_like(batch["rollout_log_probs"]) * batch["response_mask"])
    metrics = worker.update(with_advantages(worker.prepare(batch), worker.cfg))
    if overrides.get("actor.recompute_log_prob") is False:  # bypass: proximal = behaviour
        assert metrics["rollout/logprob_abs_diff"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["actor/skipped_steps"] == 0 and max_diff(weights(worker), before) > 0
    if worker.cfg.actor.tis_cap is not None or "actor.icepop_low" in overrides:
        assert "rollout_corr/kl" in metrics
    if "actor.rollout_rs" in overrides:  # |noise| > ~0.05 fails token_k1: some, not all
        assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1, metrics
        assert "rollout_corr/rollout_rs_token_k1_masked_fraction" in metrics
        assert "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction" in metrics


TIS_METRICS = ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_ratio_fraction_high"]


@pytest.mark.parametrize(("overrides", "binding"), [
    ({"actor.policy_loss": "reinforce", "actor.recompute_log_prob": False, "actor.tis_cap": 1.02},
     TIS_METRICS),
    ({"actor.tis_cap": 1.02, "actor.rollout_is_batch_normalize": True},
     [*TIS_METRICS, "rollout_corr/rollout_is_batch_norm_factor"]),
    ({"actor.rollout_rs": "token_k1", "actor.rollout_rs_threshold": "0.95_1.05"},
     ["rollout_corr/rollout_rs_masked_fraction"]),
    ({"actor.recompute_log_prob": False, "actor.tis_cap": None, "actor.icepop_low": 0.97,
      "actor.icepop_high": 1.03}, ["rollout_corr/icepop_maskfrac"]),
    ({"actor.tis_cap": None, "actor.icepop_low": 0.9, "actor.icepop_high": 1.1,
      "actor.icepop_level": "sequence"}, ["rollout_corr/icepop_maskfrac"]),
], ids=["reinforce-bypass-tis", "tis-batch-normalised", "rollout-rs", "icepop-bypass",
        "icepop-sequence"])
def test_update_loss_is_the_algos_loss(tiny_model_dir, tmp_path, overrides, binding) -> None:
    """One epoch, one mini-batch: the micro-batch losses the update sums (and its token-mean
    metrics) are algos' loss over the whole batch at the starting weights, which the correction
    changes. Rejected tokens leave the denominators of the whole mini-batch (the actor's
    pre-pass counts them over every micro-batch) and a batch-normalised IS weight is divided by
    the mini-batch's mean, not by each micro-batch's."""
    worker = make_worker(tiny_model_dir, tmp_path, **overrides)
    batch = make_batch(seed=5)
    torch.manual_seed(0)
    batch.tensors["rollout_log_probs"] = worker.actor.compute_log_prob(batch) + 0.05 * (
        torch.randn_like(batch["rollout_log_probs"]) * batch["response_mask"])
    prepared = with_advantages(worker.prepare(batch), worker.cfg)
    log_prob = worker.actor.compute_log_prob(prepared)
    loss_cfg = policy_loss_config(worker.cfg)
    old = prepared["rollout_log_probs"] if loss_cfg.bypass else log_prob
    args = (old, log_prob, prepared["advantages"], prepared["response_mask"])
    expected, expected_metrics = algos.compute_policy_loss_from_config(
        loss_cfg, *args, rollout_log_prob=prepared["rollout_log_probs"])
    uncorrected, _ = algos.compute_policy_loss_from_config(
        algos.PolicyLossConfig(loss_mode=loss_cfg.loss_mode, bypass=loss_cfg.bypass), *args,
        rollout_log_prob=prepared["rollout_log_probs"])
    assert abs(float(expected - uncorrected)) > 1e-4  # the correction matters here
    assert len(worker.actor.planner(prepared)[0]) > 1  # several micro-batches to add up
    metrics = worker.update(prepared)
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/grad_norm"] > 0
    assert metrics["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    for key in ["actor/ppo_kl", "rollout_corr/kl", *binding]:
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    if "rollout_corr/rollout_is_batch_norm_factor" not in binding:
        assert 0 < metrics[binding[-1]] < 1  # the cap / the rejection binds on some tokens


def test_kl_loss_against_frozen_reference(tiny_model_dir, tmp_path) -> None:
    worker = make_worker(tiny_model_dir, tmp_path, **{"actor.use_kl_loss": True,
                                                      "actor.kl_loss_coef": 0.1,
                                                      "actor.kl_loss_type": "low_var_kl"})
    batch = make_batch()
    prepared = worker.prepare(batch)
    start = worker.actor.compute_log_prob(batch)
    assert torch.equal(prepared["ref_log_prob"], start)
    metrics = worker.update(with_advantages(prepared, worker.cfg))
    assert metrics["actor/kl_loss"] == 0.0 and metrics["actor/kl_coef"] == 0.1
    again = worker.prepare(batch)
    assert torch.equal(again["ref_log_prob"], prepared["ref_log_prob"])  # frozen
    assert not torch.equal(worker.actor.compute_log_prob(batch), start)  # trained
    assert worker.update(with_advantages(again, worker.cfg))["actor/kl_loss"] > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_skips_the_step(tiny_model_dir, tmp_path, bad) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    before = weights(worker)
    batch = with_advantages(worker.prepare(make_batch()), worker.cfg)
    batch.tensors["advantages"][0, 0] = bad
    metrics = worker.update(batch)
    assert metrics["actor/skipped_steps"] == 1
    assert max_diff(weights(worker), before) == 0
    assert not worker.actor.optimizer.state  # AdamW never stepped
    # a clean batch afterwards trains normally
    clean = with_advantages(worker.prepare(make_batch()), worker.cfg)
    assert worker.update(clean)["actor/skipped_steps"] == 0
    assert max_diff(weights(worker), before) > 0


def test_batch_without_valid_tokens_is_skipped(tiny_model_dir, tmp_path, caplog) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    before = weights(worker)
    batch = make_batch()
    batch.tensors["response_mask"] = torch.zeros_like(batch["response_mask"])
    with caplog.at_level(logging.WARNING):
        metrics = worker.update(with_advantages(worker.prepare(batch), worker.cfg))
    assert metrics["actor/empty_minibatches"] == 1 and metrics["actor/skipped_steps"] == 0
    assert "without valid tokens" in caplog.text
    assert max_diff(weights(worker), before) == 0


def test_lr_warmup_then_cosine(tiny_model_dir, tmp_path) -> None:
    kw = {"warmup_steps": 2, "total_steps": 6, "schedule": "cosine", "min_lr_ratio": 0.1}
    factors = [lr_factor(s, **kw) for s in range(7)]
    assert factors[:3] == [0.5, 1.0, 1.0] and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in pairwise(factors[1:]))
    worker = make_worker(tiny_model_dir, tmp_path, **{"actor.optim.warmup_steps": 2})
    batch = with_advantages(worker.prepare(make_batch()), worker.cfg)
    lrs = [worker.update(batch)["actor/lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_full_parameters_have_hf_names_and_dtype(tiny_model_dir, tmp_path) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    reference = load_causal_lm(tiny_model_dir, CPU)
    expected = dict(reference.named_parameters())
    got = dict(worker.named_full_parameters(torch.bfloat16))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, expected[name].detach().to(torch.bfloat16))


def test_dr_grpo_horizon_is_the_response_budget(tmp_path) -> None:
    """seq-mean-token-sum-norm divides by a constant: the configured budget (verl pads every
    response to it), not the widest response of a batch, unless actor.loss_scale_factor says."""
    def factor(**overrides: object) -> float | None:
        cfg = make_config(tmp_path, tmp_path, **{"actor.loss_agg_mode": "seq-mean-token-sum-norm",
                                                 **overrides})
        return policy_loss_config(cfg).loss_scale_factor

    assert factor() == 16  # rollout.max_new_tokens
    assert factor(**{"actor.loss_scale_factor": 100.0}) == 100.0
    assert factor(**{"rollout.agent": "calculator",
                     "rollout.max_episode_tokens": 40}) == 40
    # a batch 5 tokens wide: its loss divides by 16 per sequence, not by 5
    loss_cfg = algos.PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm",
                                      loss_scale_factor=factor())
    log_prob = torch.zeros(2, 5)
    loss, _ = algos.compute_policy_loss_from_config(
        loss_cfg, log_prob, log_prob, torch.ones(2, 5), torch.ones(2, 5))
    assert float(loss) == pytest.approx(-5 / 16)


def test_every_policy_loss_setting_comes_from_the_config(tmp_path) -> None:
    cfg = make_config(tmp_path, tmp_path, **{
        "actor.policy_loss": "decoupled", "actor.tis_cap": None,
        "actor.gspo_clip_ratio_low": 3e-4, "actor.gspo_clip_ratio_high": 4e-4,
        "actor.cispo_clip_ratio_high": 5.0, "actor.decoupled_weight_cap": 4.0,
        "actor.icepop_level": "sequence"})
    loss_cfg = policy_loss_config(cfg)
    assert loss_cfg.clip_range("gspo") == (3e-4, 4e-4)
    assert loss_cfg.clip_range("cispo") == (0.2, 5.0)
    assert loss_cfg.decoupled_weight_cap == 4.0 and loss_cfg.icepop_level == "sequence"
    # every field at once: each one takes a value other than its default from the config
    cfg = make_config(tmp_path, tmp_path, **{
        "actor.policy_loss": "reinforce", "actor.recompute_log_prob": False,
        "actor.clip_ratio": 0.3, "actor.clip_ratio_low": 0.1, "actor.clip_ratio_high": 0.28,
        "actor.clip_ratio_c": 4.0, "actor.gspo_clip_ratio_low": 3e-4,
        "actor.gspo_clip_ratio_high": 4e-4, "actor.cispo_clip_ratio_low": 0.5,
        "actor.cispo_clip_ratio_high": 5.0, "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.loss_scale_factor": 100.0, "actor.tis_cap": 1.5,
        "actor.rollout_is_level": "sequence", "actor.rollout_is_batch_normalize": True,
        "actor.icepop_low": 0.5, "actor.icepop_high": 2.0, "actor.icepop_level": "sequence",
        "actor.rejection_low": 0.8, "actor.rejection_high": 1.2, "actor.rollout_rs": "token_k1",
        "actor.rollout_rs_threshold": "0.5_2.0", "actor.decoupled_weight_cap": 4.0})
    loss_cfg = policy_loss_config(cfg)
    assert [f.name for f in dataclasses.fields(loss_cfg)
            if getattr(loss_cfg, f.name) == f.default] == []
