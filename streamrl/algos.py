"""RL math: advantage estimators, policy / value / KL / entropy losses and loss aggregation.

Pure torch (numpy only to read group ids). No distributed code and no imports from other
streamrl modules: `learner/` and `controller.py` import this file, never the other way round.
Function and argument names follow verl's `verl/trainer/ppo/core_algos.py` (`token_level_rewards`,
`response_mask`, `index`, `norm_adv_by_std_in_grpo`, `clip_ratio_low/high/c`, `loss_agg_mode`),
and results equal verl's on valid (mask = 1) tokens; the few deliberate differences are marked
"Differs from verl" where they live.

Parts, in file order:
1. Masked helpers ....... masked_sum, masked_mean, masked_var, masked_whiten,
                          chunked_log_probs (log-probs / entropy, chunked, recomputed in
                          backward; logits or hidden states + LM head in), logprobs_from_logits,
                          entropy_from_logits
2. Registries ........... register_adv_estimator, get_adv_estimator_fn, ADV_ESTIMATORS;
                          register_policy_loss, get_policy_loss_fn, POLICY_LOSSES,
                          policy_loss_weights_by_ratio
3. Aggregation .......... LOSS_AGG_MODES (token-mean, token-sum, seq-mean-*), agg_loss
4. Advantages ........... compute_gae_advantage_return, compute_grpo_outcome_advantage,
                          compute_rloo_outcome_advantage, compute_remax_outcome_advantage,
                          compute_reinforce_plus_plus_outcome_advantage,
                          compute_reinforce_plus_plus_baseline_outcome_advantage;
                          compute_advantage (the dispatcher the controller calls)
5. KL ................... KL_PENALTY_TYPES, kl_penalty, FixedKLController, AdaptiveKLController,
                          get_kl_controller, apply_kl_penalty (KL in reward), compute_kl_loss
6. Policy losses ........ compute_policy_loss (verl's vanilla signature); PolicyLossConfig;
                          registered per-token surrogates vanilla / gspo / cispo / decoupled /
                          reinforce;
                          rollout correction (verl's rollout_corr): compute_rollout_is_weights
                          (token / sequence truncated IS, batch normalisation),
                          ROLLOUT_RS_OPTIONS, parse_rollout_rs, compute_rollout_rejection_mask
                          (k1/k2/k3 rejection), compute_rollout_correction (all of it plus
                          token / sequence IcePop and geometric-mean rejection: weights and
                          a keep mask), rollout_correction and is_batch_norm_parts (the same
                          from a PolicyLossConfig, for the learner's mini-batch pre-pass);
                          compute_policy_loss_from_config (the learner's one entry point, bypass)
7. Value and entropy .... compute_value_loss, compute_entropy_loss

Conventions:
- Tensors are (batch, response_length); masks hold 0/1 (bool, int or float). Mask 0 marks right
  padding *and* interior observation tokens of multi-turn rollouts; neither changes any result
  on mask-1 tokens.
- Reductions never return NaN: an empty row (all-zero mask) or an empty batch contributes 0.
  The losses zero their inputs at mask-0 positions first, so NaN/inf there (say, missing
  behaviour log-probs of observation tokens) reach neither the loss nor its gradients.
- Exact gradient accumulation: pass `num_tokens` / `num_seqs` counted over the whole mini-batch
  to every loss of a micro-batch; the micro-batch losses then sum to the mini-batch loss.
- Registered advantage estimators share one keyword calling convention (see `compute_advantage`);
  registered policy losses return a per-token loss matrix, and corrections plus aggregation are
  applied once in `compute_policy_loss_from_config`.
- Importance weights are applied once. A surrogate built on the ratio pi / pi_old (vanilla,
  gspo, cispo) already carries pi / pi_behaviour in bypass mode (pi_old := pi_behaviour), so
  there the rollout correction may only mask tokens (IcePop band, rejection), never weight
  them; a ratio-free loss (reinforce) takes the truncated IS weights explicitly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "PolicyLossConfig",
    "RejectionRule",
    "RolloutRSError",
    "agg_loss",
    "apply_kl_penalty",
    "chunked_log_probs",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_kl_loss",
    "compute_pg_losses_cispo",
    "compute_pg_losses_decoupled",
    "compute_pg_losses_gspo",
    "compute_pg_losses_reinforce",
    "compute_pg_losses_vanilla",
    "compute_policy_loss",
    "compute_policy_loss_from_config",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "is_batch_norm_parts",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "parse_rollout_rs",
    "policy_loss_weights_by_ratio",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_correction",
    "truncate_logits_",
]

# Log-ratios are clamped to +-LOG_RATIO_BOUND before exp (verl's bound): exp(20) ~ 4.9e8 is
# finite in fp32, so one wild token cannot turn a batch loss into inf or NaN.
LOG_RATIO_BOUND = 20.0

Axis = int | tuple[int, ...] | None
IndexLike = Sequence[Hashable] | np.ndarray | Tensor

# --------------------------------------------------------------------------------------------
# 1. Masked helpers
# --------------------------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor, axis: Axis = None) -> Tensor:
    """Sum of `values` where `mask` is nonzero; NaN/inf outside the mask are ignored."""
    valid = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return valid.sum() if axis is None else valid.sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: Axis = None) -> Tensor:
    """Mean of `values` over mask-1 elements; 0 (not NaN) where the mask is empty."""
    total = masked_sum(values, mask, axis)
    count = mask.to(total.dtype)
    count = count.sum() if axis is None else count.sum(dim=axis)
    return total / count.clamp(min=1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over mask-1 elements (Bessel-corrected when `unbiased`).

    Differs from verl: with fewer than two valid elements verl raises; this returns the biased
    variance (0 for one element), so whitening a single token yields 0 instead of an error.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(variance.dtype).sum()
        variance = variance * torch.where(n > 1, n / (n - 1), torch.ones_like(n))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / std over mask-1 elements; re-adds the mean if not `shift_mean`."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _row_slices(n_rows: int, chunk_rows: int) -> list[slice]:
    return [slice(i, i + chunk_rows) for i in range(0, n_rows, chunk_rows)]


def _chunk_logits(
    inputs: Tensor, weight: Tensor | None, rows: slice, temperature: float, dtype: torch.dtype,
    top_k: int, top_p: float, labels: Tensor,
) -> tuple[Tensor, bool]:
    """(rows of logits / temperature in ``dtype``, truncated to the top-k / top-p set, and
    whether that tensor is ours to overwrite)."""
    block = inputs[rows]
    if weight is not None:
        z, owned = (block @ weight.T).to(dtype), True
    else:
        z = block.to(dtype)
        owned = z.data_ptr() != block.data_ptr()
    if temperature != 1.0:
        z, owned = (z.div_(temperature) if owned else z / temperature), True
    if top_k > 0 or top_p < 1.0:
        z, owned = truncate_logits_(z if owned else z.clone(), top_k, top_p, labels), True
    return z, owned


def truncate_logits_(z: Tensor, top_k: int, top_p: float, labels: Tensor | None = None) -> Tensor:
    """``z`` [rows, vocab] (logits / temperature) with -inf, in place, outside each row's
    top-k / top-p set, as vLLM's sampler builds it: top-k keeps the k largest (ties with the
    k-th too), then top-p sorts the rest ascending and drops a token while the renormalised
    mass of it and every smaller one is <= 1 - top_p (the largest always stays). ``labels``
    [rows]: the token each row is scored on stays in (an off-policy token the current weights
    would have cut gets the log-prob of the set plus itself, not -inf)."""
    if top_k <= 0 and top_p >= 1.0:
        return z
    label_z = z.gather(-1, labels[:, None]) if labels is not None else None
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z.masked_fill_(z < kth, -math.inf)
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1)
        cumulative = sorted_z.softmax(dim=-1).cumsum_(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[:, -1] = False
        z.scatter_(-1, order, sorted_z.masked_fill_(drop, -math.inf))
    if label_z is not None and labels is not None:
        z.scatter_(-1, labels[:, None], label_z)
    return z


_OUTER_SLICE_ROWS = 4096
"""Rows of a low-precision head's weight gradient whose product is formed at a time: 4.5 MiB
in bf16 at H = 576, where the whole [vocab, H] product would be 54 MiB (V = 49k) per chunk."""


def _accumulate_outer(total: Tensor, grad: Tensor, block: Tensor) -> None:
    """``total += grad.T @ block`` ([vocab, H]) without a [vocab, H] temporary: in place when
    the dtypes agree; an fp32 sum of bf16 products a slice of vocab rows at a time otherwise."""
    if total.dtype == grad.dtype:
        total.addmm_(grad.T, block)
        return
    for rows in _row_slices(total.shape[0], _OUTER_SLICE_ROWS):
        total[rows].add_(grad[:, rows].T @ block)


class _ChunkedLogProbs(torch.autograd.Function):
    """Per-token log-probs and entropies of softmax(logits / temperature), ``chunk_rows`` rows at
    a time, with logits = ``inputs`` (weight None) or ``inputs @ weight.T`` (a fused LM head);
    with top_k / top_p, of that softmax renormalised over the sampler's set
    (``truncate_logits_``).

    Saves only its inputs plus O(rows) statistics (log-sum-exp, entropy) and recomputes each
    chunk's softmax in backward, so at most one chunk's [chunk_rows, vocab] block (and its
    temporaries) exists at a time, in forward and in backward. With d lp / dz = onehot - p and
    d H / dz = -p * (log p + H), the gradient w.r.t. a chunk's logits is formed in place.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, inputs: Tensor, weight: Tensor | None, labels: Tensor, temperature: float,
        chunk_rows: int, with_entropy: bool, entropy_grad: bool, top_k: int, top_p: float,
        weight_grad_into: Callable[[], Tensor | None] | None,
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        dtype = torch.float64 if inputs.dtype == torch.float64 else torch.float32
        n = inputs.shape[0]
        log_probs = inputs.new_empty(n, dtype=dtype)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else log_probs.new_empty(0)
        for rows in _row_slices(n, chunk_rows):
            z, owned = _chunk_logits(inputs, weight, rows, temperature, dtype, top_k, top_p,
                                     labels[rows])
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[rows] = chunk_lse
            log_probs[rows] = z.gather(-1, labels[rows, None]).squeeze(-1) - chunk_lse
            if with_entropy:  # -sum(p * log p), in log_p's memory; lse - sum(p * z) would cancel
                log_p = z.sub_(chunk_lse[:, None]) if owned else z - chunk_lse[:, None]
                del z
                if top_k > 0 or top_p < 1.0:  # cut tokens: 0 * min, not 0 * -inf
                    log_p.clamp_(min=torch.finfo(dtype).min)
                entropy[rows] = -log_p.mul_(log_p.exp()).sum(-1)
                del log_p
            else:
                del z
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(inputs, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.dtype = temperature, chunk_rows, dtype
        ctx.top_k, ctx.top_p, ctx.weight_grad_into = top_k, top_p, weight_grad_into
        return log_probs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        inputs, weight, labels, lse, entropy = ctx.saved_tensors
        need_inputs, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 8
        if grad_lp is None and grad_ent is None:
            return None, None, *none
        grad_inputs = torch.empty_like(inputs) if need_inputs else None
        grad_weight, added_in_place = None, False
        if need_weight:
            dtype = torch.promote_types(weight.dtype, ctx.dtype)
            into = ctx.weight_grad_into() if ctx.weight_grad_into is not None else None
            added_in_place = (into is not None and into.dtype == dtype
                              and into.shape == weight.shape)
            grad_weight = into if added_in_place else torch.zeros_like(weight, dtype=dtype)
        for rows in _row_slices(inputs.shape[0], ctx.chunk_rows):
            z, owned = _chunk_logits(inputs, weight, rows, ctx.temperature, ctx.dtype, ctx.top_k,
                                     ctx.top_p, labels[rows])
            log_p = z.sub_(lse[rows, None]) if owned else z - lse[rows, None]
            del z
            if ctx.top_k > 0 or ctx.top_p < 1.0:
                log_p.clamp_(min=torch.finfo(ctx.dtype).min)
            if grad_ent is not None:  # -g_H * p * (log p + H), in log_p's memory
                probs = log_p.exp()
                grad = log_p.add_(entropy[rows, None]).mul_(probs).mul_(-grad_ent[rows, None])
                if grad_lp is not None:
                    grad.addcmul_(probs, grad_lp[rows, None], value=-1.0)
                del probs
            else:  # -g_lp * p, in log_p's memory: one [rows, vocab] block, not two
                grad = log_p.exp_().mul_(-grad_lp[rows, None])  # type: ignore[index]
            del log_p  # a name left on the block would keep it alive into the next chunk
            if grad_lp is not None:
                grad.scatter_add_(-1, labels[rows, None], grad_lp[rows, None])
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if weight is None:
                if grad_inputs is not None:
                    grad_inputs[rows] = grad
            else:
                grad = grad.to(weight.dtype)
                if grad_inputs is not None:
                    grad_inputs[rows] = grad @ weight
                if grad_weight is not None:
                    _accumulate_outer(grad_weight, grad, inputs[rows])
            del grad
        if added_in_place:
            return grad_inputs, None, *none
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_inputs, grad_weight, *none


def chunked_log_probs(
    inputs: Tensor,
    labels: Tensor,
    weight: Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int = 1024,
    top_k: int = -1,
    top_p: float = 1.0,
    weight_grad_into: Callable[[], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log_softmax(z / temperature)[label], entropy of softmax(z / temperature) or None) per
    position, fp32 (fp64 for fp64 inputs), where z = ``inputs`` [..., vocab] when ``weight`` is
    None, else z = ``inputs @ weight.T`` for hidden states [..., H] and an LM head [vocab, H].
    With ``top_k`` > 0 or ``top_p`` < 1, the distribution is the sampler's: z / temperature cut
    to its top-k / top-p set and renormalised (``truncate_logits_``; the label always stays in
    the set), so the log-probs equal vLLM's processed log-probs of the sampled tokens.

    Memory: ``chunk_rows`` rows of z at a time, in forward and backward (recomputed there); the
    autograd graph keeps only the inputs and two O(rows) vectors, never a [rows, vocab] tensor,
    and the fused form never builds z for all rows at all. The entropy is differentiable only
    with ``entropy_grad`` (a metric otherwise: no graph, no backward work).
    ``weight_grad_into``: asked in backward for a tensor the weight's gradient is added into
    in place (one of that gradient's dtype and shape; autograd then gets none for ``weight``),
    e.g. the gradient micro-batches accumulate: no second [vocab, H] buffer for it.
    Differs from verl: verl keeps bf16 results in bf16; fp32 keeps the PPO ratio exact.
    """
    if inputs.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must be inputs {tuple(inputs.shape)}[:-1]")
    if weight is not None and (weight.ndim != 2 or weight.shape[1] != inputs.shape[-1]):
        raise ValueError(f"weight {tuple(weight.shape)} must be [vocab, {inputs.shape[-1]}]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")
    flat = inputs.reshape(-1, inputs.shape[-1])
    log_probs, entropy = _ChunkedLogProbs.apply(
        flat, weight, labels.reshape(-1).long(), float(temperature), chunk_rows, with_entropy,
        entropy_grad, int(top_k), float(top_p), weight_grad_into,
    )
    return log_probs.reshape(labels.shape), (entropy.reshape(labels.shape) if with_entropy
                                             else None)


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, chunk_rows: int = 1024, temperature: float = 1.0
) -> Tensor:
    """log_softmax(logits / temperature)[..., label] per position (`chunked_log_probs`).

    `logits` is (..., vocab), `labels` is (...). fp16/bf16 logits are upcast per chunk and give
    fp32; backward recomputes each chunk's softmax instead of keeping it.
    """
    return chunked_log_probs(logits, labels, temperature=temperature, chunk_rows=chunk_rows)[0]


def entropy_from_logits(logits: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per position, -sum(p * log p), with gradients
    (`chunked_log_probs`)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    entropy = chunked_log_probs(logits, labels, with_entropy=True, entropy_grad=True,
                                chunk_rows=chunk_rows)[1]
    assert entropy is not None
    return entropy


# --------------------------------------------------------------------------------------------
# 2. Registries
# --------------------------------------------------------------------------------------------

FnT = TypeVar("FnT", bound=Callable[..., Any])


class _Registry(Generic[FnT]):
    """Name -> function table that refuses to overwrite a name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, FnT] = {}
        self.view: Mapping[str, FnT] = MappingProxyType(self._fns)

    def register(self, name: str) -> Callable[[FnT], FnT]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: FnT) -> FnT:
            if name in self._fns:
                taken_by = getattr(self._fns[name], "__qualname__", repr(self._fns[name]))
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {taken_by}); "
                    "register yours under another name"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> FnT:
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._fns)}")
        return self._fns[name]


# A registered advantage estimator is called as
#   fn(token_level_rewards, response_mask, *, index, values, reward_baselines, gamma, lam,
#      norm_adv_by_std_in_grpo, epsilon) -> (advantages, returns)
# and must accept every keyword (ignore the ones it does not need, e.g. with **kwargs).
AdvEstimatorFn = Callable[..., tuple[Tensor, Tensor]]
# A registered policy loss is called as
#   fn(old_log_prob, log_prob, advantages, response_mask, config, *, rollout_log_prob)
#   -> (pg_losses: per-token loss matrix, metrics: dict[str, Tensor])
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

_ADV_REGISTRY: _Registry[AdvEstimatorFn] = _Registry("advantage estimator")
_POLICY_LOSS_REGISTRY: _Registry[PolicyLossFn] = _Registry("policy loss")
_RATIO_FREE_LOSSES: set[str] = set()

ADV_ESTIMATORS: Mapping[str, AdvEstimatorFn] = _ADV_REGISTRY.view
POLICY_LOSSES: Mapping[str, PolicyLossFn] = _POLICY_LOSS_REGISTRY.view


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator; a taken name raises ValueError."""
    return _ADV_REGISTRY.register(name)


def get_adv_estimator_fn(name: str) -> AdvEstimatorFn:
    """The estimator registered as `name`; unknown names raise ValueError listing known ones."""
    return _ADV_REGISTRY.get(name)


def register_policy_loss(
    name: str, *, weights_by_ratio: bool = True
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a per-token policy loss; a taken name raises ValueError.

    weights_by_ratio: the surrogate multiplies each token by pi / pi_old (PPO-style). In bypass
    mode that ratio is already pi / pi_behaviour, so rollout corrections only mask its tokens;
    pass False for a ratio-free loss (like "reinforce"), which then takes the IS weights.
    """
    register = _POLICY_LOSS_REGISTRY.register(name)

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        fn = register(fn)
        if not weights_by_ratio:
            _RATIO_FREE_LOSSES.add(name)
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; unknown names raise ValueError listing known ones."""
    return _POLICY_LOSS_REGISTRY.get(name)


def policy_loss_weights_by_ratio(name: str) -> bool:
    """Whether the registered loss `name` weights tokens by pi / pi_old (register_policy_loss)."""
    get_policy_loss_fn(name)
    return name not in _RATIO_FREE_LOSSES


# --------------------------------------------------------------------------------------------
# 3. Aggregation
# --------------------------------------------------------------------------------------------

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a (batch, length) loss matrix into a scalar, as verl's `agg_loss`.

    - token-mean: sum of valid token losses / number of valid tokens.
    - token-sum: sum of valid token losses, unnormalised (`num_tokens` / `num_seqs` unused).
      verl multiplies this sum by the data-parallel size inside agg_loss so that the mean that
      DDP/FSDP takes over ranks becomes the global token sum; here the learner scales every
      loss by its world size instead (learner/update_loop.py), which gives the same gradient
      and keeps this file free of distributed state.
    - seq-mean-token-sum: mean over non-empty sequences of each sequence's token sum.
    - seq-mean-token-mean: mean over non-empty sequences of each sequence's token mean.
    - seq-mean-token-sum-norm: seq-mean-token-sum / `loss_scale_factor` (Dr. GRPO's constant
      horizon; default loss_mask.shape[-1], so pass it when micro-batches differ in width).

    `num_tokens` / `num_seqs` replace the local counts with counts over a whole mini-batch
    (valid tokens; sequences with at least one valid token) so that the losses of its
    micro-batches sum exactly to the mini-batch loss. Empty rows contribute 0; an empty batch
    gives 0, never NaN.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
        return masked_sum(loss_mat, mask) / _safe_count(denom, loss_mat)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask)
    _check_agg_mode(loss_agg_mode)
    tokens_per_seq = mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / tokens_per_seq.clamp(min=1e-8)
    nonempty = (tokens_per_seq > 0).to(loss_mat.dtype)
    denom = nonempty.sum() if num_seqs is None else torch.as_tensor(num_seqs)
    loss = (seq_losses * nonempty).sum() / _safe_count(denom, loss_mat)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _zero_outside(mask: Tensor, *tensors: Tensor) -> list[Tensor]:
    """Each tensor with mask-0 entries set to 0: values and gradients there become exactly 0."""
    valid = mask.bool()
    return [torch.where(valid, x, torch.zeros_like(x)) for x in tensors]


def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {LOSS_AGG_MODES}")


def _safe_count(count: Tensor, like: Tensor) -> Tensor:
    return count.to(device=like.device, dtype=like.dtype).clamp(min=1e-8)


# --------------------------------------------------------------------------------------------
# 4. Advantage estimators
# --------------------------------------------------------------------------------------------


def _float_mask(response_mask: Tensor, like: Tensor) -> Tensor:
    return response_mask.to(device=like.device, dtype=like.dtype)


def _index_groups(index: IndexLike, batch_size: int, device: torch.device) -> list[Tensor]:
    """Row positions of each group, in order of first appearance."""
    keys = index.tolist() if isinstance(index, Tensor | np.ndarray) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries for a batch of {batch_size}")
    groups: dict[Hashable, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    return [torch.tensor(rows, dtype=torch.long, device=device) for rows in groups.values()]


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE as verl's current version: the recursion skips mask-0 tokens.

    At a mask-0 position (padding or an observation token between turns) neither the value nor
    the TD error enters: the next value and the running advantage are carried across it, so
    interior observation tokens do not break the recursion. Rewards must sit on mask-1 tokens.
    Returns (advantages whitened over valid tokens, returns = raw advantages + values).
    """
    with torch.no_grad():
        mask = _float_mask(response_mask, values)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            valid = mask[:, t] > 0
            next_value = torch.where(valid, values[:, t], next_value)
            last_gae = torch.where(valid, gae_t, last_gae)
            advantages[:, t] = last_gae
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: IndexLike,
    center: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """Outcome advantage: `center` maps each group's scores to per-row scalars, broadcast."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _index_groups(index, scores.shape[0], scores.device):
            out[rows] = center(scores[rows])
        advantages = out.unsqueeze(-1) * _float_mask(response_mask, scores)
    return advantages, advantages


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: (score - group mean) / (group std + epsilon), score = sum of token rewards.

    A group of one gets mean 0 and std 1 (verl). norm_adv_by_std_in_grpo=False is Dr. GRPO.
    Returns (advantages, advantages), broadcast over valid tokens.
    """

    def center(scores: Tensor) -> Tensor:
        if scores.numel() == 1:
            mean, std = torch.zeros_like(scores[0]), torch.ones_like(scores[0])
        else:
            mean, std = scores.mean(), scores.std()
        return (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean

    return _group_baseline(token_level_rewards, response_mask, index, center)


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """RLOO: score minus the mean of the other scores of its group, n/(n-1) * (r - mean).

    A group of one keeps its raw score (verl). `epsilon` is unused (verl signature).
    """

    def center(scores: Tensor) -> Tensor:
        n = scores.numel()
        return scores if n == 1 else (scores - scores.mean()) * n / (n - 1)

    return _group_baseline(token_level_rewards, response_mask, index, center)


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: IndexLike,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean, then whiten over all valid tokens."""
    centered, _ = _group_baseline(
        token_level_rewards,
        response_mask,
        index,
        lambda scores: scores - (scores.mean() if scores.numel() > 1 else 0.0),
    )
    with torch.no_grad():
        mask = _float_mask(response_mask, centered)
        advantages = masked_whiten(centered, mask) * mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over valid tokens, as verl.

    Mask-0 tokens are skipped like in GAE: observation tokens between turns neither cut the
    running return nor take a discount step, and right padding starts each row's scan at 0
    (verl's current code carries the return across observation spans the same way). Returns
    and advantages are 0 at mask-0 positions, as in verl. Rewards must sit on mask-1 tokens.
    """
    with torch.no_grad():
        mask = _float_mask(response_mask, token_level_rewards)
        valid = mask > 0
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            updated = token_level_rewards[:, t] + gamma * running
            running = torch.where(valid[:, t], updated, running)
            returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    reward_baselines: Tensor,
    response_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """ReMax: undiscounted reward-to-go minus the greedy rollout's reward (one per row)."""
    with torch.no_grad():
        mask = _float_mask(response_mask, token_level_rewards)
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


def _require(value: Any, what: str, estimator: str) -> Any:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return value


@register_adv_estimator("gae")
def _gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    values = _require(values, "values (a critic)", "gae")
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


@register_adv_estimator("grpo")
def _grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: IndexLike | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    index = _require(index, "index (group ids)", "grpo")
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_estimator("dr_grpo")
def _dr_grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: IndexLike | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO without std normalisation (verl's Dr. GRPO recipe; pair it with
    loss_agg_mode="seq-mean-token-sum-norm")."""
    index = _require(index, "index (group ids)", "dr_grpo")
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo=False
    )


@register_adv_estimator("rloo")
def _rloo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: IndexLike | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    index = _require(index, "index (group ids)", "rloo")
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon)


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(
    token_level_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0, **_: Any
) -> tuple[Tensor, Tensor]:
    return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: IndexLike | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    index = _require(index, "index (group ids)", "reinforce_plus_plus_baseline")
    return compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon
    )


@register_adv_estimator("remax")
def _remax(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_baselines: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    reward_baselines = _require(reward_baselines, "reward_baselines (greedy rewards)", "remax")
    return compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)


def _tensor_or_none(data: Mapping[str, Any], key: str, like: Tensor) -> Tensor | None:
    if key not in data or data[key] is None:
        return None
    return torch.as_tensor(data[key], device=like.device)


def compute_advantage(
    data: Mapping[str, Any],
    adv_estimator: str,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    index_key: str = "group_id",
) -> tuple[Tensor, Tensor]:
    """Run the registered estimator `adv_estimator` on `data`; returns (advantages, returns).

    Reads `token_level_rewards`, `response_mask`, and when present `values`,
    `reward_baselines` and the group ids under `index_key` (a numpy array or list of str/int).
    The default key is "group_id", not verl's "uid": a streamrl `uid` names one trajectory, so
    grouping by it would silently make every GRPO group a group of one.
    Every estimator, built-in or user-registered, is called the same way, with every keyword.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    rewards = torch.as_tensor(data["token_level_rewards"])
    return fn(
        rewards,
        torch.as_tensor(data["response_mask"], device=rewards.device),
        index=data.get(index_key),
        values=_tensor_or_none(data, "values", rewards),
        reward_baselines=_tensor_or_none(data, "reward_baselines", rewards),
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )


# --------------------------------------------------------------------------------------------
# 5. KL
# --------------------------------------------------------------------------------------------

_KL_BASE_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_TYPES: tuple[str, ...] = _KL_BASE_TYPES + tuple(f"{k}+" for k in _KL_BASE_TYPES)


def _kl_forward(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (ref_logprob - logprob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return (log_ratio.exp() - log_ratio - 1).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown kl_penalty {kind!r}; known: {KL_PENALTY_TYPES}")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    "kl"/"k1": logp - ref; "abs": |logp - ref|; "mse"/"k2": (logp - ref)^2 / 2;
    "low_var_kl"/"k3": exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    A trailing "+" (e.g. "k3+") keeps that estimator's value but takes the gradient of k2, the
    one with an unbiased KL gradient (straight-through).
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """`kl_penalty` under a name that `apply_kl_penalty`'s argument does not shadow."""
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    forward = _kl_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


class KLController:
    """A KL coefficient `value` that `update(current_kl, n_steps)` may adjust; checkpointable."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController(KLController):
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""


class AdaptiveKLController(KLController):
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), as verl.

    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(
    kl_ctrl_type: str,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> KLController:
    """Controller by type: "fixed" (kl_coef) or "adaptive" (also target_kl and horizon)."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl_type {kl_ctrl_type!r}; known: ('fixed', 'adaptive')")


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """KL in the reward (verl's `apply_kl_penalty`): rewards = scores - beta * KL per token.

    The batch KL (per-sequence token mean, averaged over rows) then updates `kl_ctrl` with
    n_steps = batch size. Metrics report that KL and the beta that was applied.
    """
    mask = _float_mask(response_mask, token_level_scores)
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


def compute_kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """KL as a loss term (verl's use_kl_loss): agg_loss(kl_penalty(log_prob, ref, type))."""
    log_prob, ref_log_prob = _zero_outside(response_mask, log_prob, ref_log_prob)
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(
        kld,
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )


# --------------------------------------------------------------------------------------------
# 6. Policy losses
# --------------------------------------------------------------------------------------------


def _ppo_clip(
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's vanilla PPO per-token loss: clip-higher, plus dual clip for negative advantages."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {clip_ratio_c}")
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    losses1 = -advantages * ratio
    losses2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(losses3, clipped), clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((losses2 > losses1).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean(
            ((clipped > losses3) & negative).float(), response_mask
        ),
    }
    return pg_losses, {k: v.detach() for k, v in metrics.items()}


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """verl's vanilla PPO loss: returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)); clip to [1 - low, 1 + high]
    (clip-higher when high > low); for negative advantages the loss is also capped at
    -A * clip_ratio_c (dual clip).
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("set cliprange, or both cliprange_low and cliprange_high")
    old_log_prob, log_prob, advantages = _zero_outside(
        response_mask, old_log_prob, log_prob, advantages
    )
    pg_losses, m = _ppo_clip(
        log_prob - old_log_prob, advantages, response_mask, low, high, clip_ratio_c
    )
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, m["actor/pg_clipfrac"], m["actor/ppo_kl"], m["actor/pg_clipfrac_lower"]


def _both_or_neither(low: float | None, high: float | None, what: str) -> None:
    if (low is None) != (high is None):
        raise ValueError(f"set both {what}_low and {what}_high, or neither")
    if low is not None and high is not None and not 0 < low <= high:
        raise ValueError(f"{what} bounds need 0 < low <= high, got {low}, {high}")


ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
# verl aggregates GSPO with this mode whatever loss_agg_mode says; streamrl follows
# loss_agg_mode and warns when the two differ.
GSPO_VERL_AGG_MODE = "seq-mean-token-mean"


@dataclass(frozen=True)
class PolicyLossConfig:
    """How `compute_policy_loss_from_config` turns log-probs and advantages into a loss.

    loss_mode: a registered policy loss ("vanilla", "gspo", "cispo", "decoupled", "reinforce",
        or yours).
    clip_ratio / clip_ratio_low / clip_ratio_high: PPO clip range; low/high default to
        clip_ratio (set high > low for DAPO's clip-higher).
    clip_ratio_c: dual-clip bound for negative advantages (vanilla and decoupled), > 1.
    gspo_clip_ratio_low/high, cispo_clip_ratio_low/high: per-mode clip ranges, defaulting to
        the PPO ones (GSPO's paper uses ~3e-4 / 4e-4; CISPO's only clips above).
    loss_agg_mode / loss_scale_factor: see `agg_loss`.
    bypass: no recomputed proximal log-probs; the behaviour (rollout) log-probs are the PPO
        "old" log-probs, so the ratio itself is the importance weight. Corrections then compare
        the current policy (detached) with the behaviour, and for a loss that weights by the
        ratio they only mask (see `register_policy_loss`).
    Rollout correction (verl's rollout_corr) on r = pi_old / pi_behaviour (bypass: pi / pi_behav):
    tis_cap: truncated importance sampling, weight min(w, tis_cap) (verl rollout_is_threshold).
    rollout_is_level: "token" (w = r per token) or "sequence" (w = prod r over the row, the
        same weight on each of its tokens) (verl rollout_is).
    rollout_is_batch_normalize: divide the truncated weights by their mean (over valid tokens,
        or over non-empty sequences at sequence level) so that they average 1.
    icepop_low/high: IcePop, weight r inside [low, high]; outside, the token is rejected.
    icepop_level: "token" (r per token) or "sequence" (r = prod over the row: the whole row is
        weighted by it, or rejected).
    rejection_low/high: reject whole sequences whose geometric-mean ratio lies outside
        [low, high].
    Rejected tokens leave the loss mask (verl's modified response_mask): they count in no
    denominator.
    rollout_rs / rollout_rs_threshold: verl's k1/k2/k3 rejection, see `parse_rollout_rs`.
    decoupled_weight_cap: "decoupled" only; behaviour weights above it become 0 (AReaL's
        behav_imp_weight_cap).
    """

    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    gspo_clip_ratio_low: float | None = None
    gspo_clip_ratio_high: float | None = None
    cispo_clip_ratio_low: float | None = None
    cispo_clip_ratio_high: float | None = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    bypass: bool = False
    tis_cap: float | None = None
    rollout_is_level: str = "token"
    rollout_is_batch_normalize: bool = False
    icepop_low: float | None = None
    icepop_high: float | None = None
    icepop_level: str = "token"
    rejection_low: float | None = None
    rejection_high: float | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    decoupled_weight_cap: float | None = None

    def __post_init__(self) -> None:
        get_policy_loss_fn(self.loss_mode)
        _check_agg_mode(self.loss_agg_mode)
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {self.clip_ratio_c}")
        self._check_is_weights()
        _both_or_neither(self.icepop_low, self.icepop_high, "icepop")
        if self.icepop_level not in ROLLOUT_IS_LEVELS:
            raise ValueError(
                f"unknown icepop_level {self.icepop_level!r}; known: {ROLLOUT_IS_LEVELS}"
            )
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")
        _both_or_neither(self.rejection_low, self.rejection_high, "rejection")
        if self.rollout_rs is not None or self.rollout_rs_threshold is not None:
            parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)
        if self.bypass and self.loss_mode == "decoupled":
            raise ValueError("'decoupled' needs recomputed proximal log-probs; unset bypass")
        if self.bypass and self.tis_cap is not None and self.weights_by_ratio:
            raise ValueError(
                f"bypass makes the {self.loss_mode!r} ratio the importance weight; tis_cap "
                "would weight tokens twice (use icepop / rejection masks, or 'reinforce')"
            )
        if self.loss_mode == "decoupled" and (
            self.tis_cap is not None or self.icepop_low is not None
        ):
            raise ValueError(
                "'decoupled' already weights tokens by pi_prox / pi_behaviour; "
                "use decoupled_weight_cap instead of tis_cap / icepop bounds"
            )
        if self.loss_mode == "gspo" and self.loss_agg_mode != GSPO_VERL_AGG_MODE:
            warnings.warn(
                f"GSPO aggregates with loss_agg_mode={self.loss_agg_mode!r}; verl always uses "
                f"{GSPO_VERL_AGG_MODE!r} for GSPO (set loss_agg_mode to match it)",
                stacklevel=3,
            )

    def _check_is_weights(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.rollout_is_level not in ROLLOUT_IS_LEVELS:
            raise ValueError(
                f"unknown rollout_is_level {self.rollout_is_level!r}; known: {ROLLOUT_IS_LEVELS}"
            )
        if self.tis_cap is None and (
            self.rollout_is_level != "token" or self.rollout_is_batch_normalize
        ):
            raise ValueError(
                "rollout_is_level='sequence' and rollout_is_batch_normalize act on the "
                "truncated IS weights: set tis_cap too"
            )

    def clip_range(self, mode: str = "ppo") -> tuple[float, float]:
        """(low, high) clip range for "ppo", "gspo" or "cispo", with fallbacks applied."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        override = {
            "ppo": (None, None),
            "gspo": (self.gspo_clip_ratio_low, self.gspo_clip_ratio_high),
            "cispo": (self.cispo_clip_ratio_low, self.cispo_clip_ratio_high),
        }[mode]
        return (
            low if override[0] is None else override[0],
            high if override[1] is None else override[1],
        )

    @property
    def weights_by_ratio(self) -> bool:
        """Whether loss_mode's surrogate already weights tokens by pi / pi_old."""
        return policy_loss_weights_by_ratio(self.loss_mode)

    @property
    def corrects_rollout(self) -> bool:
        """Whether any rollout correction is set (they need behaviour log-probs)."""
        return self.tis_cap is not None or self.rejects

    @property
    def rejects(self) -> bool:
        """Whether a rule may drop tokens from the loss mask (IcePop, rejection, rollout_rs)."""
        return any(v is not None for v in (self.icepop_low, self.rejection_low, self.rollout_rs))


@register_policy_loss("vanilla")
def compute_pg_losses_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token vanilla PPO loss (clip-higher, dual clip) as verl's compute_policy_loss_vanilla."""
    low, high = config.clip_range("ppo")
    return _ppo_clip(
        log_prob - old_log_prob, advantages, response_mask, low, high, config.clip_ratio_c
    )


@register_policy_loss("gspo")
def compute_pg_losses_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv:2507.18071) per-token loss, as verl's compute_policy_loss_gspo.

    Each token uses the sequence ratio s = exp(mean over valid tokens of log(pi / pi_old)) in
    value, with a token-level gradient: log s_t = sg(log s) + log_prob - sg(log_prob), clamped
    above at 10. No dual clip. Aggregation follows loss_agg_mode (verl >= 0.9 default
    "token-mean"; the paper's is "seq-mean-token-mean").
    """
    low, high = config.clip_range("gspo")
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1)
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = log_s.clamp(max=10.0).exp()
    losses1 = -advantages * s
    losses2 = -advantages * s.clamp(1 - low, 1 + high)
    metrics = {
        "actor/pg_clipfrac": masked_mean((losses2 > losses1).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return torch.maximum(losses1, losses2), {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("cispo")
def compute_pg_losses_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(ratio)) * A * log_prob, as verl.

    Every token keeps the gradient of its own log-prob however far its ratio moved; the
    clipped ratio is only a detached weight.
    """
    low, high = config.clip_range("cispo")
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - low, 1 + high)
    pg_losses = -clipped.detach() * advantages * log_prob
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return pg_losses, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("decoupled")
def compute_pg_losses_decoupled(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, arXiv:2505.24298): PPO against the proximal policy, weighted.

    `old_log_prob` is the proximal policy (recomputed with the current weights), and
    `rollout_log_prob` the behaviour policy that generated the tokens. The vanilla PPO loss
    (ratio pi / pi_prox) is multiplied by the detached weight pi_prox / pi_behaviour; weights
    above `decoupled_weight_cap` become 0.
    """
    if rollout_log_prob is None:
        raise ValueError("'decoupled' needs rollout_log_prob (the behaviour log-probs)")
    pg_losses, metrics = compute_pg_losses_vanilla(
        old_log_prob, log_prob, advantages, response_mask, config
    )
    with torch.no_grad():
        log_w = (old_log_prob - rollout_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        weight = log_w.exp()
        if config.decoupled_weight_cap is not None:
            capped = weight > config.decoupled_weight_cap
            weight = torch.where(capped, torch.zeros_like(weight), weight)
            metrics["actor/behav_weight_capped_frac"] = masked_mean(capped.float(), response_mask)
        metrics["actor/behav_weight_mean"] = masked_mean(weight, response_mask)
    return pg_losses * weight, metrics


@register_policy_loss("reinforce", weights_by_ratio=False)
def compute_pg_losses_reinforce(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE, -A * log_prob per token, as verl's compute_policy_loss_reinforce.

    No ratio and no clipping. The truncated IS weights (tis_cap, rollout_is_level) multiply it
    as detached weights in `compute_policy_loss_from_config`, in bypass mode too, where they
    compare the current policy with the behaviour (verl's bypass loss_type "reinforce").
    "actor/ppo_kl" is the mean of old_log_prob - log_prob (bypass: the behaviour's).
    """
    zero = torch.zeros((), device=log_prob.device)
    metrics = {
        "actor/pg_clipfrac": zero,
        "actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask),
        "actor/pg_clipfrac_lower": zero,
    }
    return -advantages * log_prob, {k: v.detach() for k, v in metrics.items()}


def compute_rollout_is_weights(
    log_ratio: Tensor,
    response_mask: Tensor,
    rollout_is_threshold: float,
    rollout_is_level: str = "token",
    rollout_is_batch_normalize: bool = False,
    batch_norm_factor: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance-sampling weights, as verl's compute_rollout_correction_weights.

    `log_ratio` is log pi_old - log pi_behaviour per token (no gradient flows through it).
    "token": w_t = exp(log_ratio_t). "sequence": w = exp(sum of the row's log-ratios), the same
    on every valid token of the row. Log-ratios and their sums are clamped to +-20 before exp.
    Weights are 0 at mask-0 positions and truncated at `rollout_is_threshold`; with
    `rollout_is_batch_normalize` they are then divided by their mean (over valid tokens, or over
    non-empty rows at sequence level; see `is_batch_norm_parts`) unless that mean is below
    1e-8. `batch_norm_factor` is that mean taken over more rows than these (the learner's
    whole mini-batch on every rank, so that micro-batches share one factor).
    Metrics (verl's): rollout_is_ratio_fraction_high / _low, the share of tokens (of non-empty
    rows at sequence level) whose raw weight is above the threshold / below its inverse; then,
    of the truncated weights actually applied (before batch normalisation), rollout_is_mean
    over valid tokens and rollout_is_eff_sample_size 1 / mean((w / mean w)^2); and
    rollout_is_batch_norm_factor.
    """
    if rollout_is_level not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"unknown rollout_is_level {rollout_is_level!r}; known: {ROLLOUT_IS_LEVELS}"
        )
    with torch.no_grad():
        mask = response_mask.bool()
        raw = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
        if rollout_is_level == "sequence":
            raw = raw.sum(dim=-1, keepdim=True).expand_as(raw)
        weights = torch.where(mask, raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp(), 0.0)
        # one weight per unit: a token, or a non-empty row (its tokens share the weight)
        units, unit_mask = (
            (weights.amax(dim=-1), mask.any(dim=-1)) if rollout_is_level == "sequence"
            else (weights, mask)
        )
        low, high = 1.0 / rollout_is_threshold, rollout_is_threshold
        prefix = "rollout_corr/rollout_is"
        metrics = {
            f"{prefix}_ratio_fraction_high": masked_mean((units > high).float(), unit_mask),
            f"{prefix}_ratio_fraction_low": masked_mean((units < low).float(), unit_mask),
        }
        weights, units = weights.clamp(max=high), units.clamp(max=high)
        mean = masked_mean(weights, mask)
        ess = 1.0 / masked_mean((weights / (mean + 1e-8)).square(), mask)
        metrics[f"{prefix}_mean"] = mean
        metrics[f"{prefix}_eff_sample_size"] = torch.where(mask.any(), ess, torch.zeros_like(ess))
        if rollout_is_batch_normalize:
            if batch_norm_factor is None:
                mean = masked_mean(units, unit_mask)
            else:
                mean = torch.as_tensor(batch_norm_factor, dtype=weights.dtype,
                                       device=weights.device)
            factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
            weights = weights / factor
            metrics[f"{prefix}_batch_norm_factor"] = factor
    return weights, metrics


class RolloutRSError(ValueError):
    """A bad rollout_rs / rollout_rs_threshold: `key` names which one, `value` is its value."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(f"{key}={value!r}: {why}")
        self.key, self.value, self.why = key, value, why


# verl's rollout_rs statistics of lr = log pi_old - log pi_behaviour (clamped to +-20):
# per-token divergence estimates, then how a rule reduces them (per token, or per sequence and
# broadcast to its tokens). A rule's option name is "<reduction>_<estimate>".
_RS_ESTIMATES: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr.square(),
    "k3": lambda lr: lr.exp() - 1.0 - lr,
}
_RS_REDUCTIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": lambda stat, mask: stat,
    "seq_sum": lambda stat, mask: masked_sum(stat, mask, axis=-1).unsqueeze(-1),
    "seq_mean": lambda stat, mask: masked_mean(stat, mask, axis=-1).unsqueeze(-1),
    "seq_max": lambda stat, mask: _row_max(stat, mask),
}
ROLLOUT_RS_OPTIONS: tuple[str, ...] = tuple(
    f"{reduction}_{estimate}"
    for reduction in _RS_REDUCTIONS
    for estimate in _RS_ESTIMATES
    if (reduction, estimate) != ("seq_max", "k1")  # max of a signed estimate: not in verl
)


def _row_max(values: Tensor, mask: Tensor) -> Tensor:
    """(batch, 1) maximum over each row's mask-1 entries; 0 for an empty row."""
    masked = torch.where(mask.bool(), values, torch.full_like(values, -math.inf))
    top = masked.amax(dim=-1, keepdim=True)
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


@dataclass(frozen=True)
class RejectionRule:
    """One rollout_rs option with its bounds: keep lower <= stat <= upper (lower: k1 only)."""

    option: str
    upper: float
    lower: float | None = None


def parse_rollout_rs(
    rollout_rs: str | None, rollout_rs_threshold: str | float | None
) -> tuple[RejectionRule, ...]:
    """verl's rollout_rs / rollout_rs_threshold pair as rules; () when both are None.

    rollout_rs: a comma list of ROLLOUT_RS_OPTIONS, e.g. "token_k1,seq_mean_k3" (repeats are
    dropped). rollout_rs_threshold: one value shared by every option, or a comma list with one
    value per option. A k2 / k3 option takes an upper bound u > 0 and keeps stat <= u. A k1
    option takes "lower_upper" (or "upper", meaning lower = 1 / upper), 0 < lower <= upper, and
    keeps log(lower) <= stat <= log(upper); as k1 = -log r, this bounds exp(k1) = pi_behaviour
    / pi_old, exactly as verl's code does (the same as bounding r when lower = 1 / upper).
    Raises RolloutRSError naming the offending key and value.
    """
    if rollout_rs is None:
        if rollout_rs_threshold is not None:
            raise RolloutRSError("rollout_rs_threshold", rollout_rs_threshold,
                                 "is set but rollout_rs is not")
        return ()
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise RolloutRSError("rollout_rs", rollout_rs,
                             f"must be a comma list of {', '.join(ROLLOUT_RS_OPTIONS)}")
    specs = _threshold_specs(rollout_rs_threshold, len(options))
    return tuple(_rule(o, s, rollout_rs_threshold) for o, s in zip(options, specs, strict=True))


def _threshold_specs(threshold: str | float | None, n_options: int) -> list[str]:
    if threshold is None:
        raise RolloutRSError("rollout_rs_threshold", None, "is required with rollout_rs")
    if isinstance(threshold, bool) or not isinstance(threshold, str | int | float):
        raise RolloutRSError("rollout_rs_threshold", threshold, "must be a number or a string")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, n_options):
        raise RolloutRSError("rollout_rs_threshold", threshold,
                             f"needs one value, or one per rollout_rs option ({n_options})")
    return specs * n_options if len(specs) == 1 else specs


def _rule(option: str, spec: str, threshold: str | float) -> RejectionRule:
    is_k1 = option.endswith("k1")
    parts = spec.split("_")
    try:
        bounds = [float(p) for p in parts]
    except ValueError:
        bounds = []
    if is_k1 and len(bounds) == 1 and bounds[0] > 0:
        bounds = [1.0 / bounds[0], bounds[0]]
    valid = len(bounds) == (2 if is_k1 else 1) and all(b > 0 for b in bounds)
    if not valid or bounds[0] > bounds[-1]:
        form = "'lower_upper' or 'upper', 0 < lower <= upper" if is_k1 else "one number > 0"
        raise RolloutRSError("rollout_rs_threshold", threshold, f"{spec!r} for {option}: {form}")
    return RejectionRule(option, upper=bounds[-1], lower=bounds[0] if is_k1 else None)


def compute_rollout_rejection_mask(
    log_ratio: Tensor,
    response_mask: Tensor,
    rollout_rs: str,
    rollout_rs_threshold: str | float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's compute_rollout_rejection_mask: which tokens every rollout_rs rule keeps.

    With lr = log pi_old - log pi_behaviour per token, clamped to +-20: k1 = -lr,
    k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr (r - 1 - log r). "token_k*" tests each token;
    "seq_sum_k*", "seq_mean_k*" and "seq_max_k*" test the sum, mean or maximum over the row's
    valid tokens and keep or reject the whole row. Rules are AND-combined; bounds as in
    `parse_rollout_rs`. Returns (keep: bool, batch x length; metrics): rollout_rs_masked_fraction
    (rejected share of valid tokens), the same per option, and rollout_rs_seq_masked_fraction
    (share of non-empty rows with a rejected token).
    """
    rules = parse_rollout_rs(rollout_rs, rollout_rs_threshold)
    with torch.no_grad():
        mask = response_mask.bool()
        lr = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
        lr = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        keep = torch.ones_like(mask)
        prefix = "rollout_corr/rollout_rs"
        metrics: dict[str, Tensor] = {}
        for rule in rules:
            reduction, estimate = rule.option.rsplit("_", 1)
            stat = _RS_REDUCTIONS[reduction](_RS_ESTIMATES[estimate](lr), mask).expand_as(lr)
            kept = stat <= (math.log(rule.upper) if rule.lower is not None else rule.upper)
            if rule.lower is not None:
                kept = kept & (stat >= math.log(rule.lower))
            metrics[f"{prefix}_{rule.option}_masked_fraction"] = masked_mean((~kept).float(), mask)
            keep = keep & kept
        rejected = ~keep & mask
        metrics[f"{prefix}_masked_fraction"] = masked_mean(rejected.float(), mask)
        metrics[f"{prefix}_seq_masked_fraction"] = masked_mean(
            rejected.any(dim=-1).float(), mask.any(dim=-1)
        )
    return keep, metrics


def _sequence_log_ratio(raw: Tensor, mask: Tensor) -> Tensor:
    """(batch, 1) sum of each row's log-ratios over its valid tokens, clamped to +-20."""
    return masked_sum(raw, mask, axis=-1).unsqueeze(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _icepop_ratio(raw: Tensor, mask: Tensor, level: str) -> Tensor:
    """IcePop's ratio per token: the token's own r, or its row's prod r at sequence level."""
    log_ratio = _sequence_log_ratio(raw, mask).expand_as(raw) if level == "sequence" else raw
    return torch.where(mask, log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp(), 0.0)


def _keep_within_bounds(
    raw: Tensor,
    mask: Tensor,
    icepop: tuple[float | None, float | None],
    icepop_level: str,
    rejection: tuple[float | None, float | None],
    metrics: dict[str, Tensor],
) -> Tensor:
    """IcePop (token or sequence ratio) and geometric-mean (sequence) bounds as a keep mask of
    valid tokens; adds metrics."""
    keep = mask.clone()
    if icepop[0] is not None and icepop[1] is not None:
        ratio = _icepop_ratio(raw, mask, icepop_level)
        outside = mask & ((ratio < icepop[0]) | (ratio > icepop[1]))
        keep = keep & ~outside
        metrics["rollout_corr/icepop_maskfrac"] = masked_mean(outside.float(), mask)
    if rejection[0] is not None and rejection[1] is not None:
        seq_log_ratio = masked_mean(raw, mask, axis=-1)
        rejected = (seq_log_ratio < math.log(rejection[0])) | (
            seq_log_ratio > math.log(rejection[1])
        )
        keep = keep & ~rejected.unsqueeze(-1)
        metrics["rollout_corr/rejected_seq_frac"] = masked_mean(
            rejected.float(), mask.any(dim=-1).float()
        )
    return keep


def compute_rollout_correction(
    log_ratio: Tensor,
    response_mask: Tensor,
    *,
    tis_cap: float | None = None,
    rollout_is_level: str = "token",
    rollout_is_batch_normalize: bool = False,
    icepop_low: float | None = None,
    icepop_high: float | None = None,
    icepop_level: str = "token",
    rejection_low: float | None = None,
    rejection_high: float | None = None,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    masks_only: bool = False,
    is_batch_norm_factor: Tensor | float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Detached per-token weights and a keep mask correcting for the behaviour (rollout) policy.

    `log_ratio` is log pi_old - log pi_behaviour per token; r is its exp. Returns
    (weights, keep, metrics), both 0 / False at mask-0 positions.
    Weights (1 on valid tokens unless):
    - tis_cap: the truncated IS weights of `compute_rollout_is_weights` (token or sequence
      level, optionally batch-normalised, by `is_batch_norm_factor` when given; always over
      the whole `response_mask`);
    - else IcePop bounds: IcePop's ratio itself (r, or the row's prod r at sequence level).
    Keep (the valid tokens every rule keeps; rejected tokens leave the loss mask, as in verl):
    - icepop_low/high: tokens whose IcePop ratio is outside [low, high] ("token": r per token;
      "sequence": prod r over the row, so the whole row goes);
    - rejection_low/high: every token of a row whose geometric-mean ratio
      exp(mean log_ratio over valid tokens) is outside [low, high];
    - rollout_rs / rollout_rs_threshold: what `compute_rollout_rejection_mask` rejects.
    masks_only (bypass mode with a surrogate that already weights by the ratio): the weights
    stay 1, so the ratio is not applied a second time.
    """
    with torch.no_grad():
        mask = response_mask.bool()
        raw = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
        weights = mask.to(raw.dtype)
        metrics: dict[str, Tensor] = {"rollout_corr/kl": masked_mean(-raw, mask)}
        if not masks_only and tis_cap is not None:
            weights, is_metrics = compute_rollout_is_weights(
                raw, mask, tis_cap, rollout_is_level, rollout_is_batch_normalize,
                is_batch_norm_factor,
            )
            metrics.update(is_metrics)
        elif not masks_only and icepop_low is not None:
            weights = _icepop_ratio(raw, mask, icepop_level)
        keep = _keep_within_bounds(
            raw, mask, (icepop_low, icepop_high), icepop_level, (rejection_low, rejection_high),
            metrics,
        )
        if rollout_rs is not None:
            rs_keep, rs_metrics = compute_rollout_rejection_mask(
                raw, mask, rollout_rs, rollout_rs_threshold
            )
            keep = keep & rs_keep
            metrics.update(rs_metrics)
    return weights, keep, metrics


def rollout_correction(
    config: PolicyLossConfig,
    log_ratio: Tensor,
    response_mask: Tensor,
    is_batch_norm_factor: Tensor | float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """`compute_rollout_correction` with `config`'s settings: (weights, keep, metrics).

    `log_ratio` is log pi_ref - log pi_behaviour with pi_ref the old policy, or the current
    one (detached) in bypass mode. The learner calls it before a mini-batch to count the kept
    tokens over all its micro-batches (see `compute_policy_loss_from_config`)."""
    return compute_rollout_correction(
        log_ratio,
        response_mask,
        tis_cap=config.tis_cap,
        rollout_is_level=config.rollout_is_level,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize,
        icepop_low=config.icepop_low,
        icepop_high=config.icepop_high,
        icepop_level=config.icepop_level,
        rejection_low=config.rejection_low,
        rejection_high=config.rejection_high,
        rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold,
        masks_only=config.bypass and config.weights_by_ratio,
        is_batch_norm_factor=is_batch_norm_factor,
    )


def is_batch_norm_parts(config: PolicyLossConfig, log_ratio: Tensor, response_mask: Tensor
                        ) -> Tensor:
    """[sum, count] of the truncated IS weights that `rollout_is_batch_normalize` averages
    (per valid token, or per non-empty row at sequence level): summed over micro-batches and
    ranks, sum / count is the mini-batch's `is_batch_norm_factor`."""
    assert config.tis_cap is not None
    with torch.no_grad():
        mask = response_mask.bool()
        weights, _ = compute_rollout_is_weights(
            torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio)), mask,
            config.tis_cap, config.rollout_is_level,
        )
        if config.rollout_is_level == "sequence":
            units, unit_mask = weights.amax(dim=-1), mask.any(dim=-1)
        else:
            units, unit_mask = weights, mask
        return torch.stack([masked_sum(units, unit_mask), unit_mask.sum().to(weights.dtype)])


def compute_policy_loss_from_config(
    config: PolicyLossConfig,
    old_log_prob: Tensor | None,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    rollout_log_prob: Tensor | None = None,
    keep: Tensor | None = None,
    is_batch_norm_factor: Tensor | float | None = None,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The learner's policy-loss entry point: registered surrogate, corrections, aggregation.

    1. bypass: `old_log_prob` := `rollout_log_prob` (no proximal recompute; may pass None).
    2. pg_losses = get_policy_loss_fn(config.loss_mode)(...), a per-token matrix.
    3. `rollout_correction` from pi_old (bypass: detached pi) vs the behaviour: pg_losses are
       multiplied by its weights, and its rejected tokens leave the mask (verl's
       modified response_mask). `keep`, when given, is that keep mask already computed (the
       learner's, over the whole mini-batch); the weights are still computed here, batch-
       normalised by `is_batch_norm_factor` when given (see `is_batch_norm_parts`).
    4. agg_loss over response_mask & keep with `num_tokens` / `num_seqs`: for exact
       micro-batch accumulation, the mini-batch's counts of *kept* tokens and of sequences
       with a kept token.
    Returns (loss, metrics) with verl's metric names ("actor/pg_clipfrac", ...).
    """
    if config.bypass:
        if rollout_log_prob is None:
            raise ValueError("bypass mode needs rollout_log_prob (the behaviour log-probs)")
        old_log_prob = rollout_log_prob
    if old_log_prob is None:
        raise ValueError("old_log_prob is required unless config.bypass is set")
    old_log_prob, log_prob, advantages = _zero_outside(
        response_mask, old_log_prob, log_prob, advantages
    )
    if rollout_log_prob is not None:
        (rollout_log_prob,) = _zero_outside(response_mask, rollout_log_prob)
    loss_fn = get_policy_loss_fn(config.loss_mode)
    pg_losses, metrics = loss_fn(
        old_log_prob, log_prob, advantages, response_mask, config, rollout_log_prob=rollout_log_prob
    )
    loss_mask = response_mask.bool()
    if config.corrects_rollout:
        if rollout_log_prob is None:
            raise ValueError("tis_cap / icepop / rejection / rollout_rs need rollout_log_prob")
        reference = log_prob.detach() if config.bypass else old_log_prob
        weights, kept, corr_metrics = rollout_correction(
            config, reference - rollout_log_prob, response_mask, is_batch_norm_factor
        )
        pg_losses = pg_losses * weights
        loss_mask = loss_mask & (kept if keep is None else keep.bool())
        metrics.update(corr_metrics)
    loss = agg_loss(
        pg_losses,
        loss_mask,
        config.loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=config.loss_scale_factor,
    )
    return loss, {name: float(value) for name, value in metrics.items()}


# --------------------------------------------------------------------------------------------
# 7. Value and entropy
# --------------------------------------------------------------------------------------------


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """verl's clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, V +- c) - R)^2)).

    `values` are the critic's values at rollout time. Returns (vf_loss, vf_clipfrac).
    """
    vpreds, returns, values = _zero_outside(response_mask, vpreds, returns, values)
    vpred_clipped = torch.maximum(
        torch.minimum(vpreds, values + cliprange_value), values - cliprange_value
    )
    losses1 = (vpreds - returns) ** 2
    losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(losses1, losses2),
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((losses2 > losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()


def compute_entropy_loss(
    logits: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregated token entropy of (batch, length, vocab) logits (subtract coef * it)."""
    return agg_loss(
        entropy_from_logits(logits),
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
