"""One model forward on one micro-batch, with results on the padded [n, R] response grid.

Parts:
- ``MicroBatch``: rows of a batch as one forward's input (``logprobs.policy_log_probs`` takes
  one for the policy's log-probs, computed in the LM head).
- ``value_forward``: per-token values of a value model (the state before each response token).
- ``gather_rows``: every rank's rows of a [B, R] result assembled on all ranks.

Two layouts give the same numbers: *packed* (``Batch.pack``: the micro-batch's real tokens in
one [1, T] row, position_ids restarting per sequence and ``attention_mask=None``; the model's
attention, ``varlen_attention``, keeps each sequence to itself from the bounds it is given, so
padding costs no compute) and *padded*
(verl's [n, P+R] rows with an attention mask). Only positions that predict a response token go
through the LM head (``logits_to_keep``). ``rows=[]`` runs a zero-weight dummy on row 0 so the
rank still takes part in FSDP's collectives.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamrl.batch import Batch


@dataclass
class MicroBatch:
    """Rows of a batch as one forward's input; ``mask`` is the response mask (zero for a dummy)."""

    batch: Batch
    rows: list[int]
    packed: bool
    dummy: bool = False
    proximal: Tensor | None = None
    """The proximal ("old") log-probs of these rows, [n, R], once the update's first pass over
    this micro-batch has set them (``Actor.update``)."""
    keep: Tensor | None = None
    """[n, R] bool: the response tokens the rollout correction keeps in the loss (its rejection
    rules drop the others), when the actor's mini-batch pre-pass has set it."""

    @classmethod
    def of(cls, batch: Batch, rows: list[int], packed: bool) -> MicroBatch:
        return cls(batch, rows or [0], packed, dummy=not rows)

    def column(self, key: str, device: torch.device) -> Tensor:
        """``batch[key]`` for these rows, on ``device``; zeros for a dummy's response mask."""
        idx = torch.tensor(self.rows, device=self.batch.tensors[key].device)
        out = self.batch.tensors[key][idx].to(device)
        return torch.zeros_like(out) if self.dummy and key == "response_mask" else out

    def loss_mask(self, device: torch.device) -> Tensor:
        """The response mask without the tokens ``keep`` rejects."""
        mask = self.column("response_mask", device)
        return mask if self.keep is None else mask * self.keep.to(device=device, dtype=mask.dtype)


def value_forward(model: nn.Module, mb: MicroBatch, device: torch.device) -> Tensor:
    """[n, R] fp32 values: the value head at the position just before each response token."""
    with warnings.catch_warnings():
        # The head's [.., 1] output is a view; FSDP2 warns about in-place edits of views, and
        # nothing here edits outputs in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        return _value_forward(model, mb, device)


def _value_forward(model: nn.Module, mb: MicroBatch, device: torch.device) -> Tensor:
    if mb.packed:
        pb = mb.batch.pack(mb.rows).to(device)
        out = model(input_ids=pb.input_ids, position_ids=pb.position_ids, use_cache=False,
                    **pb.attention_kwargs)
        return pb.unpack_response(out.logits[0, :, 0].float())
    width = mb.batch.tensors["responses"].shape[1]
    out = model(
        input_ids=mb.column("input_ids", device),
        attention_mask=mb.column("attention_mask", device),
        position_ids=mb.column("position_ids", device),
        use_cache=False,
    )
    valid = mb.column("attention_mask", device)[:, -width:].float()
    return out.logits[:, -width - 1 : -1, 0].float() * valid


def gather_rows(parts: list[tuple[list[int], Tensor]], num_rows: int, like: Tensor) -> Tensor:
    """Assemble [num_rows, R] from this rank's (rows, values) parts and every other rank's.

    Ranks own disjoint rows, so a SUM all-reduce over zero-filled tensors is an exact gather
    (x + 0 == x in IEEE arithmetic) and needs no pickled objects.
    """
    out = like.new_zeros((num_rows, like.shape[-1]))
    for rows, values in parts:
        if rows:
            out[torch.tensor(rows, device=out.device)] = values[: len(rows)].to(out.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out
