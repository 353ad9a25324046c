"""``streamrl sft``: supervised fine-tuning on chat conversations, as a warm start for RL.

Parts: ``config`` (``SFTConfig``, ``load_sft_config``: its own small root reusing the RL
config's model / optim / learner sections), ``trainer`` (``SFTTrainer``: one FSDP2 rank built
from the learner's parts) and ``run_sft`` here: load the data once in the launcher (a bad file
fails as one ``ConfigError`` line before any rank starts), then run the ranks (world size 1 in
this process, more with ``torch.multiprocessing`` over gloo, as the learner tests do), rank 0
writing ``metrics.jsonl`` and one log line per step. The result is ``<output_dir>/hf``, an HF
model directory ``streamrl train model.path=`` loads. See docs/sft.md.
Depends on config, data.sft, learner, metrics, models, net.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.sft.config import SFTConfig, load_sft_config

if TYPE_CHECKING:
    from streamrl.sft.trainer import SFTData

__all__ = ["SFTConfig", "load_sft_config", "run_sft"]

log = logging.getLogger(__name__)


def run_sft(cfg: SFTConfig) -> Path:
    """Train, checkpoint and export; returns the HF directory."""
    from streamrl.models import resolve_model_path
    from streamrl.net import LOOPBACK, free_port
    from streamrl.sft.trainer import HF_DIR, load_data

    # Resolve `tiny` once here, so ranks never race to build it.
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=resolve_model_path(cfg.model.path)))
    data = load_data(cfg)
    log.info("sft: %d conversations from %s", len(data.examples), ", ".join(cfg.data.train_files))
    port = free_port()
    world = cfg.learner.world_size
    if world == 1:
        _rank_main(0, cfg, data, LOOPBACK, port)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank_main, args=(cfg, data, LOOPBACK, port), nprocs=world, join=True)
    return Path(cfg.trainer.output_dir) / HF_DIR


def _rank_main(rank: int, cfg: SFTConfig, data: SFTData, addr: str, port: int) -> None:
    from streamrl.metrics import MetricsLogger
    from streamrl.sft.trainer import SFTTrainer

    # A spawned rank starts without logging set up; only rank 0 reports progress.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trainer = SFTTrainer(cfg, data, rank, cfg.learner.world_size, addr, port)
    sink = MetricsLogger(("jsonl",), cfg.trainer.output_dir, "streamrl", "sft") \
        if rank == 0 else None

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if sink is None:
            return
        sink.log(metrics, step)
        log.info("sft step %d/%d: loss %.4f grad_norm %.3f lr %.2e", step, trainer.total_steps,
                 metrics["sft/loss"], metrics.get("sft/grad_norm", float("nan")),
                 metrics["sft/lr"])

    try:
        resumed = trainer.resume()
        if resumed is not None and rank == 0:
            log.info("sft: resumed from %s at step %d", resumed, trainer.step)
        out = trainer.fit(on_step)
        if out is not None:
            log.info("sft: HF model written to %s", out)
    finally:
        if sink is not None:
            sink.close()
        trainer.shutdown()
