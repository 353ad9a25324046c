"""The learner cannot tell ``sync`` from ``one_step_off`` on a batch of staleness 0 (issue 41).

Modes are presets (``config.MODE_PRESETS``, ``configs/mode/*.yaml``): they fix the staleness bound
and the replicas' update policy, and nothing the learner reads. So the same seed, weights and batch
must give bit-identical per-token losses and gradients in both modes when the batch was sampled by
the weights being trained (staleness 0: every batch in ``sync``, the first in ``one_step_off``).
A mode preset that reached the learner (a rollout correction, bypass, a different proximal
recompute, another seed) would change one of them.

Each mode's config is composed the way ``streamrl train trainer.mode=X`` composes it
(``load_config``), so a learner key slipped into a mode's YAML group counts too. The learner is
the real one: ``LearnerWorker`` at world size 1 (FSDP2 on gloo, CPU, the tiny model), driven
through ``prepare`` -> the controller's ``with_advantages`` -> ``update``. Spies record, without
changing anything: the inputs and output of every policy-loss call, the per-token matrix of every
loss term before aggregation (``algos.agg_loss``), and every parameter's gradient just before each
optimizer step.

The behaviour log-probs come from a bf16 copy of the same weights through the full-logits
forward, as a bf16 replica at the learner's version would report them: the policy is the same
(staleness 0) but the numbers differ from the learner's by engine numerics, so the ratio to the
behaviour policy is not exactly 1. That keeps the rollout corrections (truncated IS is on by
default) and the choice of the "old" log-probs visible in the loss: with behaviour log-probs equal
to the learner's bit for bit, bypass and recompute, or a correction and none, would coincide.

Equality is exact (``torch.equal``), not within 1e-6: both learners run in one process on the same
CPU kernels and thread count, so the same computation gives the same bits, and any difference at
all means the two modes computed something different. A tolerance would hide exactly the small
divergences this test exists for (a proximal recompute over another layout differs by ~1e-6).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, load_config
from streamrl.controller import with_advantages
from streamrl.learner.forward import MicroBatch
from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.worker import LearnerWorker
from streamrl.net import free_port
from tests.support.learner import logits_policy_forward, make_batch

CPU = torch.device("cpu")
COMPARED = ("sync", "one_step_off")

# What make_config sets for a small learner, as ``streamrl train`` overrides.
BASE = [
    "learner.device=cpu", "trainer.total_steps=10", "task.train_batch_size=4",
    "task.max_prompt_length=16", "rollout.max_new_tokens=16", "rollout.n=4",
    "actor.ppo_micro_batch_size=1", "actor.ppo_max_token_len=64", "actor.optim.lr=1e-3",
]
SETUPS = {
    # One mini-batch, one epoch: the update's first forward gives the proximal log-probs.
    "proximal_from_first_forward": ["actor.ppo_mini_batch_size=4", "actor.ppo_epochs=1"],
    # Two mini-batches x two epochs: prepare recomputes the proximal log-probs, adds the
    # reference's, and the later optimizer steps start from moved weights; KL and entropy in
    # the loss give every loss term a gradient.
    "proximal_recomputed": ["actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2",
                            "actor.use_kl_loss=true", "actor.entropy_coeff=0.01"],
}


@dataclass
class Record:
    """Everything one mode's learner computed on the batch, in the order it computed it."""

    weights_before: dict[str, Tensor] = field(default_factory=dict)
    prepared: dict[str, Tensor] = field(default_factory=dict)
    calls: list[tuple[str, list[Tensor]]] = field(default_factory=list)
    """(function, tensors in and out) of every policy-loss and agg_loss call."""
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    """Every parameter's full gradient just before each optimizer step (after clipping)."""
    metrics: dict[str, float] = field(default_factory=dict)
    weights_after: dict[str, Tensor] = field(default_factory=dict)


def config_for(mode: str, model_dir: Path, out: Path, setup: list[str]) -> Config:
    return load_config([f"trainer.mode={mode}", f"model.path={model_dir}",
                        f"trainer.output_dir={out}", *BASE, *setup])


def tensors_of(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value.detach().clone()
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_of(item)


def spy(record: Record, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        record.calls.append((name, [*tensors_of(list(args)), *tensors_of(list(kwargs.values())),
                                    *tensors_of(out)]))
        return out

    return wrapper


def full(t: Tensor) -> Tensor:
    """A DTensor's (FSDP2 shard's) full value; plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights(worker: LearnerWorker) -> dict[str, Tensor]:
    return {name: t.clone() for name, t in worker.named_full_parameters()}


def behaviour_log_probs(model_dir: Path, batch: Batch, cfg: Config) -> Tensor:
    """[B, R] log-probs of the responses under the initial weights as a bf16 replica reports
    them (the layout ``Batch.from_groups`` gives: zero outside the response mask)."""
    model = load_causal_lm(model_dir, CPU).to(torch.bfloat16).eval()
    with torch.no_grad():
        log_probs, _ = logits_policy_forward(
            model, MicroBatch.of(batch, list(range(len(batch))), False), CPU,
            temperature=cfg.rollout.temperature)
    return log_probs.float() * batch["response_mask"]


def run_learner(cfg: Config, batch: Batch, monkeypatch: pytest.MonkeyPatch) -> Record:
    """One update of a fresh learner on ``batch``, as the controller drives it."""
    record = Record()
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    try:
        with monkeypatch.context() as patch:
            for name in ("compute_policy_loss_from_config", "agg_loss"):
                patch.setattr(algos, name, spy(record, name, getattr(algos, name)))
            model = worker.actor.model

            def snapshot(*_: Any) -> None:
                record.grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()
                                     if p.grad is not None})

            hook = worker.actor.optimizer.register_step_pre_hook(snapshot)
            record.weights_before = weights(worker)
            prepared = worker.prepare(batch)
            record.prepared = dict(prepared.tensors)
            kl_ctrl = algos.get_kl_controller(cfg.algorithm.kl_ctrl_type, cfg.algorithm.kl_coef,
                                              cfg.algorithm.target_kl, cfg.algorithm.horizon)
            record.metrics = worker.update(with_advantages(prepared, cfg, kl_ctrl))
            hook.remove()
            record.weights_after = weights(worker)
    finally:
        worker.shutdown()
    return record


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())} in one mode only"
    for key in a:
        assert a[key].shape == b[key].shape, f"{what}[{key}]: shapes differ"
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        assert torch.equal(a[key], b[key]), f"{what}[{key}]: max |diff| {diff:.3g} between modes"


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_sync_and_one_step_off_learn_identically_at_staleness_0(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: str
) -> None:
    cfgs = {mode: config_for(mode, tiny_model_dir, tmp_path / mode, SETUPS[setup])
            for mode in COMPARED}
    assert (cfgs["sync"].buffer.max_staleness, cfgs["one_step_off"].buffer.max_staleness) == (0, 1)
    raw = make_batch(4, 4, seed=7)  # sampled by version 0: staleness 0 at learner version 0
    assert raw.meta["min_version"] == 0
    batch = Batch({**raw.tensors, "rollout_log_probs": behaviour_log_probs(
        tiny_model_dir, raw, cfgs["sync"])}, dict(raw.non_tensors), dict(raw.meta))
    sync, off = (run_learner(cfgs[mode], batch, monkeypatch) for mode in COMPARED)

    # Same seed and checkpoint: the two learners start from the same weights.
    assert_same(sync.weights_before, off.weights_before, "initial weights")
    # What prepare added (proximal and reference log-probs, where the setup asks for them).
    assert_same(sync.prepared, off.prepared, "prepared batch")
    # Per micro-batch: the policy loss's inputs (proximal, current and behaviour log-probs,
    # advantages, mask) and result, and every loss term's per-token matrix before aggregation.
    assert [n for n, _ in sync.calls] == [n for n, _ in off.calls], "loss calls differ"
    assert sum(n == "compute_policy_loss_from_config" for n, _ in sync.calls) >= 4
    for i, ((name, a), (_, b)) in enumerate(zip(sync.calls, off.calls, strict=True)):
        assert_same(dict(enumerate(a)), dict(enumerate(b)), f"call {i} ({name})")
    # Every parameter's gradient at every optimizer step.
    steps = {"proximal_from_first_forward": 1, "proximal_recomputed": 4}[setup]
    assert len(sync.grads) == len(off.grads) == steps
    for step, (a, b) in enumerate(zip(sync.grads, off.grads, strict=True)):
        assert len(a) == len(sync.weights_before), "a parameter had no gradient"
        assert any(g.abs().sum() > 0 for g in a.values())
        assert_same(a, b, f"gradients at optimizer step {step}")
    assert sync.metrics == off.metrics
    assert_same(sync.weights_after, off.weights_after, "weights after the update")
    # Not vacuous: the behaviour log-probs differ from the learner's by engine numerics only
    # (same policy), so the correction weights are not all exactly 1.
    mismatch = sync.metrics["rollout/logprob_abs_diff"]
    assert 0 < mismatch < 0.05, mismatch
