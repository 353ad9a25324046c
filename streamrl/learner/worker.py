"""``LearnerWorker``: one FSDP2 rank of the learner, process-agnostic (the runtime wraps it in a
Ray actor; tests spawn it with torch.multiprocessing; world size 1 runs it in-process).

Every rank is constructed with the same config and receives the same full ``Batch``; each
computes its own rows and the collectives make the results whole again:
- ``prepare(batch)`` adds ``old_log_probs`` when they are needed before the update
  (``Config.proximal_before_update``: recomputed; in bypass mode a copy of ``rollout_log_probs``),
  ``ref_log_prob`` when ``cfg.use_ref``, ``values`` when ``cfg.use_critic``. **Every rank
  returns the full batch.** Otherwise the update's first forward gives the proximal log-probs.
- ``update(batch)`` trains the actor (and critic); every rank returns the same metrics.
- ``named_full_parameters(dtype, every_rank)``: rank 0 (every rank with ``every_rank``) yields
  (HF name, full tensor); other ranks must iterate too (they yield nothing). With LoRA
  (``actor.lora.rank > 0``, learner/lora.py) they are the adapter's tensors alone when
  ``actor.lora.publish`` resolves to adapter (replicas serve it as a vLLM LoRA adapter), else
  the base weights with the adapter merged in; the reference policy is the actor with its
  adapter disabled, not a second model.
- ``offload()`` / ``reload()``: parameters, gradients and optimizer state to host memory and
  back (``learner.offload``, co-located mode); nothing moves on a CPU device.
- ``save_checkpoint(step, extra)`` / ``load_checkpoint(path)``: atomic DCP checkpoints under
  ``cfg.trainer.output_dir`` (see checkpoint.py); ``export_hf(dir)``: HF weights on rank 0
  (a LoRA actor's merged).
- ``version``: completed updates (restored by ``load_checkpoint``).
Dependencies: config, batch, models (model path), weight_bus.base (its iterator type) and the
learner modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from streamrl.batch import Batch
from streamrl.config import Config
from streamrl.learner import checkpoint as ckpt
from streamrl.learner.actor import Actor, ReferencePolicy
from streamrl.learner.batching import MicroBatching, Plan, plan_update
from streamrl.learner.critic import Critic
from streamrl.learner.fsdp import (
    MeshSpec,
    init_distributed,
    iter_full_parameters,
    load_causal_lm,
    load_sharded,
    load_value_model,
    mixed_precision,
    resolve_device,
)
from streamrl.learner.lora import (
    hf_model,
    iter_adapter_parameters,
    iter_merged_parameters,
    with_lora,
)
from streamrl.learner.update_loop import sync_max
from streamrl.models import resolve_model_path
from streamrl.weight_bus.base import NamedTensors

REQUIRED_TENSORS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask",
                    "rollout_log_probs")


class LearnerWorker:
    def __init__(
        self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        if world_size != cfg.learner.world_size:
            raise ValueError(f"world_size={world_size} but learner.world_size="
                             f"{cfg.learner.world_size}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.learner.device)
        self._owns_group = not dist.is_initialized()
        init_distributed(rank, world_size, master_addr, master_port, self.device)
        torch.manual_seed(cfg.learner.seed)
        self.model_path = resolve_model_path(cfg.model.path)
        spec = MeshSpec(
            dp_shard=world_size,
            device_type=self.device.type,
            mixed_precision=mixed_precision(cfg.learner.mixed_precision, self.device),
            gradient_checkpointing=cfg.model.gradient_checkpointing,
        )
        self.micro_batching = MicroBatching(
            dynamic=cfg.actor.use_dynamic_bsz,
            max_token_len=cfg.actor.ppo_max_token_len,
            micro_groups=cfg.micro_batch_groups,
            micro_rows=cfg.actor.ppo_micro_batch_size_per_gpu,
        )
        # Rank 0 reads the checkpoint; the other ranks receive their shards (fsdp.load_sharded).
        self.lora = cfg.actor.lora.rank > 0
        self.publish_adapter = cfg.actor.lora.publishes_adapter(cfg.rollout.backend,
                                                                cfg.weight_bus.backend)
        load_actor = with_lora(load_causal_lm, cfg.actor.lora) if self.lora else load_causal_lm
        actor_model = load_sharded(load_actor, self.model_path, self.device, spec)
        self.actor = Actor(actor_model, cfg, self.plan, self.device)
        self.ref: ReferencePolicy | None = None
        if cfg.use_ref and self.lora:  # the base model is the actor with its adapter disabled
            self.ref = ReferencePolicy(actor_model, cfg, self.plan, self.device, shared=True)
        elif cfg.use_ref:
            frozen = dataclasses.replace(spec, gradient_checkpointing=False)
            ref_model = load_sharded(load_causal_lm, self.model_path, self.device, frozen)
            self.ref = ReferencePolicy(ref_model, cfg, self.plan, self.device)
        self.critic: Critic | None = None
        if cfg.use_critic:
            value_model = load_sharded(load_value_model, self.model_path, self.device, spec)
            self.critic = Critic(value_model, cfg, self.plan, self.device)
        self.version = 0

    # ---- data --------------------------------------------------------------------------------
    def plan(self, batch: Batch) -> Plan:
        """This rank's rows per mini-batch and micro-batch (same on every call for a batch)."""
        return plan_update(
            batch.non_tensors["index"],
            batch.tensors["attention_mask"].sum(-1).tolist(),
            groups_per_mini=self.cfg.mini_batch_groups,
            policy=self.micro_batching,
            rank=self.rank,
            world_size=self.world_size,
            sync_max=lambda v: sync_max(v, self.device),
        )

    @staticmethod
    def check_batch(batch: Batch) -> None:
        missing = [k for k in REQUIRED_TENSORS if k not in batch.tensors]
        if "index" not in batch.non_tensors:
            missing.append("index (non-tensor group ids)")
        if missing:
            raise KeyError(f"learner batch lacks {missing}; build it with Batch.from_groups")
        if len(batch) == 0:
            raise ValueError("learner batch has no rows")

    def prepare(self, batch: Batch) -> Batch:
        """Add old_log_probs (``Config.proximal_before_update``), ref_log_prob (use_ref) and
        values (use_critic); full batch on every rank."""
        self.check_batch(batch)
        added: dict[str, torch.Tensor] = {}
        if self.cfg.proximal_before_update:
            added["old_log_probs"] = (
                self.actor.compute_log_prob(batch)  # type: ignore[assignment]
                if self.cfg.actor.recompute_log_prob
                else batch.tensors["rollout_log_probs"].clone())
        if self.ref is not None:
            added["ref_log_prob"] = self.ref.compute_ref_log_prob(batch)
        if self.critic is not None:
            added["values"] = self.critic.compute_values(batch)
        return Batch({**batch.tensors, **added}, dict(batch.non_tensors), dict(batch.meta))

    def update(self, batch: Batch) -> dict[str, float]:
        """Actor (and critic) update on a prepared batch with advantages/returns; bumps version."""
        self.check_batch(batch)
        metrics = self.actor.update(batch)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        self.version += 1
        return metrics

    # ---- weights -----------------------------------------------------------------------------
    def named_full_parameters(
        self, dtype: torch.dtype | None = None, every_rank: bool = False
    ) -> NamedTensors:
        if self.publish_adapter:  # replicas hold the base weights: the adapter is the news
            return iter_adapter_parameters(self.actor.model, dtype, every_rank)
        if self.lora:  # replicas load the base weights with the adapter merged in
            return iter_merged_parameters(self.actor.model, dtype, every_rank)
        return iter_full_parameters(self.actor.model, dtype, every_rank)

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def reload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        """Models (FSDP2 shards move with their module) and optimizer state to ``device``."""
        if self.device.type == "cpu":
            return  # they live in host memory already
        for state in self._states().values():
            state.model.to(device)
            for slots in state.optimizer.state.values():
                for key, value in slots.items():
                    if isinstance(value, torch.Tensor):
                        slots[key] = value.to(device, non_blocking=True)
        if self.ref is not None and not self.ref.shared:
            self.ref.model.to(device)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # what the engine's wake-up needs back

    def _states(self) -> dict[str, ckpt.TrainState]:
        states = {"actor": ckpt.TrainState(self.actor.model, self.actor.optimizer,
                                           self.actor.scheduler, trainable_only=self.lora)}
        if self.critic is not None:
            states["critic"] = ckpt.TrainState(self.critic.model, self.critic.optimizer,
                                               self.critic.scheduler)
        return states

    def save_checkpoint(self, step: int, extra: dict[str, Any] | None = None) -> str:
        path = ckpt.save_checkpoint(
            self.cfg.trainer.output_dir, step, self._states(), extra,
            max_to_keep=self.cfg.trainer.max_to_keep,
        )
        return str(path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        step, extra = ckpt.load_checkpoint(path, self._states())
        self.version = step
        return extra

    def export_hf(self, out_dir: str) -> str | None:
        """The actor as an HF model (with LoRA: the adapter merged into the base weights)."""
        if self.lora:
            state = dict(iter_merged_parameters(self.actor.model))  # every rank gathers
            out = ckpt.export_hf(hf_model(self.actor.model), out_dir, self.model_path, state)
        else:
            out = ckpt.export_hf(self.actor.model, out_dir, self.model_path)
        return str(out) if out is not None else None

    def shutdown(self) -> None:
        """Leave the process group if this worker created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
