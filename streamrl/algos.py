"""RL math: advantage estimators, policy / value / KL / entropy losses and loss aggregation.

Pure torch (numpy only to read group ids). No distributed code and no imports from other
streamrl modules: `learner/` and `controller.py` import this file, never the other way round.
Function and argument names follow verl's `verl/trainer/ppo/core_algos.py` (`token_level_rewards`,
`response_mask`, `index`, `norm_adv_by_std_in_grpo`, `clip_ratio_low/high/c`, `loss_agg_mode`),
and results equal verl's on valid (mask = 1) tokens; the few deliberate differences are marked
"Differs from verl" where they live.

Parts, in file order:
1. Masked helpers ....... masked_sum, masked_mean, masked_var, masked_whiten,
                          logprobs_from_logits, entropy_from_logits
2. Registries ........... register_adv_estimator, get_adv_estimator_fn, ADV_ESTIMATORS;
                          register_policy_loss, get_policy_loss_fn, POLICY_LOSSES
3. Aggregation .......... LOSS_AGG_MODES, agg_loss
4. Advantages ........... compute_gae_advantage_return, compute_grpo_outcome_advantage,
                          compute_rloo_outcome_advantage, compute_remax_outcome_advantage,
                          compute_reinforce_plus_plus_outcome_advantage,
                          compute_reinforce_plus_plus_baseline_outcome_advantage;
                          compute_advantage (the dispatcher the controller calls)
5. KL ................... KL_PENALTY_TYPES, kl_penalty, FixedKLController, AdaptiveKLController,
                          get_kl_controller, apply_kl_penalty (KL in reward), compute_kl_loss
6. Policy losses ........ compute_policy_loss (verl's vanilla signature); PolicyLossConfig;
                          registered per-token surrogates vanilla / gspo / cispo / decoupled;
                          compute_rollout_correction (TIS, IcePop, sequence rejection);
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_kl_loss",
    "compute_pg_losses_cispo",
    "compute_pg_losses_decoupled",
    "compute_pg_losses_gspo",
    "compute_pg_losses_vanilla",
    "compute_policy_loss",
    "compute_policy_loss_from_config",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
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


def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _row_slices(n_rows: int, chunk_rows: int) -> list[slice]:
    return [slice(i, i + chunk_rows) for i in range(0, n_rows, chunk_rows)]


def _join_rows(parts: list[Tensor], shape: torch.Size, like: Tensor) -> Tensor:
    if not parts:
        return like.new_zeros(shape, dtype=_upcast(like).dtype)
    return torch.cat(parts).reshape(shape)


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_rows: int = 1024) -> Tensor:
    """log_softmax(logits)[..., label] for each position, `chunk_rows` rows at a time.

    `logits` is (..., vocab), `labels` is (...). Beyond the input only a (chunk_rows, vocab)
    block is materialised at a time. fp16/bf16 logits are upcast per chunk and give fp32.
    Differs from verl: verl keeps bf16 results in bf16; fp32 keeps the PPO ratio exact.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must be logits {tuple(logits.shape)}[:-1]")
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1)
    parts = []
    for rows in _row_slices(flat.shape[0], chunk_rows):
        block = _upcast(flat[rows])
        picked = block.gather(-1, flat_labels[rows]).squeeze(-1)
        parts.append(picked - torch.logsumexp(block, dim=-1))
    return _join_rows(parts, labels.shape, logits)


def entropy_from_logits(logits: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per position: logsumexp(z) - sum(softmax(z) * z)."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for rows in _row_slices(flat.shape[0], chunk_rows):
        block = _upcast(flat[rows])
        probs = F.softmax(block, dim=-1)
        parts.append(torch.logsumexp(block, dim=-1) - (probs * block).sum(dim=-1))
    return _join_rows(parts, logits.shape[:-1], logits)


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

ADV_ESTIMATORS: Mapping[str, AdvEstimatorFn] = _ADV_REGISTRY.view
POLICY_LOSSES: Mapping[str, PolicyLossFn] = _POLICY_LOSS_REGISTRY.view


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator; a taken name raises ValueError."""
    return _ADV_REGISTRY.register(name)


def get_adv_estimator_fn(name: str) -> AdvEstimatorFn:
    """The estimator registered as `name`; unknown names raise ValueError listing known ones."""
    return _ADV_REGISTRY.get(name)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a per-token policy loss; a taken name raises ValueError."""
    return _POLICY_LOSS_REGISTRY.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; unknown names raise ValueError listing known ones."""
    return _POLICY_LOSS_REGISTRY.get(name)


# --------------------------------------------------------------------------------------------
# 3. Aggregation
# --------------------------------------------------------------------------------------------

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
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
    """REINFORCE++: discounted reward-to-go, whitened over valid tokens.

    Differs from verl on interior mask holes only: verl resets the running return at every
    mask-0 token (right padding); here mask-0 tokens are skipped like in GAE, so observation
    tokens between turns neither cut the return nor take a discount step. Right-padded
    batches give verl's numbers. Rewards must sit on mask-1 tokens.
    """
    with torch.no_grad():
        mask = _float_mask(response_mask, token_level_rewards)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            updated = token_level_rewards[:, t] + gamma * running
            running = torch.where(mask[:, t] > 0, updated, running)
            returns[:, t] = running
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


@dataclass(frozen=True)
class PolicyLossConfig:
    """How `compute_policy_loss_from_config` turns log-probs and advantages into a loss.

    loss_mode: a registered policy loss ("vanilla", "gspo", "cispo", "decoupled", or yours).
    clip_ratio / clip_ratio_low / clip_ratio_high: PPO clip range; low/high default to
        clip_ratio (set high > low for DAPO's clip-higher).
    clip_ratio_c: dual-clip bound for negative advantages (vanilla and decoupled), > 1.
    gspo_clip_ratio_low/high, cispo_clip_ratio_low/high: per-mode clip ranges, defaulting to
        the PPO ones (GSPO's paper uses ~3e-4 / 4e-4; CISPO's only clips above).
    loss_agg_mode / loss_scale_factor: see `agg_loss`.
    bypass: no recomputed proximal log-probs; the behaviour (rollout) log-probs are the PPO
        "old" log-probs, so the ratio itself is the importance weight.
    tis_cap: truncated importance sampling, token weight min(pi_old / pi_behaviour, tis_cap).
    icepop_low/high: IcePop, token weight pi_old / pi_behaviour inside [low, high], else 0.
    rejection_low/high: drop (weight 0) whole sequences whose geometric-mean ratio
        pi_old / pi_behaviour lies outside [low, high].
    decoupled_weight_cap: "decoupled" only; behaviour weights above it become 0 (AReaL's
        behav_imp_weight_cap).
    In bypass mode the corrections compare the current policy (detached) with the behaviour.
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
    icepop_low: float | None = None
    icepop_high: float | None = None
    rejection_low: float | None = None
    rejection_high: float | None = None
    decoupled_weight_cap: float | None = None

    def __post_init__(self) -> None:
        get_policy_loss_fn(self.loss_mode)
        _check_agg_mode(self.loss_agg_mode)
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {self.clip_ratio_c}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        _both_or_neither(self.icepop_low, self.icepop_high, "icepop")
        _both_or_neither(self.rejection_low, self.rejection_high, "rejection")
        weighted = self.tis_cap is not None or self.icepop_low is not None
        if self.bypass and (self.tis_cap is not None or self.loss_mode == "decoupled"):
            raise ValueError(
                "bypass makes the PPO ratio the importance weight; tis_cap and 'decoupled' "
                "would weight tokens twice (use icepop or rejection bounds instead)"
            )
        if self.loss_mode == "decoupled" and weighted:
            raise ValueError(
                "'decoupled' already weights tokens by pi_prox / pi_behaviour; "
                "use decoupled_weight_cap instead of tis_cap / icepop bounds"
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
    def corrects_rollout(self) -> bool:
        """Whether TIS, IcePop or rejection bounds are set (they need behaviour log-probs)."""
        return any(v is not None for v in (self.tis_cap, self.icepop_low, self.rejection_low))


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


def compute_rollout_correction(
    log_ratio: Tensor,
    response_mask: Tensor,
    *,
    tis_cap: float | None = None,
    icepop_low: float | None = None,
    icepop_high: float | None = None,
    rejection_low: float | None = None,
    rejection_high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached per-token weights correcting for the behaviour (rollout) policy.

    `log_ratio` is log pi_old - log pi_behaviour per token. With none of the options set the
    weights are 1. tis_cap: weight min(ratio, cap) (token-level truncated IS). icepop_low/high:
    weight ratio (or min(ratio, cap) with TIS) inside [low, high], 0 outside. rejection_low/high:
    every token of a sequence whose geometric-mean ratio exp(mean log_ratio over valid tokens)
    is outside [low, high] gets weight 0.
    Differs from verl: rejected tokens get weight 0 instead of leaving the response mask, so
    loss denominators (and mini-batch token counts for exact accumulation) do not change.
    """
    with torch.no_grad():
        raw = torch.where(response_mask.bool(), log_ratio.detach(), torch.zeros_like(log_ratio))
        clamped = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = clamped.exp()
        weights = torch.ones_like(ratio)
        metrics: dict[str, Tensor] = {"rollout_corr/kl": masked_mean(-raw, response_mask)}
        if tis_cap is not None or icepop_low is not None:
            weights = ratio
        if tis_cap is not None:
            weights = ratio.clamp(max=tis_cap)
            metrics["rollout_corr/tis_clipfrac"] = masked_mean(
                (ratio > tis_cap).float(), response_mask
            )
        if icepop_low is not None and icepop_high is not None:
            outside = (ratio < icepop_low) | (ratio > icepop_high)
            weights = torch.where(outside, torch.zeros_like(weights), weights)
            metrics["rollout_corr/icepop_maskfrac"] = masked_mean(outside.float(), response_mask)
        if rejection_low is not None and rejection_high is not None:
            seq_log_ratio = masked_mean(raw, response_mask, axis=-1)
            rejected = (seq_log_ratio < math.log(rejection_low)) | (
                seq_log_ratio > math.log(rejection_high)
            )
            weights = weights * (~rejected).to(weights.dtype).unsqueeze(-1)
            nonempty = response_mask.sum(dim=-1) > 0
            metrics["rollout_corr/rejected_seq_frac"] = masked_mean(
                rejected.float(), nonempty.float()
            )
    return weights, metrics


def compute_policy_loss_from_config(
    config: PolicyLossConfig,
    old_log_prob: Tensor | None,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    rollout_log_prob: Tensor | None = None,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The learner's policy-loss entry point: registered surrogate, corrections, aggregation.

    1. bypass: `old_log_prob` := `rollout_log_prob` (no proximal recompute; may pass None).
    2. pg_losses = get_policy_loss_fn(config.loss_mode)(...), a per-token matrix.
    3. TIS / IcePop / rejection weights from pi_old (bypass: detached pi) vs the behaviour.
    4. agg_loss with `num_tokens` / `num_seqs` (mini-batch counts for exact accumulation).
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
    if config.corrects_rollout:
        if rollout_log_prob is None:
            raise ValueError("tis_cap / icepop / rejection bounds need rollout_log_prob")
        reference = log_prob.detach() if config.bypass else old_log_prob
        weights, corr_metrics = compute_rollout_correction(
            reference - rollout_log_prob,
            response_mask,
            tis_cap=config.tis_cap,
            icepop_low=config.icepop_low,
            icepop_high=config.icepop_high,
            rejection_low=config.rejection_low,
            rejection_high=config.rejection_high,
        )
        pg_losses = pg_losses * weights
        metrics.update(corr_metrics)
    loss = agg_loss(
        pg_losses,
        response_mask,
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
