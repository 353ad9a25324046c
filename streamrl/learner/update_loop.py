"""The optimisation loop shared by actor and critic: epochs x mini-batches x micro-batches.

Parts:
- ``Counts``: a mini-batch's valid tokens and non-empty sequences (tokens a micro-batch's
  ``keep`` mask rejects excluded), summed over all ranks. Every micro-batch loss is normalised
  by these global counts, so micro-batch losses add up to the mini-batch loss and the gradient
  does not depend on how the mini-batch is split. A loss may compute its own (``count``: the
  actor's counts after its rollout-correction pre-pass).
- ``MetricAccumulator``: per-mini-batch sums (loss terms) and token-weighted means (clip
  fractions, KL), reduced across ranks in one all-reduce, then averaged over mini-batches.
- ``run_update``: the loop. FSDP2 averages gradients over ranks, so each rank backpropagates
  ``world_size x`` its (globally normalised) loss to get the exact sum; the root FSDP unit's
  gradients are reduced once per mini-batch, after its last micro-batch (``_reduce_root_grads``).
  A non-finite loss or gradient norm on any rank skips the optimizer step for everyone (weights
  and optimizer state untouched) and is counted as ``<prefix>/skipped_steps``; a mini-batch
  without valid tokens is skipped with a warning (``<prefix>/empty_minibatches``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from streamrl.learner.forward import MicroBatch

log = logging.getLogger(__name__)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if _world() > 1:
        dist.all_reduce(t, op=op)
    return t


def sync_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over all ranks."""
    return int(all_reduce(torch.tensor([value], device=device), dist.ReduceOp.MAX).item())


@dataclass(frozen=True)
class Counts:
    tokens: Tensor
    """Valid (response_mask, and ``keep``) tokens in the whole mini-batch, all ranks."""
    seqs: Tensor
    """Sequences with at least one such token in the whole mini-batch, all ranks."""
    is_batch_norm_factor: Tensor | None = None
    """The mini-batch's mean truncated IS weight, when the rollout correction normalises by
    it (``algos.is_batch_norm_parts``)."""


def global_counts(micros: list[MicroBatch], device: torch.device) -> Counts:
    local = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micros:
        mask = mb.loss_mask(device)
        local[0] += mask.sum()
        local[1] += (mask.sum(-1) > 0).sum()
    total = all_reduce(local)
    return Counts(tokens=total[0].float(), seqs=total[1].float())


class MetricAccumulator:
    """Collects one mini-batch's metrics on this rank; ``end_minibatch`` reduces over ranks."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._weighted: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._history: dict[str, list[float]] = defaultdict(list)

    def add_sum(self, key: str, value: float) -> None:
        self._sums[key] += value

    def add_mean(self, key: str, value: float, weight: float) -> None:
        entry = self._weighted[key]
        entry[0] += value * weight
        entry[1] += weight

    def record(self, key: str, value: float) -> None:
        """A value already global for this mini-batch (grad norm)."""
        self._history[key].append(value)

    def end_minibatch(self, device: torch.device) -> None:
        sums, weighted = sorted(self._sums), sorted(self._weighted)
        flat = [self._sums[k] for k in sums]
        for k in weighted:
            flat.extend(self._weighted[k])
        reduced = all_reduce(torch.tensor(flat, dtype=torch.float64, device=device)).tolist()
        for i, k in enumerate(sums):
            self._history[k].append(reduced[i])
        for j, k in enumerate(weighted):
            num, den = reduced[len(sums) + 2 * j : len(sums) + 2 * j + 2]
            self._history[k].append(num / den if den > 0 else 0.0)
        self._sums.clear()
        self._weighted.clear()

    def result(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self._history.items() if v}


MicroLoss = Callable[[MicroBatch, Counts, MetricAccumulator], Tensor]
"""Computes one micro-batch's loss (normalised by the global counts) and records its metrics."""
CountFn = Callable[[list[MicroBatch], torch.device], Counts]
"""A mini-batch's global counts, taken before its first micro-batch's forward."""


def run_update(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[list[MicroBatch]],
    epochs: int,
    grad_clip: float,
    micro_loss: MicroLoss,
    prefix: str,
    device: torch.device,
    count: CountFn = global_counts,
) -> dict[str, float]:
    """Train ``epochs`` passes over ``micro_batches`` (mini -> micro); returns averaged metrics."""
    metrics = MetricAccumulator()
    skipped = empty = 0
    scale = float(_world())
    for _ in range(epochs):
        for micros in micro_batches:
            counts = count(micros, device)
            if counts.tokens.item() == 0:
                log.warning("%s: skipping a mini-batch without valid tokens", prefix)
                empty += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for i, mb in enumerate(micros):
                _reduce_root_grads(model, i == len(micros) - 1)
                loss = micro_loss(mb, counts, metrics)
                finite = finite and bool(torch.isfinite(loss.detach()).item())
                (loss * scale).backward()
            grad_norm = _grad_norm(model, grad_clip)
            any_bad = all_reduce(torch.tensor([0.0 if finite else 1.0], device=device),
                                 dist.ReduceOp.MAX)
            metrics.end_minibatch(device)
            if any_bad.item() > 0 or not math.isfinite(grad_norm):
                log.warning("%s: non-finite loss or gradient (grad_norm=%s); step skipped",
                            prefix, grad_norm)
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            metrics.record(f"{prefix}/grad_norm", grad_norm)
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = metrics.result()
    out[f"{prefix}/lr"] = float(scheduler.get_last_lr()[0])
    with warnings.catch_warnings():
        # The schedule advances per update even when every step was skipped (bad input);
        # torch warns about a scheduler step without an optimizer step then.
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    out[f"{prefix}/skipped_steps"] = float(skipped)
    out[f"{prefix}/empty_minibatches"] = float(empty)
    return out


def _reduce_root_grads(model: nn.Module, now: bool) -> None:
    """Whether this backward reduces the root FSDP unit's gradients (the last micro-batch of a
    mini-batch), or leaves them to accumulate, unreduced, on its gathered parameters.

    The root's gradient (embeddings and a tied head: 108 MiB fp32 at SmolLM2) is made first, by
    the head's backward (``logprobs._own_leaf`` puts it on the parameter at once), and reduced
    last, by the root's post-backward. Reduced at every micro-batch, from the second one on the
    new gradient lived beside the reduced one through the whole decoder backward, where a step's
    peak is; unreduced, it is added into the one kept. Only the root: a decoder layer's gradients
    are small heap blocks that, kept from one micro-batch to the last one's reduce, leave holes
    in the heap as large as the saving (docs/real-models.md, "FSDP2's copies at world size 1");
    the root's is one mapping. With several ranks each holds the root's whole gradient from its
    first micro-batch on instead of only during each backward, not at the peak."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(now, recurse=False)


def _grad_norm(model: nn.Module, grad_clip: float) -> float:
    """Total gradient norm over all ranks (FSDP2 DTensor grads), clipping to ``grad_clip``
    when it is > 0. Non-finite norms are returned as they are (the caller skips the step)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
