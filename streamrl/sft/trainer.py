"""``SFTTrainer``: one FSDP2 rank of ``streamrl sft``, built from the learner's parts.

The loop, on every rank::

    step = load_checkpoint(find_latest(output_dir)) if trainer.resume=auto else 0
    while step < total_steps:
        rows   = this rank's share of the step's global batch (epoch order: seed + epoch)
        update = run_update(one mini-batch of micro-batches, loss = -token-mean log p(assistant))
        step  += 1
        save_checkpoint(step) every trainer.save_freq steps and at the last step
    export_hf(output_dir/hf)

Everything heavy is the RL learner's own: ``fsdp`` (process group, ``parallelize``, model
loading), ``optim`` (AdamW + schedule), ``update_loop.run_update`` (global token normalisation
over ranks, grad clipping, non-finite steps skipped), ``logprobs.policy_log_probs`` (log-probs of
the "response", here every token after the first) and ``checkpoint`` (DCP, HF export). An SFT
batch is a ``Batch`` whose response is the whole conversation but its first token and whose
``response_mask`` is the assistant mask, so the actor's loss path needs no SFT variant.
Data order depends on the step alone, so a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl import algos
from streamrl.batch import Batch
from streamrl.data.sft import SFTExample, collate, load_sft_examples
from streamrl.errors import ConfigError
from streamrl.learner import checkpoint as ckpt
from streamrl.learner.forward import MicroBatch
from streamrl.learner.fsdp import (
    MeshSpec,
    init_distributed,
    load_causal_lm,
    load_sharded,
    resolve_device,
)
from streamrl.learner.logprobs import policy_log_probs
from streamrl.learner.optim import build_lr_scheduler, build_optimizer
from streamrl.learner.update_loop import Counts, MetricAccumulator, run_update
from streamrl.models import padding_id, resolve_model_path
from streamrl.sft.config import SFTConfig

StepHook = Callable[[int, dict[str, float]], None]

HF_DIR = "hf"
"""The final export under ``trainer.output_dir``: what ``streamrl train model.path=`` loads."""


def sft_batch(examples: list[SFTExample], pad_token_id: int) -> Batch:
    """Conversations as a learner ``Batch``: prompt = the first token, response = the rest
    (right-padded), ``response_mask`` = the assistant tokens."""
    cols = collate(examples, pad_token_id)
    ids, attention = cols["input_ids"], cols["attention_mask"]
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    return Batch({
        "input_ids": ids, "attention_mask": attention, "position_ids": positions,
        "responses": ids[:, 1:], "response_mask": (cols["loss_mask"] * attention)[:, 1:],
    })


@dataclass(frozen=True)
class SFTData:
    examples: list[SFTExample]
    pad_token_id: int


def load_data(cfg: SFTConfig) -> SFTData:
    """The tokenized conversations of ``data.train_files`` (loaded once, by the launcher)."""
    from transformers import AutoTokenizer

    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(
        cfg.model.tokenizer_path or model_path, "model.tokenizer_path", "tokenizer_config.json"))
    d = cfg.data
    examples = load_sft_examples(d.train_files, tokenizer, d.max_length,
                                 messages_key=d.messages_key, prompt_key=d.prompt_key,
                                 response_key=d.response_key)
    if len(examples) < d.train_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size!r}: more than the "
                          f"{len(examples)} usable conversations in data.train_files")
    return SFTData(examples, padding_id(tokenizer))


class SFTTrainer:
    """One rank: the model sharded over ``learner.world_size`` ranks, its optimizer and LR
    schedule, and the step counter that fixes the data order and names checkpoints."""

    def __init__(
        self, cfg: SFTConfig, data: SFTData, rank: int, world_size: int, master_addr: str,
        master_port: int,
    ) -> None:
        if world_size != cfg.learner.world_size:
            raise ValueError(f"world_size={world_size} but learner.world_size="
                             f"{cfg.learner.world_size}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.examples, self.pad_token_id = data.examples, data.pad_token_id
        self.device = resolve_device(cfg.learner.device)
        self._owns_group = not dist.is_initialized()
        init_distributed(rank, world_size, master_addr, master_port, self.device)
        torch.manual_seed(cfg.learner.seed)
        self.model_path = resolve_model_path(cfg.model.path)
        self.steps_per_epoch = len(self.examples) // cfg.data.train_batch_size
        self.total_steps = cfg.trainer.total_steps or \
            cfg.trainer.total_epochs * self.steps_per_epoch
        spec = MeshSpec(dp_shard=world_size, device_type=self.device.type,
                        mixed_precision=self.device.type == "cuda",
                        gradient_checkpointing=cfg.model.gradient_checkpointing)
        self.model = load_sharded(load_causal_lm, self.model_path, self.device, spec)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.step = 0

    # ---- data --------------------------------------------------------------------------------
    def rows(self, step: int) -> list[int]:
        """This rank's example indices for ``step`` (0-based): every rank the same count."""
        d = self.cfg.data
        epoch, k = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.examples)))
        if d.shuffle:
            random.Random(d.seed + epoch).shuffle(order)
        return order[k * d.train_batch_size : (k + 1) * d.train_batch_size][
            self.rank :: self.world_size]

    # ---- training ----------------------------------------------------------------------------
    def _micro_loss(self, mb: MicroBatch, counts: Counts, metrics: MetricAccumulator
                    ) -> torch.Tensor:
        log_probs, _ = policy_log_probs(self.model, mb, self.device)
        mask = mb.column("response_mask", self.device)
        loss = algos.agg_loss(-log_probs, mask, "token-mean", num_tokens=counts.tokens)
        metrics.add_sum("sft/loss", float(loss.detach()))
        return loss

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next global batch; the same metrics on every rank."""
        batch = sft_batch([self.examples[i] for i in self.rows(self.step)], self.pad_token_id)
        micro = self.cfg.data.micro_batch_size
        chunks = [list(range(i, min(i + micro, len(batch)))) for i in range(0, len(batch), micro)]
        self.model.train()
        metrics = run_update(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            micro_batches=[[MicroBatch.of(batch, rows, packed=False) for rows in chunks]],
            epochs=1, grad_clip=self.cfg.trainer.grad_clip, micro_loss=self._micro_loss,
            prefix="sft", device=self.device,
        )
        self.step += 1
        return metrics

    # ---- state -------------------------------------------------------------------------------
    def _states(self) -> dict[str, ckpt.TrainState]:
        return {"model": ckpt.TrainState(self.model, self.optimizer, self.scheduler)}

    def save(self) -> Path:
        t = self.cfg.trainer
        return ckpt.save_checkpoint(t.output_dir, self.step, self._states(),
                                    {"examples": len(self.examples)}, max_to_keep=t.max_to_keep)

    def resume(self) -> Path | None:
        """Load the latest complete checkpoint under output_dir (resume=auto); None if none."""
        if self.cfg.trainer.resume != "auto":
            return None
        latest = ckpt.find_latest(self.cfg.trainer.output_dir)
        if latest is not None:
            self.step, _ = ckpt.load_checkpoint(latest, self._states())
        return latest

    def export(self) -> Path | None:
        """HF weights + tokenizer in output_dir/hf (rank 0 returns the path)."""
        return ckpt.export_hf(self.model, Path(self.cfg.trainer.output_dir) / HF_DIR,
                              self.model_path)

    def fit(self, on_step: StepHook | None = None) -> Path | None:
        """Train to ``total_steps`` (saving as configured), then export; rank 0 returns the HF
        dir. ``on_step(step, metrics)`` is called after every step."""
        save_freq = self.cfg.trainer.save_freq
        while self.step < self.total_steps:
            metrics = self.train_step()
            if on_step is not None:
                on_step(self.step, metrics)
            if self.step == self.total_steps or (save_freq and self.step % save_freq == 0):
                self.save()
        return self.export()

    def shutdown(self) -> None:
        """Leave the process group if this trainer created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
