"""The value model (``Critic``): a causal-LM backbone + scalar head (fsdp.load_value_model).

``compute_values`` gives [B, R] values (the value of the state before each response token, as
verl's critic); ``update`` runs critic.ppo_epochs x the actor's mini/micro-batch plan with
verl's clipped value loss (critic.cliprange_value) around the rollout-time values, aggregated
by critic.loss_agg_mode with global counts. Gradient clipping uses actor.grad_clip (no separate
key).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config
from streamrl.learner.batching import Plan
from streamrl.learner.forward import MicroBatch, gather_rows, value_forward
from streamrl.learner.optim import build_lr_scheduler, build_optimizer
from streamrl.learner.update_loop import Counts, MetricAccumulator, run_update


class Critic:
    def __init__(
        self, model: nn.Module, cfg: Config, planner: Callable[[Batch], Plan], device: torch.device
    ):
        self.model, self.cfg, self.planner, self.device = model, cfg, planner, device
        self.packed = cfg.actor.use_dynamic_bsz
        self.optimizer = build_optimizer(model, cfg.critic.optim)
        self.scheduler = build_lr_scheduler(
            self.optimizer, cfg.critic.optim, cfg.trainer.total_steps
        )

    def _micro_batches(self, batch: Batch) -> list[list[MicroBatch]]:
        return [[MicroBatch.of(batch, rows, self.packed) for rows in mini]
                for mini in self.planner(batch)]

    def compute_values(self, batch: Batch) -> Tensor:
        """[B, R] values with the current weights (zeros on padding), on every rank."""
        parts: list[tuple[list[int], Tensor]] = []
        with torch.no_grad():
            for mini in self._micro_batches(batch):
                for mb in mini:
                    parts.append(([] if mb.dummy else mb.rows, value_forward(self.model, mb,
                                                                             self.device)))
        like = batch.tensors["rollout_log_probs"].to(self.device)
        return gather_rows(parts, len(batch), like).cpu()

    def update(self, batch: Batch) -> dict[str, float]:
        """Needs ``values`` (from prepare) and ``returns`` (from the advantage estimator)."""
        missing = [k for k in ("values", "returns", "response_mask") if k not in batch.tensors]
        if missing:
            raise KeyError(f"Critic.update: batch lacks {missing}")
        self.model.train()
        return run_update(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            micro_batches=self._micro_batches(batch),
            epochs=self.cfg.critic.ppo_epochs,
            grad_clip=self.cfg.actor.grad_clip,
            micro_loss=self._micro_loss,
            prefix="critic",
            device=self.device,
        )

    def _micro_loss(self, mb: MicroBatch, counts: Counts, metrics: MetricAccumulator) -> Tensor:
        dev = self.device
        vpreds = value_forward(self.model, mb, dev)
        mask = mb.column("response_mask", dev)
        vf_loss, clipfrac = algos.compute_value_loss(
            vpreds, mb.column("returns", dev), mb.column("values", dev), mask,
            self.cfg.critic.cliprange_value, self.cfg.critic.loss_agg_mode,
            num_tokens=counts.tokens, num_seqs=counts.seqs,
            loss_scale_factor=self.cfg.response_budget,
        )
        weight = float(mask.sum())
        metrics.add_sum("critic/vf_loss", float(vf_loss.detach()))
        metrics.add_mean("critic/vf_clipfrac", float(clipfrac), weight)
        metrics.add_mean("critic/vpred_mean",
                         float(algos.masked_mean(vpreds.detach(), mask)), weight)
        return vf_loss
