"""Attention over a packed row without a [T, T] mask: transformers' ``"streamrl_varlen"``.

A packed micro-batch (``Batch.pack``) is one [1, T] row of n sequences. sdpa attends over it
with a block-diagonal [T, T] mask, so its cost grows with T², though each token only sees its
own sequence: 128 sequences of 18 tokens cost 4.5x the forward and backward of the same rows
padded. Flash-attention's varlen kernels avoid that on GPUs that have them; this does it with
plain sdpa anywhere: when the call carries ``cu_seq_lens_q`` (the packed sequence bounds,
``PackedBatch.cu_seqlens``), the row's queries, keys and values are gathered into [n, L]
blocks (L: the longest sequence), attended with a causal mask per block, and scattered back:
n·L² instead of T². A row without a padding mask and without ``cu_seq_lens_q`` (one
sequence, or sequences packed by their restarting position ids) gets its bounds from the
position ids. Padded rows (an attention mask) are sdpa's, with the mask transformers builds.

Rows without a padding mask need no [T, T] mask either, so ``varlen_mask`` builds none: from
the position ids' restarts, transformers would otherwise build the block-diagonal mask that this
attention never reads (15-24 % of a small model's update on CPU).

``register()`` adds both to transformers' registries; load a model with
``attn_implementation=IMPLEMENTATION`` after it. Models that add mask functions of their own
(image-token masks) are not supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMPLEMENTATION = "streamrl_varlen"


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, varlen_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, varlen_mask)


def varlen_mask(batch_size: int, q_length: int, kv_length: int, *args: Any,
                attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """transformers' mask-function contract: None for one row without a padding mask and
    without a cache (``varlen_attention`` bounds its sequences itself), sdpa's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and batch_size == 1 and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask,
                     **kwargs)


def varlen_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query/key/value [B, heads, T, D] in,
    ([B, T, heads, D], no weights) out."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    unpadded_row = (attention_mask is None and query.shape[0] == 1
                    and query.shape[2] == key.shape[2])
    if cu_seqlens is None and unpadded_row:
        cu_seqlens = _bounds_from_positions(kwargs.get("position_ids"), query.shape[2])
    if cu_seqlens is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    total = query.shape[2]
    bounds = cu_seqlens.to(query.device)
    lengths = bounds.diff()
    width = int(kwargs.get("max_length_q") or lengths.max())
    positions = torch.arange(width, device=query.device)
    real = positions[None, :] < lengths[:, None]  # [n, L]: which block slots hold a token
    index = (bounds[:-1, None] + positions[None, :]).clamp(max=total - 1)

    def blocks(x: Tensor) -> Tensor:  # [1, h, T, D] -> [n, h, L, D]
        return x[0][:, index].transpose(0, 1)

    groups = getattr(module, "num_key_value_groups", 1)
    q, k, v = blocks(query), repeat_kv(blocks(key), groups), repeat_kv(blocks(value), groups)
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    if window := kwargs.get("sliding_window"):  # a key at most window - 1 tokens back
        causal = causal.triu(-(window - 1))
    # A padding slot's query (its output is dropped) sees every key: no row of the mask is
    # empty, which would make sdpa's softmax NaN.
    mask = (causal[None, None] & real[:, None, None, :]) | ~real[:, None, :, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                         scale=scaling)
    # [n, h, L, D] -> the real slots in row order, which is the packed order: [1, T, h, D]
    return out.transpose(1, 2)[real][None], None


def _bounds_from_positions(position_ids: Tensor | None, total: int) -> Tensor:
    """[n+1] sequence bounds of a [1, T] row: a sequence starts wherever the position ids do
    not count on by one (as transformers reads packed rows); no position ids: one sequence."""
    starts = [0]
    if position_ids is not None:
        restarts = (position_ids[0].diff() != 1).nonzero().squeeze(-1) + 1
        starts += restarts.tolist()
    return torch.tensor([*starts, total], dtype=torch.int32)
