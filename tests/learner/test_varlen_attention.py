"""``streamrl_varlen`` attention against sdpa's block-diagonal mask on ragged packed rows:
the same logits and gradients, with grouped-query heads too, and sdpa's own path for padded
rows (their attention mask) and for calls without sequence bounds."""

from __future__ import annotations

import random

import pytest
import torch

from streamrl.learner import varlen_attention


def _model(attn: str, kv_heads: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    varlen_attention.register()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=256)
    config._attn_implementation = attn
    return Qwen2ForCausalLM(config)


def _packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    ids = torch.randint(1, 97, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    bounds = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
              "max_length_k": max(lengths)}
    return ids, position_ids, bounds


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_matches_the_block_diagonal_mask_in_values_and_gradients(kv_heads: int) -> None:
    sdpa, varlen = _model("sdpa", kv_heads), _model(varlen_attention.IMPLEMENTATION, kv_heads)
    varlen.load_state_dict(sdpa.state_dict())
    rng = random.Random(kv_heads)
    ids, position_ids, bounds = _packed([rng.randint(1, 40) for _ in range(9)])
    want = sdpa(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    got = varlen(input_ids=ids, position_ids=position_ids, use_cache=False, **bounds).logits
    assert (got - want).abs().max() < 1e-5
    (want * torch.linspace(-1, 1, want.shape[-1])).sum().backward()
    (got * torch.linspace(-1, 1, got.shape[-1])).sum().backward()
    for (name, a), b in zip(sdpa.named_parameters(), varlen.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name


def test_calls_without_bounds_are_sdpa_calls() -> None:
    sdpa, varlen = _model("sdpa", 2), _model(varlen_attention.IMPLEMENTATION, 2)
    varlen.load_state_dict(sdpa.state_dict())
    ids = torch.randint(1, 97, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # a left-padded row
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask, "position_ids": position_ids}, {}):
            want = sdpa(input_ids=ids, use_cache=False, **kwargs).logits
            got = varlen(input_ids=ids, use_cache=False, **kwargs).logits
            assert torch.equal(got, want)


def test_a_packed_row_without_bounds_is_bounded_by_its_position_ids() -> None:
    """No ``cu_seq_lens_q``: the restarts of the position ids bound the sequences, as sdpa's
    block-diagonal mask does; and transformers builds no [T, T] mask for the row."""
    from transformers.masking_utils import create_causal_mask

    sdpa, varlen = _model("sdpa", 2), _model(varlen_attention.IMPLEMENTATION, 2)
    varlen.load_state_dict(sdpa.state_dict())
    ids, position_ids, _ = _packed([7, 1, 30, 12])
    with torch.no_grad():
        want = sdpa(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        got = varlen(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert (got - want).abs().max() < 1e-5
    embeds = torch.zeros(1, ids.shape[1], 32)
    assert create_causal_mask(config=varlen.config, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=position_ids) is None
    padded = torch.ones(2, ids.shape[1], dtype=torch.long)
    padded[0, :3] = 0  # padded rows keep sdpa's mask
    assert create_causal_mask(config=varlen.config, inputs_embeds=embeds.expand(2, -1, -1),
                              attention_mask=padded, past_key_values=None,
                              position_ids=None) is not None


def test_varlen_keeps_the_sliding_window() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    varlen_attention.register()

    def model(attn: str, window: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, use_sliding_window=window,
                             sliding_window=5, max_window_layers=0)
        config._attn_implementation = attn
        return Qwen2ForCausalLM(config)

    ids, position_ids, bounds = _packed([3, 17, 9, 26])
    varlen = model(varlen_attention.IMPLEMENTATION, True)
    with torch.no_grad():
        want, unwindowed = (model("sdpa", window)(input_ids=ids, position_ids=position_ids,
                                                  use_cache=False).logits
                            for window in (True, False))
        for kwargs in (bounds, {}):  # the bounds given, or read from the position ids
            got = varlen(input_ids=ids, position_ids=position_ids, use_cache=False,
                         **kwargs).logits
            assert (got - want).abs().max() < 1e-5
    assert (unwindowed - want).abs().max() > 1e-3  # the window matters for these rows
