"""The policy being trained (``Actor``) and its frozen reference copy (``ReferencePolicy``).

``Actor.compute_log_prob`` recomputes the proximal ("old") log-probs with the current weights
over exactly the micro-batches the first epoch of ``update`` will use, so the PPO ratio is
exactly 1 at the first inner step. A batch without them (one mini-batch per epoch: see
``Config.proximal_before_update``) takes them from the first epoch's own forward, the same
numbers without a pass of their own. ``Actor.update`` runs ppo_epochs x mini-batches (whole
groups, rows dealt to ranks) x micro-batches (token budget + packing, or fixed size + padding)
through ``update_loop.run_update`` with the loss pg_loss - entropy_coeff * entropy
+ kl_loss_coef * kl_loss, every term normalised by the mini-batch's global token / sequence
counts. Policy-loss modes and rollout corrections come from ``algos`` via ``PolicyLossConfig``.
When the correction may reject tokens (IcePop, rejection, rollout_rs) or normalises its IS
weights by their mean, a pre-pass over each mini-batch (``Actor._count``) computes the keep
masks and that mean before the first backward, so rejected tokens leave every term's mask and
the counts (verl's modified response_mask) while accumulation stays exact. It needs the
reference log-probs of the whole mini-batch: the proximal ones when known, else (bypass, or a
first epoch that takes them from its own forward) one no-grad forward of the mini-batch.
Log-probs come from ``logprobs.policy_log_probs`` (computed in the LM head, chunked, never the
[tokens x vocab] logits); the entropy has gradients only when ``entropy_coeff != 0``.
Building an ``Actor`` sets the process's allocator up (``memory.configure_allocator``: large
freed blocks go back to the system at once). Depends on algos, batch, config and the learner's
batching / forward / logprobs / lora / memory / optim / update_loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config
from streamrl.learner.batching import Plan
from streamrl.learner.forward import MicroBatch, gather_rows
from streamrl.learner.logprobs import policy_log_probs
from streamrl.learner.lora import adapter_disabled
from streamrl.learner.memory import configure_allocator
from streamrl.learner.optim import build_lr_scheduler, build_optimizer
from streamrl.learner.update_loop import (
    Counts,
    MetricAccumulator,
    all_reduce,
    global_counts,
    run_update,
)

Planner = Callable[[Batch], Plan]


def policy_loss_config(cfg: Config) -> algos.PolicyLossConfig:
    """cfg.actor -> algos.PolicyLossConfig, the one place they meet: every field is the actor
    key of its name (a field without one fails here, and in the tests), except loss_mode
    (actor.policy_loss), bypass (actor.recompute_log_prob=false) and Dr. GRPO's horizon, which
    defaults to the response budget."""
    actor = cfg.actor
    derived = {
        "loss_mode": actor.policy_loss,
        "bypass": not actor.recompute_log_prob,
        "loss_scale_factor": (cfg.response_budget if actor.loss_scale_factor is None
                              else actor.loss_scale_factor),
    }
    same = {f.name: getattr(actor, f.name) for f in dataclasses.fields(algos.PolicyLossConfig)
            if f.name not in derived}
    return algos.PolicyLossConfig(**same, **derived)


def sampling_of(cfg: Config) -> dict[str, Any]:
    """The distribution the rollout samples from (``policy_log_probs``' keywords): the learner's
    log-probs are of it, so that on-policy they equal the replicas' processed log-probs."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}


def micro_batches(batch: Batch, plan: Plan, packed: bool) -> list[list[MicroBatch]]:
    return [[MicroBatch.of(batch, rows, packed) for rows in mini] for mini in plan]


def log_probs_over_plan(
    model: nn.Module,
    batch: Batch,
    plan: Plan,
    *,
    packed: bool,
    device: torch.device,
    sampling: dict[str, Any],
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """[B, R] log-probs (and entropies) for the whole batch: this rank's rows computed, then
    gathered from all ranks. No gradients, in eval mode (no LoRA dropout)."""
    model.eval()
    lp_parts: list[tuple[list[int], Tensor]] = []
    ent_parts: list[tuple[list[int], Tensor]] = []
    with torch.no_grad():
        for mini in micro_batches(batch, plan, packed):
            for mb in mini:
                log_probs, entropy = policy_log_probs(
                    model, mb, device, **sampling, with_entropy=with_entropy
                )
                rows = [] if mb.dummy else mb.rows
                lp_parts.append((rows, log_probs))
                if entropy is not None:
                    ent_parts.append((rows, entropy))
    like = batch.tensors["rollout_log_probs"].to(device)
    log_probs = gather_rows(lp_parts, len(batch), like)
    entropy = gather_rows(ent_parts, len(batch), like) if with_entropy else None
    return log_probs.cpu(), (entropy.cpu() if entropy is not None else None)


class ReferencePolicy:
    """The initial policy: a frozen copy (FSDP2-sharded like the actor, no optimizer), or,
    ``shared``, the actor's own LoRA model with its adapter disabled (the base weights never
    train), which costs no memory."""

    def __init__(self, model: nn.Module, cfg: Config, planner: Planner, device: torch.device,
                 shared: bool = False):
        if not shared:
            for p in model.parameters():
                p.requires_grad_(False)
        self.model, self.cfg, self.planner, self.device = model, cfg, planner, device
        self.shared = shared

    def compute_ref_log_prob(self, batch: Batch) -> Tensor:
        with adapter_disabled(self.model):  # a no-op on a frozen copy
            log_probs, _ = log_probs_over_plan(
                self.model, batch, self.planner(batch), packed=self.cfg.actor.use_dynamic_bsz,
                device=self.device, sampling=sampling_of(self.cfg),
            )
        return log_probs


class Actor:
    """The trained policy: proximal log-probs and PPO-family updates."""

    def __init__(self, model: nn.Module, cfg: Config, planner: Planner, device: torch.device):
        configure_allocator()  # before the first step allocates anything (memory.py)
        self.model, self.cfg, self.planner, self.device = model, cfg, planner, device
        self.acfg = cfg.actor
        self.sampling = sampling_of(cfg)
        self.loss_cfg = policy_loss_config(cfg)
        self.optimizer = build_optimizer(model, cfg.actor.optim)
        self.scheduler = build_lr_scheduler(
            self.optimizer, cfg.actor.optim, cfg.trainer.total_steps
        )

    def compute_log_prob(
        self, batch: Batch, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Proximal log-probs [B, R] with the current weights (and entropies if asked)."""
        log_probs, entropy = log_probs_over_plan(
            self.model, batch, self.planner(batch), packed=self.acfg.use_dynamic_bsz,
            device=self.device, sampling=self.sampling, with_entropy=with_entropy,
        )
        return (log_probs, entropy) if with_entropy else log_probs

    def update(self, batch: Batch) -> dict[str, float]:
        """One training step over ``batch`` (needs advantages, ref_log_prob when use_kl_loss,
        old_log_probs when an epoch has several mini-batches); returns verl-named metrics
        averaged over mini-batches."""
        required = ["advantages", "response_mask", "rollout_log_probs"]
        if self.acfg.use_kl_loss:
            required.append("ref_log_prob")
        plan = self.planner(batch)
        if not self.loss_cfg.bypass and len(plan) > 1:  # later mini-batches see moved weights
            required.append("old_log_probs")
        missing = [k for k in required if k not in batch.tensors]
        if missing:
            raise KeyError(f"Actor.update: batch lacks {missing} (run LearnerWorker.prepare and "
                           f"compute advantages first)")
        self.model.train()
        out = run_update(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            micro_batches=micro_batches(batch, plan, self.acfg.use_dynamic_bsz),
            epochs=self.acfg.ppo_epochs,
            grad_clip=self.acfg.grad_clip,
            micro_loss=self._micro_loss,
            prefix="actor",
            device=self.device,
            count=self._count,
        )
        if self.acfg.use_kl_loss:
            out["actor/kl_coef"] = self.acfg.kl_loss_coef
        return out

    def _count(self, micros: list[MicroBatch], device: torch.device) -> Counts:
        """The mini-batch's counts of kept tokens and its IS normalisation factor (see the
        module docstring); plain token counts when the correction rejects nothing."""
        cfg = self.loss_cfg
        normalises = cfg.tis_cap is not None and cfg.rollout_is_batch_normalize
        if not (cfg.rejects or normalises):
            return global_counts(micros, device)
        parts = torch.zeros(2, dtype=torch.float64, device=device)
        for mb in micros:
            mask = mb.column("response_mask", device)
            log_ratio = self._reference(mb) - mb.column("rollout_log_probs", device)
            if cfg.rejects:
                mb.keep = algos.rollout_correction(cfg, log_ratio, mask)[1]
            if normalises:
                parts += algos.is_batch_norm_parts(cfg, log_ratio, mask).to(parts)
        counts = global_counts(micros, device)
        if not normalises:
            return counts
        total, n = all_reduce(parts).tolist()
        return Counts(counts.tokens, counts.seqs,
                      torch.tensor(total / n if n > 0 else 1.0, device=device))

    def _reference(self, mb: MicroBatch) -> Tensor:
        """What the rollout correction compares with the behaviour: the proximal log-probs, or
        (bypass) the current ones, from a no-grad forward when not known yet."""
        if not self.loss_cfg.bypass:
            if mb.proximal is not None:
                return mb.proximal
            if "old_log_probs" in mb.batch.tensors:
                return mb.column("old_log_probs", self.device)
        with torch.no_grad():
            return policy_log_probs(self.model, mb, self.device, **self.sampling)[0]

    def _micro_loss(self, mb: MicroBatch, counts: Counts, metrics: MetricAccumulator) -> Tensor:
        acfg, dev = self.acfg, self.device
        # The entropy is a metric only (no graph, no backward work) unless it is in the loss.
        log_prob, entropy = policy_log_probs(
            self.model, mb, dev, **self.sampling, with_entropy=True,
            entropy_grad=acfg.entropy_coeff != 0,
        )
        assert entropy is not None
        mask = mb.column("response_mask", dev)
        rollout = mb.column("rollout_log_probs", dev)
        weight = float(mask.sum())
        if mb.proximal is None:  # the first epoch, at the weights this update starts from
            if self.loss_cfg.bypass:
                mb.proximal = rollout
            elif "old_log_probs" in mb.batch.tensors:
                mb.proximal = mb.column("old_log_probs", dev)
            else:
                mb.proximal = log_prob.detach()
            # Rollout/training mismatch: engine numerics, plus policy lag in a stale batch.
            metrics.add_mean("rollout/logprob_abs_diff",
                             float(algos.masked_mean((rollout - mb.proximal).abs(), mask)), weight)
        old = mb.proximal
        pg_loss, pg_metrics = algos.compute_policy_loss_from_config(
            self.loss_cfg, old, log_prob, mb.column("advantages", dev), mask,
            rollout_log_prob=rollout, keep=mb.keep,
            is_batch_norm_factor=counts.is_batch_norm_factor, num_tokens=counts.tokens,
            num_seqs=counts.seqs,
        )
        # The entropy and KL terms aggregate like the policy loss, rejected tokens left out.
        mask = mb.loss_mask(dev)
        norm = {"num_tokens": counts.tokens, "num_seqs": counts.seqs,
                "loss_scale_factor": self.loss_cfg.loss_scale_factor}
        ent = algos.agg_loss(entropy, mask, acfg.loss_agg_mode, **norm)
        loss = pg_loss - acfg.entropy_coeff * ent
        metrics.add_sum("actor/pg_loss", float(pg_loss.detach()))
        metrics.add_sum("actor/entropy", float(ent.detach()))
        if acfg.use_kl_loss:
            kl = algos.compute_kl_loss(
                log_prob, mb.column("ref_log_prob", dev), mask, acfg.kl_loss_type,
                acfg.loss_agg_mode, **norm,
            )
            loss = loss + acfg.kl_loss_coef * kl
            metrics.add_sum("actor/kl_loss", float(kl.detach()))
        for key, value in pg_metrics.items():
            metrics.add_mean(key, value, weight)
        return loss
