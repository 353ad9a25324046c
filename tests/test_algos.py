"""Tests for streamrl.algos: expected numbers are worked out by hand in the comments."""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl import algos
from streamrl.algos import (
    ADV_ESTIMATORS,
    KL_PENALTY_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    PolicyLossConfig,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_entropy_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_kl_loss,
    compute_policy_loss,
    compute_policy_loss_from_config,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    compute_value_loss,
    entropy_from_logits,
    get_adv_estimator_fn,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    parse_rollout_rs,
    policy_loss_weights_by_ratio,
    register_adv_estimator,
    register_policy_loss,
)

LN = math.log


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: object, b: object, atol: float = 1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), t(b), atol=atol)


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> tuple:
    """Right-padded batch with each score on the last valid token."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        if length:
            rewards[row, length - 1] = score
    return rewards, mask


# ------------------------------------------------------------------------------- helpers


def test_masked_reductions_by_hand() -> None:
    values = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    # valid values 1, 2, 4, 6: sum 13, mean 3.25; NaN / inf sit under mask 0
    assert close(masked_sum(values, mask), 13.0)
    assert close(masked_mean(values, mask), 3.25)
    assert close(masked_mean(values, mask, axis=-1), [1.5, 5.0])
    # squared deviations 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75; unbiased / 3
    assert close(masked_var(values, mask), 14.75 / 3)
    assert close(masked_var(values, mask, unbiased=False), 14.75 / 4)
    std = math.sqrt(14.75 / 3)
    white = masked_whiten(values, mask)
    assert close(white[mask.bool()], [(v - 3.25) / std for v in (1, 2, 4, 6)])
    assert close(masked_whiten(values, mask, shift_mean=False)[0, 0], (1 - 3.25) / std + 3.25)
    # an empty mask gives 0, never NaN
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    assert masked_whiten(t([[5.0]]), t([[1]])).item() == 0.0  # one element: no error, 0


def test_logprobs_and_entropy_from_logits() -> None:
    # probabilities 1/8, 2/8, 5/8 in both rows
    logits = torch.log(t([[1.0, 2.0, 5.0], [1.0, 2.0, 5.0]])).unsqueeze(0)  # (1, 2, 3)
    labels = torch.tensor([[2, 0]])
    assert close(logprobs_from_logits(logits, labels), [[LN(5 / 8), LN(1 / 8)]])
    # chunking over rows does not change anything, and gradients flow
    wide = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(wide, -1).gather(-1, ids[..., None]).squeeze(-1)
    got = logprobs_from_logits(wide, ids, chunk_rows=4)
    assert torch.allclose(got, ref, atol=1e-6)
    got.sum().backward()
    assert wide.grad is not None and torch.isfinite(wide.grad).all()
    low = logprobs_from_logits(wide.detach().bfloat16(), ids)
    assert low.dtype == torch.float32
    # entropy: uniform over 4 -> ln 4; probs (1/4, 3/4) -> 0.5623351
    ent = entropy_from_logits(torch.log(t([[1.0, 1.0, 1.0, 1.0], [1.0, 3.0, 1e-30, 1e-30]])))
    assert close(ent, [LN(4), -(0.25 * LN(0.25) + 0.75 * LN(0.75))])


def _full_softmax(z: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple:
    """Today's reference: the whole [T, V] log-softmax, then gather."""
    log_p = torch.log_softmax(z.float() / temperature, dim=-1)
    return log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 150, 4096])  # 150 rows: 7, 64 don't divide
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_equal_full_softmax(chunk_rows: int, temperature: float) -> None:
    torch.manual_seed(chunk_rows)
    B, L, H, V = 3, 50, 32, 3000
    hidden = torch.randn(B, L, H, requires_grad=True)
    weight = (0.2 * torch.randn(V, H)).requires_grad_()
    labels = torch.randint(0, V, (B, L))
    mask = (torch.arange(L) < torch.tensor([[50], [31], [0]])).float()  # padding; an empty row
    g_lp, g_ent = torch.randn(B, L), torch.randn(B, L)

    def loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        return masked_sum(lp * g_lp + ent * g_ent, mask)

    def grads(*xs: torch.Tensor) -> list[torch.Tensor]:
        out = [x.grad.clone() for x in xs]  # type: ignore[union-attr]
        for x in xs:
            x.grad = None
        return out

    ref_lp, ref_ent = _full_softmax(hidden @ weight.T, labels, temperature)
    loss(ref_lp, ref_ent).backward()
    ref = [ref_lp.detach(), ref_ent.detach(), *grads(hidden, weight)]
    # Fused: hidden states and the head weight in, never the [T, V] logits.
    lp, ent = algos.chunked_log_probs(hidden, labels, weight, temperature=temperature,
                                      with_entropy=True, entropy_grad=True, chunk_rows=chunk_rows)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == labels.shape
    loss(lp, ent).backward()
    for got, want in zip([lp.detach(), ent.detach(), *grads(hidden, weight)], ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Logits in: the same numbers and d/dlogits.
    logits = (hidden @ weight.T).detach().requires_grad_()
    ref_lp, ref_ent = _full_softmax(logits, labels, temperature)
    loss(ref_lp, ref_ent).backward()
    ref = [ref_lp.detach(), ref_ent.detach(), *grads(logits)]
    lp, ent = algos.chunked_log_probs(logits, labels, temperature=temperature, with_entropy=True,
                                      entropy_grad=True, chunk_rows=chunk_rows)
    loss(lp, ent).backward()
    for got, want in zip([lp.detach(), ent.detach(), *grads(logits)], ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Log-probs alone (entropy a metric: no gradient) give the log-prob part of the gradient.
    lp, ent = algos.chunked_log_probs(logits, labels, temperature=temperature, with_entropy=True,
                                      chunk_rows=chunk_rows)
    assert not ent.requires_grad
    masked_sum(lp * g_lp, mask).backward()
    got = grads(logits)[0]
    masked_sum(_full_softmax(logits, labels, temperature)[0] * g_lp, mask).backward()
    torch.testing.assert_close(got, grads(logits)[0], atol=1e-5, rtol=1e-5)
    assert algos.logprobs_from_logits(logits, labels, 7, temperature).shape == labels.shape


def _old_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int):
    """The implementation before the chunked recompute (for the memory comparison)."""
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1, 1)
    parts = []
    for rows in range(0, flat.shape[0], chunk_rows):
        block = flat[rows : rows + chunk_rows].float()
        picked = block.gather(-1, flat_labels[rows : rows + chunk_rows]).squeeze(-1)
        parts.append(picked - torch.logsumexp(block, dim=-1))
    return torch.cat(parts).reshape(labels.shape)


def _old_entropy_from_logits(logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for rows in range(0, flat.shape[0], chunk_rows):
        block = flat[rows : rows + chunk_rows].float()
        probs = torch.softmax(block, dim=-1)
        parts.append(torch.logsumexp(block, dim=-1) - (probs * block).sum(dim=-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def _saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(storages.values())


def test_top_k_top_p_log_probs_by_hand() -> None:
    # z = 2, 1, 0.5, -1. top_k 3 cuts -1; top_p 0.7 over softmax(2, 1, 0.5) = .629, .231, .140:
    # ascending, 0.140 <= 1 - 0.7 is dropped, .140 + .231 > 0.3 stays: the set is {0, 1}.
    # Labels 2 and 3 lie outside it and are scored over the set plus themselves.
    logits = t([[2.0, 1.0, 0.5, -1.0]] * 4).requires_grad_()
    labels = torch.tensor([0, 1, 2, 3])
    lp, ent = algos.chunked_log_probs(logits, labels, top_k=3, top_p=0.7, with_entropy=True,
                                      entropy_grad=True, chunk_rows=3)
    e = math.exp
    two = LN(e(2) + e(1))
    assert close(lp.detach(), [2 - two, 1 - two, 0.5 - LN(e(2) + e(1) + e(0.5)),
                               -1 - LN(e(2) + e(1) + e(-1))])
    p0 = e(2) / (e(2) + e(1))
    assert ent is not None and close(ent[0].detach(), -(p0 * LN(p0) + (1 - p0) * LN(1 - p0)))
    # gradients: autograd through the same masking (the set is piecewise constant in z)
    (lp.sum() + 0.5 * ent.sum()).backward()
    ref_in = logits.detach().clone().requires_grad_()
    kept = torch.isfinite(algos.truncate_logits_(logits.detach().clone(), 3, 0.7, labels))
    log_p = torch.log_softmax(ref_in.masked_fill(~kept, -math.inf), -1)
    probs = log_p.exp()
    ref_ent = -(probs * torch.where(probs > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    (log_p.gather(-1, labels[:, None]).sum() + 0.5 * ref_ent.sum()).backward()
    assert logits.grad is not None and ref_in.grad is not None
    assert torch.allclose(logits.grad, ref_in.grad, atol=1e-6)
    assert logits.grad[0, 2:].abs().sum() == 0  # cut tokens get no gradient
    # off: the plain softmax, unchanged
    plain, _ = algos.chunked_log_probs(logits.detach(), labels)
    full = torch.log_softmax(logits.detach(), -1).gather(-1, labels[:, None])[:, 0]
    assert torch.allclose(plain, full)


def test_chunked_log_probs_save_only_inputs() -> None:
    T, H, V, chunk = 512, 32, 4096, 128
    chunks_x_block = (T // chunk) * chunk * V * 4  # every chunk's fp32 [chunk, V]
    labels = torch.randint(0, V, (T,))
    small = 64 * T  # O(T): labels, log-sum-exp, entropy
    hidden = torch.randn(T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    inputs = hidden.nbytes + weight.nbytes
    # Fused: the inputs and O(T), where logits + the old chunked log-softmax keep [T, V] blocks.
    assert _saved_bytes(lambda: algos.chunked_log_probs(
        hidden, labels, weight, with_entropy=True, entropy_grad=True, chunk_rows=chunk,
        temperature=0.7)) <= inputs + small
    assert _saved_bytes(lambda: _old_logprobs_from_logits(
        (hidden @ weight.T) / 0.7, labels, chunk)) >= inputs + chunks_x_block
    # bf16 logits: the old path saved every chunk's fp32 copy; now the logits alone.
    logits = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(lambda: logprobs_from_logits(logits, labels, chunk)) <= (
        logits.nbytes + small)
    assert _saved_bytes(lambda: _old_logprobs_from_logits(logits, labels, chunk)) >= (
        chunks_x_block)
    # Entropy with gradients: the old path kept every chunk's softmax.
    logits = torch.randn(T, V, requires_grad=True)
    assert _saved_bytes(lambda: entropy_from_logits(logits, chunk)) <= logits.nbytes + small
    assert _saved_bytes(lambda: _old_entropy_from_logits(logits, chunk)) >= (
        logits.nbytes + chunks_x_block)
    # Under no_grad nothing is saved at all.
    with torch.no_grad():
        assert _saved_bytes(lambda: algos.chunked_log_probs(hidden, labels, weight)) == 0


# ------------------------------------------------------------------------------- registries


def test_registries_list_builtins_and_are_read_only() -> None:
    expected = {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus"}
    expected |= {"reinforce_plus_plus_baseline", "remax"}
    assert expected <= set(ADV_ESTIMATORS)
    assert {"vanilla", "gspo", "cispo", "decoupled", "reinforce"} <= set(POLICY_LOSSES)
    # only REINFORCE has no pi / pi_old ratio in its surrogate (bypass then weights it)
    assert [policy_loss_weights_by_ratio(n) for n in ("vanilla", "gspo", "cispo", "decoupled")]
    assert not policy_loss_weights_by_ratio("reinforce")
    with pytest.raises(TypeError):
        ADV_ESTIMATORS["evil"] = lambda *a, **k: None  # type: ignore[index]
    with pytest.raises(TypeError):
        POLICY_LOSSES["evil"] = lambda *a, **k: None  # type: ignore[index]


def test_registries_reject_duplicates_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="gae"):
        get_adv_estimator_fn("no_such_estimator")
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss_fn("no_such_loss")
    assert get_adv_estimator_fn("grpo") is ADV_ESTIMATORS["grpo"]


def test_user_estimator_and_loss_go_through_the_registry() -> None:
    @register_adv_estimator("test_algos_constant")
    def constant(token_level_rewards, response_mask, **_):  # type: ignore[no-untyped-def]
        adv = torch.full_like(token_level_rewards, 7.0) * response_mask
        return adv, adv

    @register_policy_loss("test_algos_reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask, config, **_):  # type: ignore[no-untyped-def]
        return -advantages * log_prob, {}

    data = {"token_level_rewards": torch.zeros(2, 2), "response_mask": t([[1, 1], [1, 0]])}
    adv, _ = compute_advantage(data, "test_algos_constant")
    assert close(adv, [[7, 7], [7, 0]])
    config = PolicyLossConfig(loss_mode="test_algos_reinforce")
    # -(1 * -1 + 2 * -2 + 3 * -3) / 3 = 14 / 3
    loss, _ = compute_policy_loss_from_config(
        config, t([[0.0, 0, 0]]), t([[-1.0, -2, -3]]), t([[1.0, 2, 3]]), t([[1, 1, 1]])
    )
    assert close(loss, 14 / 3)


# ------------------------------------------------------------------------------- aggregation


LOSS_MAT = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LOSS_MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 3 valid tokens
        ("token-sum", 1 + 2 + 4),  # no normalisation (the learner applies verl's dp_size)
        ("seq-mean-token-sum", (3 + 4) / 2),  # token sums 3 and 4; the empty row is skipped
        ("seq-mean-token-mean", (1.5 + 4) / 2),  # token means 1.5 and 4
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # / horizon = width 3
    ],
)
def test_agg_loss_modes_by_hand(mode: str, expected: float) -> None:
    assert close(agg_loss(LOSS_MAT, LOSS_MASK, mode), expected)


def test_agg_loss_norm_factor_and_unknown_mode() -> None:
    got = agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm", loss_scale_factor=7.0)
    assert close(got, 3.5 / 7)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS_MAT, LOSS_MASK, "token-sum-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_empty_batch_is_zero_with_zero_grad(mode: str) -> None:
    loss_mat = torch.full((2, 3), float("nan")).requires_grad_()
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert loss_mat.grad is not None and (loss_mat.grad == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_sum_to_the_mini_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=gen)
    lengths = torch.tensor([5, 1, 0, 3, 2, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    whole = agg_loss(loss_mat, mask, mode)
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum()
    parts = [
        agg_loss(
            loss_mat[i : i + 2], mask[i : i + 2], mode, num_tokens=num_tokens, num_seqs=num_seqs
        )
        for i in range(0, 6, 2)
    ]
    assert torch.allclose(sum(parts), whole, atol=1e-6)
    local = sum(agg_loss(loss_mat[i : i + 2], mask[i : i + 2], mode) for i in range(0, 6, 2))
    if mode != "token-sum":  # a sum needs no counts; the others' local counts would be wrong
        assert not torch.allclose(local, whole, atol=1e-3)


# ------------------------------------------------------------------------------- advantages


def test_grpo_by_hand_with_group_of_one_and_equal_rewards() -> None:
    # group a: 1, 2, 3 (mean 2, std 1); group b: 5, 5 (std 0); group c: 4 alone
    rewards, mask = outcome_rewards([1, 2, 3, 5, 5, 4], [3, 1, 2, 4, 2, 3], width=4)
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    adv, returns = compute_grpo_outcome_advantage(rewards, mask, index)
    eps = 1e-6
    per_row = t([-1 / (1 + eps), 0.0, 1 / (1 + eps), 0.0, 0.0, 4 / (1 + eps)])
    assert torch.allclose(adv, per_row[:, None] * mask, atol=1e-6)
    assert torch.equal(adv, returns)
    assert torch.isfinite(adv).all()
    dr, _ = compute_grpo_outcome_advantage(
        rewards, mask, list(index), norm_adv_by_std_in_grpo=False
    )
    assert torch.allclose(dr, t([-1, 0, 1, 0, 0, 4])[:, None] * mask)
    data = {"token_level_rewards": rewards, "response_mask": mask, "group_id": index}
    via_registry, _ = compute_advantage(data, "dr_grpo")
    assert torch.equal(via_registry, dr)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_of_one_keeps_its_raw_reward_in_every_group_estimator(estimator: str) -> None:
    # verl: a group of one has mean 0 (and std 1), so its advantage is its raw score; the
    # baseline variant whitens the batch afterwards like any other row. Row 2 is group "c".
    rewards, mask = outcome_rewards([1.0, 3.0, 4.0], [2, 2, 2], width=2)
    data = {"token_level_rewards": rewards, "response_mask": mask,
            "group_id": ["a", "a", "c"]}
    adv, _ = compute_advantage(data, estimator)
    centred = {"grpo": [-1 / 2 ** 0.5, 1 / 2 ** 0.5, 4.0], "dr_grpo": [-1.0, 1.0, 4.0],
               "rloo": [-2.0, 2.0, 4.0], "reinforce_plus_plus_baseline": [-1.0, 1.0, 4.0]}
    expected = t(centred[estimator])[:, None] * mask
    if estimator == "reinforce_plus_plus_baseline":
        expected = masked_whiten(expected, mask) * mask
    assert torch.allclose(adv, expected, atol=1e-5)


def test_grpo_accepts_int_index_and_empty_rows() -> None:
    rewards, mask = outcome_rewards([1, 3, 0], [2, 2, 0], width=2)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([7, 7, 8]))
    # group 7: 1, 3 (mean 2, std sqrt 2); row 3 is empty
    s = math.sqrt(2) + 1e-6
    assert close(adv, [[-1 / s, -1 / s], [1 / s, 1 / s], [0, 0]])


def test_rloo_by_hand() -> None:
    # group of 3: r - mean(others) = [1 - 2.5, 2 - 2, 3 - 1.5]; a lone row keeps its score
    rewards, mask = outcome_rewards([1, 2, 3, 4], [1, 2, 1, 1], width=2)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, ["g", "g", "g", "solo"])
    assert close(adv, [[-1.5, 0], [0, 0], [1.5, 0], [4, 0]])


def test_reinforce_plus_plus_by_hand() -> None:
    # gamma 0.5. row 0 reward 1 at t2 -> returns 0.25, 0.5, 1; row 1 reward 2 at t1 -> 1, 2
    rewards = t([[0.0, 0, 1, 0], [0, 2, 0, 0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    valid = [0.25, 0.5, 1.0, 1.0, 2.0]
    assert close(returns[mask.bool()], valid)
    mean, std = statistics.mean(valid), statistics.stdev(valid)  # 0.95, sqrt(0.45)
    assert close(adv[mask.bool()], [(v - mean) / std for v in valid])
    assert (adv[~mask.bool()] == 0).all()
    assert (returns[~mask.bool()] == 0).all()  # verl writes 0 at mask-0 positions


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # group a: 1, 3 -> -1, +1 ; b: 2 alone -> 2. Tokens: [-1,-1], [1], [2,2]
    rewards, mask = outcome_rewards([1, 3, 2], [2, 1, 2], width=2)
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    tokens = [-1.0, -1.0, 1.0, 2.0, 2.0]
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)  # 0.6, sqrt(2.3)
    assert close(adv, [[(-1 - mean) / std] * 2, [(1 - mean) / std, 0], [(2 - mean) / std] * 2])


def test_remax_by_hand() -> None:
    rewards, mask = t([[0.0, 1, 2, 0]]), t([[1, 1, 1, 0]])
    adv, returns = compute_remax_outcome_advantage(rewards, t([1.5]), mask)
    assert close(returns, [[3, 3, 2, 0]])
    assert close(adv, [[1.5, 1.5, 0.5, 0]])


def test_gae_by_hand_with_padding() -> None:
    # gamma 0.9, lam 0.8, values 0.5, 0.25, 0.75 (t3 is padding with a garbage value)
    # t2: delta = 1 - 0.75 = 0.25                      -> A2 = 0.25
    # t1: delta = 0.9 * 0.75 - 0.25 = 0.425            -> A1 = 0.425 + 0.72 * 0.25 = 0.605
    # t0: delta = 0.9 * 0.25 - 0.5 = -0.275            -> A0 = -0.275 + 0.72 * 0.605 = 0.1606
    rewards, values, mask = t([[0.0, 0, 1, 0]]), t([[0.5, 0.25, 0.75, 9.0]]), t([[1, 1, 1, 0]])
    adv, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    raw = [0.1606, 0.605, 0.25]
    assert close(returns[0, :3], [0.6606, 0.855, 1.0])
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    assert close(adv[0, :3], [(v - mean) / std for v in raw])


@pytest.mark.filterwarnings("ignore:GSPO aggregates")
def test_interior_mask_holes_do_not_change_valid_tokens() -> None:
    # the same two-turn trajectory, once compact and once with observation tokens (mask 0,
    # garbage values and rewards) between the policy tokens
    compact_r, compact_v = t([[0.0, 0.5, 1.0]]), t([[0.2, 0.4, 0.6]])
    holes_r = t([[0.0, 0.0, 0.5, 0.0, 0.0, 1.0]])
    holes_v = t([[0.2, 50.0, 0.4, -7.0, 3.0, 0.6]])
    holes_m = t([[1, 0, 1, 0, 0, 1]])
    valid = holes_m.bool()
    a_c, r_c = compute_gae_advantage_return(compact_r, compact_v, torch.ones(1, 3), 0.9, 0.95)
    a_h, r_h = compute_gae_advantage_return(holes_r, holes_v, holes_m, 0.9, 0.95)
    assert torch.allclose(a_h[valid], a_c.flatten(), atol=1e-6)
    assert torch.allclose(r_h[valid], r_c.flatten(), atol=1e-6)
    a_c, r_c = compute_reinforce_plus_plus_outcome_advantage(compact_r, torch.ones(1, 3), 0.5)
    a_h, r_h = compute_reinforce_plus_plus_outcome_advantage(holes_r, holes_m, 0.5)
    assert torch.allclose(r_h[valid], r_c.flatten()) and close(r_c, [[0.5, 1.0, 1.0]])
    assert torch.allclose(a_h[valid], a_c.flatten(), atol=1e-6)
    assert (r_h[~valid] == 0).all() and (a_h[~valid] == 0).all()
    # policy loss: holes carry -inf log-probs and NaN advantages, and must not leak
    lp_c, adv_c = t([[-1.0, -2.0, -0.5]]), t([[1.0, -1.0, 2.0]])
    lp_h = t([[-1.0, -math.inf, -2.0, -math.inf, -math.inf, -0.5]]).requires_grad_()
    adv_h = t([[1.0, math.nan, -1.0, math.nan, math.nan, 2.0]])
    for mode in ("vanilla", "gspo", "cispo", "reinforce"):
        for agg in LOSS_AGG_MODES:
            config = PolicyLossConfig(loss_mode=mode, loss_agg_mode=agg)
            old_c = lp_c - 0.1
            old_h = torch.where(holes_m.bool(), lp_h.detach() - 0.1, t(0.0))
            want, _ = compute_policy_loss_from_config(config, old_c, lp_c, adv_c, torch.ones(1, 3))
            got, _ = compute_policy_loss_from_config(config, old_h, lp_h, adv_h, holes_m)
            if agg == "seq-mean-token-sum-norm":  # horizon is the padded width, 3 vs 6
                want = want * 3 / 6
            assert torch.allclose(got, want, atol=1e-6), (mode, agg)
    got.backward()
    assert lp_h.grad is not None and (lp_h.grad[~valid] == 0).all()


def test_compute_advantage_dispatches_every_builtin() -> None:
    rewards, mask = outcome_rewards([1, 0, 1, 1], [2, 3, 1, 3], width=3)
    data = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": np.zeros((4, 3), dtype=np.float32),
        "reward_baselines": np.ones(4, dtype=np.float32),
        "group_id": ["p0", "p0", "p1", "p1"],
    }
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus"):
        adv, returns = compute_advantage(data, name, gamma=0.9, lam=0.95)
        assert adv.shape == returns.shape == (4, 3) and torch.isfinite(adv).all(), name
    for name in ("reinforce_plus_plus_baseline", "remax"):
        adv, _ = compute_advantage(data, name)
        assert torch.isfinite(adv).all(), name
    direct, _ = compute_grpo_outcome_advantage(rewards, mask, data["group_id"])
    assert torch.equal(compute_advantage(data, "grpo")[0], direct)
    with pytest.raises(ValueError, match="values"):
        compute_advantage({k: v for k, v in data.items() if k != "values"}, "gae")
    with pytest.raises(ValueError, match="index"):
        compute_advantage(data, "grpo", index_key="uid")
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage({"token_level_rewards": rewards, "response_mask": mask}, "remax")


# ------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand() -> None:
    logp, ref = t([0.0, -1.0]), t([-1.0, 0.0])  # logp - ref = 1, -1
    assert close(kl_penalty(logp, ref, "k1"), [1, -1])
    assert close(kl_penalty(logp, ref, "kl"), [1, -1])
    assert close(kl_penalty(logp, ref, "abs"), [1, 1])
    assert close(kl_penalty(logp, ref, "mse"), [0.5, 0.5])
    assert close(kl_penalty(logp, ref, "k2"), [0.5, 0.5])
    # k3 = exp(ref - logp) - (ref - logp) - 1 -> e^-1 + 1 - 1, e - 1 - 1
    k3 = [math.exp(-1), math.e - 2]
    assert close(kl_penalty(logp, ref, "k3"), k3)
    assert close(kl_penalty(logp, ref, "low_var_kl"), k3)
    # extreme: k3 clamps to 10, the log ratio first to +-20, so nothing overflows
    extreme = kl_penalty(t([0.0, 0.0]), t([30.0, -1e4]), "low_var_kl")
    assert close(extreme, [10.0, 10.0])
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "full")
    assert set(KL_PENALTY_TYPES) >= {"k1+", "k3+", "low_var_kl+", "abs+", "mse"}


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k3", "low_var_kl"])
def test_straight_through_kl_has_k2_gradient(kind: str) -> None:
    logp = t([0.3, -1.2, -0.1]).requires_grad_()
    ref = t([-0.4, -1.0, -2.0])
    value = kl_penalty(logp, ref, kind + "+")
    assert torch.allclose(value, kl_penalty(logp, ref, kind))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert torch.allclose(grad, (logp - ref).detach())  # d/dlogp of (logp - ref)^2 / 2


def test_kl_controllers_by_hand() -> None:
    fixed = FixedKLController(0.3)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.3
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=10)
    ctrl.update(current_kl=1.5, n_steps=2)  # error clipped to 0.2 -> x (1 + 0.2 * 2 / 10)
    assert math.isclose(ctrl.value, 0.104)
    ctrl.update(current_kl=0.9, n_steps=5)  # error -0.1 -> x (1 - 0.1 * 5 / 10)
    assert math.isclose(ctrl.value, 0.104 * 0.95)
    restored = AdaptiveKLController(0.5, 1.0, 10)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    assert isinstance(get_kl_controller("fixed", 0.2), FixedKLController)
    assert isinstance(get_kl_controller("adaptive", 0.2, 0.1, 100), AdaptiveKLController)
    with pytest.raises(ValueError):
        get_kl_controller("adaptive", 0.2, 0.1, 0)
    with pytest.raises(ValueError, match="fixed"):
        get_kl_controller("pid", 0.2)


def test_apply_kl_penalty_by_hand() -> None:
    scores = t([[0.0, 0.0, 1.0]])
    old, ref, mask = t([[-1.0, -1.0, -1.0]]), t([[-1.5, -1.0, -2.0]]), t([[1, 1, 0]])
    ctrl = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    # k1 = 0.5, 0, (1 masked) -> rewards = scores - 0.1 * kl; batch KL = mean(0.5, 0) = 0.25
    assert close(rewards, [[-0.05, 0.0, 1.0]])
    assert math.isclose(metrics["actor/reward_kl_penalty"], 0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert math.isclose(ctrl.value, 0.1 * (1 - 0.2 * 1 / 10))  # error clipped to -0.2, 1 row


def test_kl_loss_aggregates_the_estimator() -> None:
    logp, ref, mask = t([[0.0, -1.0, 5.0]]), t([[-1.0, 0.0, 0.0]]), t([[1, 1, 0]])
    assert close(compute_kl_loss(logp, ref, mask, "k2"), 0.5)
    assert close(compute_kl_loss(logp, ref, mask, "k1"), 0.0)
    assert close(compute_kl_loss(logp, ref, mask, "k2", "token-sum"), 0.5 + 0.5)


# ------------------------------------------------------------------------------- policy losses

# four tokens, clip 0.2, dual clip 3:
#   ratio 1.5, A +1 -> clipped to 1.2            -> -1.2 (clipped)
#   ratio 0.5, A +1 -> max(-0.5, -0.8)           -> -0.5
#   ratio 0.5, A -1 -> max(0.5, 0.8) = 0.8 < 3   ->  0.8 (clipped)
#   ratio 5.0, A -1 -> max(5, 1.2) = 5 -> min(3) ->  3.0 (dual clip)
RATIOS = [1.5, 0.5, 0.5, 5.0]
ADVS = t([[1.0, 1.0, -1.0, -1.0]])
OLD = t([[-1.0, -2.0, -0.5, -3.0]])
NEW = OLD + torch.log(t([RATIOS]))
ONES = torch.ones(1, 4)


def test_vanilla_ppo_by_hand() -> None:
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        OLD, NEW, ADVS, ONES, cliprange=0.2
    )
    assert close(pg_loss, (-1.2 - 0.5 + 0.8 + 3.0) / 4)
    assert close(clipfrac, 2 / 4)
    assert close(clipfrac_lower, 1 / 4)
    assert close(ppo_kl, -LN(1.5 * 0.5 * 0.5 * 5.0) / 4)
    # clip-higher: the upper bound moves to 1.28
    higher, *_ = compute_policy_loss(OLD, NEW, ADVS, ONES, cliprange_low=0.2, cliprange_high=0.28)
    assert close(higher, (-1.28 - 0.5 + 0.8 + 3.0) / 4)
    with pytest.raises(ValueError):
        compute_policy_loss(OLD, NEW, ADVS, ONES)


def test_dual_clip_token_has_no_gradient() -> None:
    new = NEW.clone().requires_grad_()
    pg_loss, *_ = compute_policy_loss(OLD, new, ADVS, ONES, cliprange=0.2)
    pg_loss.backward()
    assert new.grad is not None
    # only the unclipped token (ratio 0.5, A +1) moves: d(-A r)/dlogp / 4 = -0.5 / 4
    assert close(new.grad, [[0.0, -0.125, 0.0, 0.0]])


def test_config_entry_point_matches_verl_signature() -> None:
    config = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    loss, metrics = compute_policy_loss_from_config(config, OLD, NEW, ADVS, ONES)
    ref, clipfrac, ppo_kl, lower = compute_policy_loss(
        OLD, NEW, ADVS, ONES, 0.2, 0.2, 0.28, 3.0, "token-mean"
    )
    assert torch.equal(loss, ref)
    assert metrics["actor/pg_clipfrac"] == clipfrac.item()
    assert metrics["actor/ppo_kl"] == ppo_kl.item()
    assert metrics["actor/pg_clipfrac_lower"] == lower.item()


@pytest.mark.filterwarnings("ignore:GSPO aggregates")
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo", "decoupled", "reinforce"])
def test_extreme_log_ratios_stay_finite(mode: str) -> None:
    # log ratios -100, +100, -100, +30: exp(100) overflows fp32 unless clamped to +-20
    old = t([[-1.0, -101.0, -1.0, -31.0]])
    new = t([[-101.0, -1.0, -101.0, -1.0]]).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    config = PolicyLossConfig(loss_mode=mode)
    loss, metrics = compute_policy_loss_from_config(
        config, old, new, adv, ONES, rollout_log_prob=old
    )
    loss.backward()
    assert torch.isfinite(loss) and new.grad is not None and torch.isfinite(new.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    if mode == "vanilla":
        # ratios exp(-20), exp(20), exp(-20), exp(20) -> -exp(-20), -1.2, 0.8, 3 (dual clip)
        assert close(loss, (-math.exp(-20) - 1.2 + 0.8 + 3.0) / 4)
        assert close(metrics["actor/ppo_kl"], 0.0)  # mean of 20, -20, 20, -20 after the clamp


@pytest.mark.filterwarnings("ignore:GSPO aggregates")
def test_gspo_sequence_ratio_with_token_gradient() -> None:
    # log ratios ln 2 and 0 -> s = exp(ln 2 / 2) = sqrt 2 on both tokens, A = +1
    old, new = t([[-1.0, -1.0]]), t([[-1.0 + LN(2), -1.0]]).requires_grad_()
    config = PolicyLossConfig(loss_mode="gspo", gspo_clip_ratio_low=0.5, gspo_clip_ratio_high=0.5)
    loss, metrics = compute_policy_loss_from_config(
        config, old, new, t([[1.0, 1.0]]), torch.ones(1, 2)
    )
    assert close(loss, -math.sqrt(2))
    loss.backward()
    assert new.grad is not None and close(new.grad, [[-math.sqrt(2) / 2] * 2])
    assert metrics["actor/pg_clipfrac"] == 0.0
    tight = PolicyLossConfig(loss_mode="gspo", gspo_clip_ratio_low=0.2, gspo_clip_ratio_high=0.2)
    loss, metrics = compute_policy_loss_from_config(
        tight, old, new, t([[1.0, 1.0]]), torch.ones(1, 2)
    )
    assert close(loss, -1.2) and metrics["actor/pg_clipfrac"] == 1.0


def test_cispo_by_hand() -> None:
    # ratios 1.5, 0.5, 1.1 -> clipped 1.2, 0.8, 1.1 (detached); log_prob -1, -2, -0.5; A = +1
    # losses -1.2 * -1 = 1.2, -0.8 * -2 = 1.6, -1.1 * -0.5 = 0.55; gradients -w / 3 each
    new = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    old = new.detach() - torch.log(t([[1.5, 0.5, 1.1]]))
    config = PolicyLossConfig(loss_mode="cispo")
    loss, metrics = compute_policy_loss_from_config(
        config, old, new, torch.ones(1, 3), torch.ones(1, 3)
    )
    assert close(loss, (1.2 + 1.6 + 0.55) / 3)
    loss.backward()
    assert new.grad is not None and close(new.grad, [[-1.2 / 3, -0.8 / 3, -1.1 / 3]])
    assert math.isclose(metrics["actor/pg_clipfrac"], 2 / 3, rel_tol=1e-6)


def test_decoupled_ppo_by_hand() -> None:
    # current == proximal (ratio 1, A = +1 -> -1 per token); behaviour weights prox/behav = 2, 0.5
    prox = t([[-1.0, -1.0]])
    behav = prox - torch.log(t([[2.0, 0.5]]))
    adv, mask = t([[1.0, 1.0]]), torch.ones(1, 2)
    config = PolicyLossConfig(loss_mode="decoupled")
    loss, metrics = compute_policy_loss_from_config(
        config, prox, prox, adv, mask, rollout_log_prob=behav
    )
    assert close(loss, (-2.0 - 0.5) / 2)
    assert math.isclose(metrics["actor/behav_weight_mean"], 1.25)
    capped = PolicyLossConfig(loss_mode="decoupled", decoupled_weight_cap=1.5)
    loss, _ = compute_policy_loss_from_config(capped, prox, prox, adv, mask, rollout_log_prob=behav)
    assert close(loss, (0.0 - 0.5) / 2)  # weight 2 > cap -> token dropped
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss_from_config(config, prox, prox, adv, mask)


def _ratio1_loss(config: PolicyLossConfig, behaviour_ratios: list[list[float]]) -> tuple:
    """Loss with current == old (PPO ratio 1, A = +1, so -1 per token) and given pi_old/pi_behav."""
    old = torch.full((len(behaviour_ratios), len(behaviour_ratios[0])), -1.0)
    behav = old - torch.log(t(behaviour_ratios))
    adv, mask = torch.ones_like(old), torch.ones_like(old)
    return compute_policy_loss_from_config(config, old, old, adv, mask, rollout_log_prob=behav)


def test_truncated_importance_sampling_by_hand() -> None:
    loss, metrics = _ratio1_loss(PolicyLossConfig(tis_cap=2.0), [[3.0, 0.25]])
    assert close(loss, (-2.0 - 0.25) / 2)  # weights min(3, 2), 0.25
    # verl's metrics: raw 3 > 2 and 0.25 < 1/2; mean and ESS of the weights applied (after
    # truncation): mean (2 + 0.25) / 2 = 1.125; w / mean = 16/9, 2/9: ESS 1 / ((256 + 4) / 162)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0.5
    assert math.isclose(metrics["rollout_corr/rollout_is_mean"], 1.125, rel_tol=1e-6)
    assert math.isclose(metrics["rollout_corr/rollout_is_eff_sample_size"], 162 / 260,
                        rel_tol=1e-5)


def test_icepop_by_hand() -> None:
    loss, metrics = _ratio1_loss(
        PolicyLossConfig(icepop_low=0.5, icepop_high=2.0), [[3.0, 0.25, 1.5]]
    )
    # outside [0.5, 2]: rejected, out of the denominator (verl); inside: weight 1.5
    assert close(loss, -1.5 / 1)
    assert math.isclose(metrics["rollout_corr/icepop_maskfrac"], 2 / 3, rel_tol=1e-6)


def test_icepop_weighs_padding_zero() -> None:
    # row 1's last position is padding with log-ratio 0 (r = 1, inside the band): weight 0
    log_ratio = torch.log(t([[1.5, 1.0], [1.2, 1.0]]))
    mask = t([[1, 1], [1, 0]])
    weights, keep, _ = algos.compute_rollout_correction(
        log_ratio, mask, icepop_low=0.5, icepop_high=2.0
    )
    assert close(weights, [[1.5, 1.0], [1.2, 0.0]])
    assert keep.tolist() == [[True, True], [True, False]]


def test_sequence_icepop_by_hand() -> None:
    # row 0: ratios 1.5, 1.5 -> prod 2.25 > 2: the whole row is rejected
    # row 1: ratios 2.5, 0.5 -> prod 1.25: kept, every token weighs 1.25 (token level would
    # have rejected the 2.5 token); A = +1 and PPO ratio 1: loss -(1.25 + 1.25) / 2
    config = PolicyLossConfig(icepop_low=0.5, icepop_high=2.0, icepop_level="sequence")
    loss, metrics = _ratio1_loss(config, [[1.5, 1.5], [2.5, 0.5]])
    assert close(loss, -1.25)
    assert metrics["rollout_corr/icepop_maskfrac"] == 0.5
    token = PolicyLossConfig(icepop_low=0.5, icepop_high=2.0)
    loss, _ = _ratio1_loss(token, [[1.5, 1.5], [2.5, 0.5]])
    assert close(loss, -(1.5 + 1.5 + 0.5) / 3)


def test_sequence_rejection_by_hand() -> None:
    # seq 0: geometric mean sqrt(2 * 1) = 1.414 > 1.2 -> rejected; seq 1: sqrt(1.1 / 1.1) = 1
    config = PolicyLossConfig(rejection_low=0.8, rejection_high=1.2)
    loss, metrics = _ratio1_loss(config, [[2.0, 1.0], [1.1, 1 / 1.1]])
    assert close(loss, (-1 - 1) / 2)  # the rejected row's tokens leave the denominator
    assert metrics["rollout_corr/rejected_seq_frac"] == 0.5


def test_sequence_level_importance_sampling_by_hand() -> None:
    # row 0: ratios 2, 0.5, 3 -> product 3, capped at 2.5 on all three tokens
    # row 1: ratios 1.5, 1 (third token is padding with a wild ratio) -> product 1.5
    old = torch.full((2, 3), -1.0)
    behav = old - torch.log(t([[2.0, 0.5, 3.0], [1.5, 1.0, 1e6]]))
    mask = t([[1, 1, 1], [1, 1, 0]])
    config = PolicyLossConfig(tis_cap=2.5, rollout_is_level="sequence")
    loss, metrics = compute_policy_loss_from_config(
        config, old, old, torch.ones(2, 3), mask, rollout_log_prob=behav
    )
    assert close(loss, (-2.5 * 3 - 1.5 * 2) / 5)  # PPO ratio 1, A = +1: -w per token
    assert close(metrics["rollout_corr/rollout_is_mean"], (2.5 * 3 + 1.5 * 2) / 5)  # truncated
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5  # of rows: 3 > 2.5
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
    weights, _ = compute_rollout_is_weights(old - behav, mask, 2.5, "sequence")
    assert close(weights, [[2.5, 2.5, 2.5], [1.5, 1.5, 0.0]])


def test_importance_weight_batch_normalisation_by_hand() -> None:
    # token level: truncated 2, 0.5 (mean 1.25) -> 1.6, 0.4
    config = PolicyLossConfig(tis_cap=2.0, rollout_is_batch_normalize=True)
    loss, metrics = _ratio1_loss(config, [[3.0, 0.5]])
    assert close(loss, (-1.6 - 0.4) / 2)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == 1.25
    # sequence level: rows weigh 2 (ratios 2, 1) and 0.5 (one token); the mean is over rows
    log_ratio = torch.log(t([[2.0, 1.0], [0.5, 7.0]]))
    mask = t([[1, 1], [1, 0]])
    weights, metrics = compute_rollout_is_weights(log_ratio, mask, 4.0, "sequence", True)
    assert close(weights, [[1.6, 1.6], [0.4, 0.0]])
    assert math.isclose(metrics["rollout_corr/rollout_is_batch_norm_factor"], 1.25, rel_tol=1e-6)


def test_reinforce_loss_by_hand() -> None:
    # -A * log_prob: -(1 * -1) = 1, -(-1 * -2) = -2, -(2 * -0.5) = 1; gradient -A / 3
    new = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    adv, mask = t([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    config = PolicyLossConfig(loss_mode="reinforce")
    loss, metrics = compute_policy_loss_from_config(config, new.detach() - 0.1, new, adv, mask)
    assert close(loss, (1 - 2 + 1) / 3)
    loss.backward()
    assert new.grad is not None and close(new.grad, [[-1 / 3, 1 / 3, -2 / 3]])
    assert math.isclose(metrics["actor/ppo_kl"], -0.1, rel_tol=1e-5)
    # truncated IS from pi_old / pi_behaviour = 3, 0.5, 1 (cap 2): weights 2, 0.5, 1
    behav = new.detach() - torch.log(t([[3.0, 0.5, 1.0]]))
    tis = PolicyLossConfig(loss_mode="reinforce", tis_cap=2.0)
    loss, _ = compute_policy_loss_from_config(
        tis, new.detach(), new.detach(), adv, mask, rollout_log_prob=behav
    )
    assert close(loss, (1 * 2 - 2 * 0.5 + 1 * 1) / 3)


def test_bypass_reinforce_takes_truncated_weights_from_the_current_policy() -> None:
    # pi / pi_behaviour = 1.5, 0.5, 0.5, 5 (cap 2 -> 1.5, 0.5, 0.5, 2), A = 1, 1, -1, -1:
    # loss mean(-A * log_prob * w), gradient -A * w / 4 (w detached)
    config = PolicyLossConfig(loss_mode="reinforce", bypass=True, tis_cap=2.0)
    new = NEW.clone().requires_grad_()
    loss, _ = compute_policy_loss_from_config(config, None, new, ADVS, ONES, rollout_log_prob=OLD)
    w = [1.5, 0.5, 0.5, 2.0]
    lp = [o + LN(r) for o, r in zip([-1.0, -2.0, -0.5, -3.0], RATIOS)]
    a = [1.0, 1.0, -1.0, -1.0]
    assert close(loss, sum(-ai * li * wi for ai, li, wi in zip(a, lp, w)) / 4)
    loss.backward()
    assert new.grad is not None and close(new.grad, [[-0.375, -0.125, 0.125, 0.5]])


# two rows of pi_old / pi_behaviour ratios for the rejection rules
RS_RATIOS = [[2.0, 1.0, 0.5], [1.1, 1 / 1.1, 1.0]]


def _k_stats(r: float) -> dict[str, float]:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, written out."""
    return {"k1": -LN(r), "k2": 0.5 * LN(r) ** 2, "k3": r - 1 - LN(r)}


def _expected_keep(option: str, lower: float | None, upper: float) -> list[list[bool]]:
    """The keep mask of one rule, by a plain loop over RS_RATIOS."""
    level, k = option.rsplit("_", 1)
    lo = -math.inf if lower is None else LN(lower)
    hi = upper if lower is None else LN(upper)
    rows = []
    for row in RS_RATIOS:
        stats = [_k_stats(r)[k] for r in row]
        if level == "token":
            rows.append([lo <= x <= hi for x in stats])
            continue
        agg = {"seq_sum": sum(stats), "seq_mean": sum(stats) / len(stats), "seq_max": max(stats)}
        rows.append([lo <= agg[level] <= hi] * len(row))
    return rows


@pytest.mark.parametrize(
    ("option", "threshold", "lower", "upper"),
    [
        ("token_k1", "0.6_1.5", 0.6, 1.5),
        ("token_k1", 1.5, 1 / 1.5, 1.5),  # one number: lower = 1 / upper
        ("token_k2", 0.1, None, 0.1),
        ("token_k3", "0.2", None, 0.2),
        ("seq_sum_k1", "0.9_1.2", 0.9, 1.2),
        ("seq_sum_k2", 0.3, None, 0.3),
        ("seq_sum_k3", 0.4, None, 0.4),
        ("seq_mean_k1", "0.95_1.05", 0.95, 1.05),
        ("seq_mean_k2", 0.1, None, 0.1),
        ("seq_mean_k3", 0.15, None, 0.15),
        ("seq_max_k2", 0.2, None, 0.2),
        ("seq_max_k3", 0.25, None, 0.25),
    ],
)
def test_rejection_rules_match_a_plain_formula(
    option: str, threshold: object, lower: float | None, upper: float
) -> None:
    log_ratio = torch.log(t(RS_RATIOS))
    keep, metrics = compute_rollout_rejection_mask(log_ratio, torch.ones(2, 3), option, threshold)
    expected = _expected_keep(option, lower, upper)
    assert keep.tolist() == expected
    rejected = sum(not k for row in expected for k in row)
    assert close(metrics["rollout_corr/rollout_rs_masked_fraction"], rejected / 6)


def test_rejection_rules_by_hand_and_combined() -> None:
    # row 0: k3 = 2 - 1 - ln 2 = 0.307, 0, 0.5 - 1 + ln 2 = 0.193 ; k2 = 0.240, 0, 0.240
    # row 1: every k2, k3 < 0.005
    log_ratio = torch.log(t(RS_RATIOS))
    ones = torch.ones(2, 3)
    keep, _ = compute_rollout_rejection_mask(log_ratio, ones, "token_k3", 0.2)
    assert keep.tolist() == [[False, True, True], [True, True, True]]
    keep, _ = compute_rollout_rejection_mask(log_ratio, ones, "seq_mean_k3", 0.15)  # 0.167
    assert keep.tolist() == [[False] * 3, [True] * 3]
    # AND of both, thresholds per option: token_k3 <= 0.2 and seq_max_k2 <= 0.3 (0.240 passes)
    keep, metrics = compute_rollout_rejection_mask(
        log_ratio, ones, "token_k3,seq_max_k2", "0.2,0.3"
    )
    assert keep.tolist() == [[False, True, True], [True, True, True]]
    assert math.isclose(metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    assert metrics["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == 0.0
    keep, _ = compute_rollout_rejection_mask(log_ratio, ones, "token_k3,seq_max_k2", 0.2)
    assert keep.tolist() == [[False] * 3, [True] * 3]


def test_rejected_tokens_leave_the_denominator() -> None:
    # As verl (modified response_mask): token-mean divides by the 5 kept tokens; PPO ratio 1
    # and A = +1 give -1 for each of them
    config = PolicyLossConfig(rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="0.2,0.3")
    loss, metrics = _ratio1_loss(config, RS_RATIOS)
    assert close(loss, -5 / 5)
    assert math.isclose(metrics["rollout_corr/rollout_rs_masked_fraction"], 1 / 6, rel_tol=1e-6)
    seq = PolicyLossConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.15, tis_cap=1.5)
    loss, _ = _ratio1_loss(seq, RS_RATIOS)  # row 0 rejected; row 1 weights 1.1, 1/1.1, 1
    assert close(loss, -(1.1 + 1 / 1.1 + 1.0) / 3)
    # seq-mean: the rejected row is no longer a sequence of the mean
    by_seq = PolicyLossConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.15,
                              loss_agg_mode="seq-mean-token-sum")
    loss, _ = _ratio1_loss(by_seq, RS_RATIOS)
    assert close(loss, -3.0)


def test_parse_rollout_rs_rules_and_errors() -> None:
    rules = parse_rollout_rs("token_k1, seq_mean_k3,token_k1", "0.5_2,0.01")
    assert [(r.option, r.lower, r.upper) for r in rules] == [
        ("token_k1", 0.5, 2.0),
        ("seq_mean_k3", None, 0.01),
    ]
    assert parse_rollout_rs(None, None) == ()
    bad = [
        (("token_k4", 1.0), "rollout_rs"),
        (("seq_max_k1", 1.0), "rollout_rs"),
        ((" , ", 1.0), "rollout_rs"),
        (("token_k2", None), "rollout_rs_threshold"),
        ((None, 2.0), "rollout_rs_threshold"),
        (("token_k2,token_k3", "1,2,3"), "rollout_rs_threshold"),
        (("token_k2", "0.5_2"), "rollout_rs_threshold"),  # k2 takes one bound
        (("token_k1", "2_0.5"), "rollout_rs_threshold"),  # lower > upper
        (("token_k3", -1.0), "rollout_rs_threshold"),
        (("token_k3", "abc"), "rollout_rs_threshold"),
    ]
    for args, key in bad:
        with pytest.raises(algos.RolloutRSError) as info:
            parse_rollout_rs(*args)
        assert info.value.key == key, args


def test_gspo_warns_when_aggregation_differs_from_verl() -> None:
    with pytest.warns(UserWarning, match="seq-mean-token-mean"):
        PolicyLossConfig(loss_mode="gspo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PolicyLossConfig(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")


def test_bypass_uses_behaviour_log_probs_as_old() -> None:
    behav = OLD
    config = PolicyLossConfig(bypass=True, clip_ratio=0.2)
    loss, _ = compute_policy_loss_from_config(config, None, NEW, ADVS, ONES, rollout_log_prob=behav)
    ref, *_ = compute_policy_loss(behav, NEW, ADVS, ONES, cliprange=0.2)
    assert torch.equal(loss, ref)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss_from_config(config, None, NEW, ADVS, ONES)


@pytest.mark.parametrize("mode", ["vanilla", "cispo"])
def test_bypass_icepop_masks_without_weighting_twice(mode: str) -> None:
    # In bypass the surrogate's ratio already is pi / pi_behaviour (1.5, 0.5, 0.5, 5). IcePop
    # [0.4, 2] may only drop the ratio-5 token; weighting the kept ones by the ratio again gave
    # -A r^2 (vanilla: (-1.2 * 1.5 - 0.5 * 0.5 + 0.8 * 0.5) / 4), the bug this pins.
    icepop = PolicyLossConfig(loss_mode=mode, bypass=True, icepop_low=0.4, icepop_high=2.0)
    new = NEW.clone().requires_grad_()
    loss, metrics = compute_policy_loss_from_config(
        icepop, None, new, ADVS, ONES, rollout_log_prob=OLD
    )
    plain = PolicyLossConfig(loss_mode=mode)
    keep = t([[1.0, 1.0, 1.0, 0.0]])  # the rejected token leaves the denominator too
    per_token, _ = get_policy_loss_fn(mode)(OLD, NEW, ADVS, ONES, plain)
    assert torch.allclose(loss, (per_token * keep).sum() / 3)
    if mode == "vanilla":
        assert close(loss, (-1.2 - 0.5 + 0.8) / 3)
    loss.backward()
    # vanilla: only the unclipped token moves, d(-A r)/dlogp = -0.5 (double weighting: -0.25)
    if mode == "vanilla":
        assert new.grad is not None and close(new.grad, [[0.0, -0.5 / 3, 0.0, 0.0]])
    assert metrics["rollout_corr/icepop_maskfrac"] == 0.25


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_ratio_c": 1.0},
        {"loss_agg_mode": "sum"},
        {"loss_mode": "no_such_loss"},
        {"icepop_low": 0.5},
        {"rejection_low": 2.0, "rejection_high": 1.0},
        {"tis_cap": 0.0},
        {"bypass": True, "tis_cap": 2.0},
        {"bypass": True, "tis_cap": 2.0, "loss_mode": "cispo"},
        {"bypass": True, "loss_mode": "decoupled"},
        {"loss_mode": "decoupled", "tis_cap": 2.0},
        {"tis_cap": 2.0, "rollout_is_level": "geometric"},
        {"rollout_is_level": "sequence"},  # no tis_cap to truncate at
        {"rollout_is_batch_normalize": True},
        {"rollout_rs": "token_k2"},  # no threshold
        {"rollout_rs_threshold": 2.0},  # no rules
        {"rollout_rs": "token_k9", "rollout_rs_threshold": 2.0},
    ],
)
def test_policy_loss_config_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PolicyLossConfig(**kwargs)


def test_bypass_reinforce_accepts_truncated_weights() -> None:
    config = PolicyLossConfig(loss_mode="reinforce", bypass=True, tis_cap=2.0)
    assert config.corrects_rollout and not config.weights_by_ratio


def test_corrections_need_behaviour_log_probs() -> None:
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss_from_config(PolicyLossConfig(tis_cap=2.0), OLD, NEW, ADVS, ONES)


def test_policy_loss_micro_batches_sum_to_the_mini_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 5, generator=gen)
    new = old + 0.3 * torch.randn(4, 5, generator=gen)
    behav = old + 0.3 * torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    mask = (torch.arange(5)[None] < torch.tensor([5, 2, 0, 4])[:, None]).float()
    for agg, level in zip(LOSS_AGG_MODES, ["token", "sequence"] * len(LOSS_AGG_MODES)):
        config = PolicyLossConfig(
            loss_agg_mode=agg,
            tis_cap=1.5,
            rollout_is_level=level,
            rejection_low=0.5,
            rejection_high=2.0,
            rollout_rs="token_k3,seq_mean_k2",
            rollout_rs_threshold="0.3,0.05",
        )
        # the learner's pre-pass: keep masks, then counts of kept tokens over the mini-batch
        _, keep, _ = algos.rollout_correction(config, old - behav, mask)
        kept = mask.bool() & keep
        assert 0 < kept.sum() < mask.sum()  # the rules do reject something here
        counts = {"num_tokens": kept.sum(), "num_seqs": (kept.sum(-1) > 0).sum()}
        whole, _ = compute_policy_loss_from_config(
            config, old, new, adv, mask, rollout_log_prob=behav
        )
        parts = [
            compute_policy_loss_from_config(
                config, old[s], new[s], adv[s], mask[s], rollout_log_prob=behav[s],
                keep=keep[s], **counts
            )[0]
            for s in (slice(0, 1), slice(1, 4))
        ]
        assert torch.allclose(sum(parts), whole, atol=1e-6), agg


def test_batch_normalised_weights_share_the_mini_batch_factor() -> None:
    # token level, cap 4: truncated weights 2, 1 | 0.5 (row 1's second position is padding):
    # the mini-batch mean is 3.5 / 3, so every micro-batch divides by it, not by its own mean
    log_ratio = torch.log(t([[2.0, 1.0], [0.5, 9.0]]))
    mask = t([[1, 1], [1, 0]])
    config = PolicyLossConfig(tis_cap=4.0, rollout_is_batch_normalize=True)
    parts = algos.is_batch_norm_parts(config, log_ratio, mask)
    assert close(parts, [3.5, 3.0])
    factor = parts[0] / parts[1]
    weights, _, metrics = algos.rollout_correction(config, log_ratio[1:], mask[1:], factor)
    assert close(weights, [[0.5 * 3 / 3.5, 0.0]])
    assert close(metrics["rollout_corr/rollout_is_batch_norm_factor"], 3.5 / 3)
    seq = PolicyLossConfig(tis_cap=4.0, rollout_is_level="sequence",
                           rollout_is_batch_normalize=True)
    assert close(algos.is_batch_norm_parts(seq, log_ratio, mask), [2.0 + 0.5, 2.0])


# ------------------------------------------------------------------------------- value, entropy


def test_value_loss_by_hand() -> None:
    # token 0: clip(1.0, 0.3, 0.7) = 0.7; (1 - 2)^2 = 1 vs (0.7 - 2)^2 = 1.69 -> 1.69 (clipped)
    # token 1: clip(2.0, 0.3, 0.7) = 0.7; (2 - 0)^2 = 4 vs 0.49 -> 4; token 2 masked
    vpreds, values = t([[1.0, 2.0, 100.0]]), t([[0.5, 0.5, 0.0]])
    returns, mask = t([[2.0, 0.0, 0.0]]), t([[1, 1, 0]])
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert close(vf_loss, 0.5 * (1.69 + 4.0) / 2)
    assert close(clipfrac, 0.5)
    summed, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, "token-sum")
    assert close(summed, 0.5 * (1.69 + 4.0))


def test_entropy_loss_aggregates_token_entropy() -> None:
    logits = torch.log(t([[[1.0, 1.0], [1.0, 3.0], [5.0, 1.0]]]))  # entropies ln2, 0.5623, -
    mask = t([[1, 1, 0]])
    expected = (LN(2) - (0.25 * LN(0.25) + 0.75 * LN(0.75))) / 2
    assert close(compute_entropy_loss(logits, mask), expected)


def test_module_has_no_streamrl_imports() -> None:
    source = Path(algos.__file__).read_text(encoding="utf-8")
    assert "from streamrl" not in source and "import streamrl" not in source
    assert "torch.distributed" not in source

