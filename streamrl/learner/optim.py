"""Optimizer and learning-rate schedule: AdamW with linear warmup, then constant or cosine.

Parts: ``build_optimizer``, ``lr_factor`` (the schedule as a pure function of the step),
``build_lr_scheduler`` (a ``LambdaLR`` over it; stepped once per ``update`` call, as verl).
Works on FSDP2's DTensor parameters unchanged.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from streamrl.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per parameter that updates it in place, on CPU as on CUDA (torch
    # picks the foreach path by default, whose multi-tensor ops allocate full-size temporaries
    # for every parameter at once). Measured on this CPU, one step: 135M parameters 170 ms
    # fused vs 590-740 ms foreach on 1 thread (90 vs 320-420 ms on 2), 5.8M 6 vs 18-27 ms.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=True
    )


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Multiplier of the base lr at ``step`` (0-based): ramps (step+1)/warmup during warmup,
    then 1 (constant) or a cosine from 1 down to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr_schedule={schedule!r}: must be constant or cosine")
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``cfg.total_steps`` wins over ``total_steps`` (the trainer's) when set."""
    fn = partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.total_steps or total_steps,
        schedule=cfg.lr_schedule,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
