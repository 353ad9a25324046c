"""Per-token log-probs (and entropies) of response tokens without the [tokens x vocab] logits.

Parts:
- ``token_log_probs``: hidden states [.., H] + LM head weight [V, H] -> log-probs (entropies)
  of ``logits / temperature``. The one place a backend is chosen: liger-kernel's fused linear
  scaled cross-entropy on CUDA when it is installed (never required), else
  ``algos.chunked_log_probs`` (chunks of tokens, softmax recomputed in backward).
- ``head_log_probs``: one model forward whose LM head yields log-probs instead of logits.
- ``policy_log_probs``: (log_probs, entropy) of a micro-batch's response tokens on the padded
  [n, R] response grid, zeros on padding, packed or padded layout, through ``head_log_probs``.

Why hooks on the LM head, not a forward of the backbone plus ``lm_head.weight``: under FSDP2 the
root ``fully_shard`` unit (embeddings, final norm, head; tied weights are one parameter) is
unsharded only inside the root module's forward, by its pre-forward hook, and its pre-backward
hook fires on the root's outputs. So the head's input is taken in a forward pre-hook (the head
then multiplies an empty slice), the log-probs are computed right there from the unsharded
``module.weight``, and a forward hook returns them as the model's ``logits`` [.., L, 1 or 2].
They are a root output, so FSDP re-gathers the head weight before their backward wherever it
resharded, and the head weight's gradient is reduce-scattered with the rest of the root unit.
Models that post-process logits after the head (soft-capping, scaling) or whose head is not a
bias-free ``nn.Linear`` take the logits path: full logits from the model, then
``algos.chunked_log_probs`` on them (no fp32 copy, no softmax kept; the logits and their
gradient remain one [T, V] each).
The head computes with its weight as an autograd leaf of its own (``_own_leaf``): a tied
embedding's gradient from the head goes onto the parameter at once, not after the decoder
backward; from the second micro-batch on the head's backward adds into it in place. The
forward hands the heap's free pages back before the model and before the head (memory.py).
Depends on algos, batch (via the micro-batch), forward's ``MicroBatch`` and memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from streamrl import algos
from streamrl.learner.forward import MicroBatch
from streamrl.learner.memory import release_free_heap

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 * 2**20
"""fp32 logits per chunk of the torch backend, in bytes, whatever the vocabulary (170 tokens at
V = 49k), unless that is under ``MIN_CHUNK_ROWS``. The chunk is the backend's only [tokens x
vocab] block: forward holds about two (the logits and log-sum-exp's exponentials), backward one
(and, for a bf16 head, its bf16 copy). 128 MiB chunks (682 tokens) put 0.3 GB more into
SmolLM2's fp32 peak (docs/real-models.md, "Learner memory")."""

MIN_CHUNK_ROWS = 128
"""Fewest tokens per chunk: the head's three matmuls per chunk ran at 117-124 GFLOP/s from 128
to 682 rows on 2 CPU threads, 88-91 at 55 (V = 49k and 152k, fp32)."""

_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""HF config fields of models that change the head's output before returning it as logits."""

_BACKENDS: dict[str, Any] = {}
"""device type -> liger's function, or None for the torch backend (decided on first use)."""


def _chunk_rows(vocab: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab))


def _liger(device_type: str) -> Any:
    """liger-kernel's ``LigerFusedLinearScaledCrossEntropyFunction`` (>= 0.8.3) on CUDA, else
    None."""
    if device_type not in _BACKENDS:
        _BACKENDS[device_type] = None
        if device_type == "cuda":
            try:
                from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction
            except ImportError:
                pass
            else:
                _BACKENDS[device_type] = LigerFusedLinearScaledCrossEntropyFunction
    return _BACKENDS[device_type]


def token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    weight_grad_into: Callable[[], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log_softmax(hidden @ weight.T / temperature)[label], entropy or None), each
    ``labels.shape`` fp32, over the top-k / top-p set when they are on; the entropy carries
    gradients only with ``entropy_grad``. liger has no truncation: the torch backend then,
    which adds the weight's gradient into ``weight_grad_into()`` where that gives a tensor
    (``algos.chunked_log_probs``)."""
    liger = _liger(hidden.device.type) if top_k <= 0 and top_p >= 1.0 else None
    if liger is not None:
        try:
            out = liger.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                              labels.reshape(-1).long(), float(temperature), -100, 1,
                              with_entropy)
        except ImportError as exc:  # e.g. its SM90 kernel without the cutedsl extra
            log.warning("liger-kernel unusable (%s); log-probs use the torch backend", exc)
            _BACKENDS[hidden.device.type] = None
        else:
            nll, entropy = out if with_entropy else (out, None)
            if entropy is not None:
                entropy = (entropy if entropy_grad else entropy.detach()).float()
                entropy = entropy.reshape(labels.shape)
            return (-nll).float().reshape(labels.shape), entropy
    return algos.chunked_log_probs(
        hidden, labels, weight, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, chunk_rows=_chunk_rows(weight.shape[0]), top_k=top_k,
        top_p=top_p, weight_grad_into=weight_grad_into,
    )


def fused_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head when ``head_log_probs`` may compute log-probs in it, else None."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) for key in _LOGIT_POSTPROCESSING):
        return None
    return head


def head_log_probs(
    model: nn.Module,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    **model_inputs: Any,
) -> tuple[Tensor, Tensor | None]:
    """``model(**model_inputs)`` with the LM head's [.., L, H] input turned into log-probs of
    ``labels`` [.., L] (and entropies), never materialising the [.., L, V] logits."""
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
          "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    release_free_heap()  # the last micro-batch's free heap: not into this one's peak
    head = fused_head(model)
    if head is None:
        logits = model(**model_inputs).logits
        return algos.chunked_log_probs(logits, labels, chunk_rows=_chunk_rows(logits.shape[-1]),
                                       **kw)
    computed: list[Tensor] = []

    def take_hidden(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        release_free_heap()  # the forward's, before the backward's peak (memory.py)
        hidden = args[0]
        leaf, grad_into = _own_leaf(module.weight)
        log_probs, entropy = token_log_probs(hidden, leaf, labels, weight_grad_into=grad_into,
                                             **kw)
        # A new tensor, not a view: FSDP2 hooks the root's outputs for its pre-backward.
        computed.append(torch.stack([log_probs] if entropy is None else [log_probs, entropy], -1))
        return (hidden[..., :0, :], *args[1:])  # the head itself multiplies nothing

    def give_log_probs(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        return computed[-1]

    hooks = [head.register_forward_pre_hook(take_hidden),
             head.register_forward_hook(give_log_probs)]
    try:
        out = model(**model_inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    if len(computed) != 1 or out is not computed[0]:
        raise RuntimeError(f"{type(model).__name__} changes its LM head's output before returning "
                           "logits; add the config field that says so to _LOGIT_POSTPROCESSING")
    entropy = None
    if with_entropy:  # one output tensor: keep a metric entropy out of the graph
        entropy = out[..., 1] if entropy_grad else out[..., 1].detach()
    return out[..., 0], entropy


def _own_leaf(weight: Tensor) -> tuple[Tensor, Callable[[], Tensor | None] | None]:
    """``weight`` as an autograd leaf of its own, whose gradient is added into ``weight.grad`` as
    soon as the head's backward has made it; and the getter of ``weight.grad`` for a backward
    that adds into it directly (a later micro-batch's: no [vocab, H] buffer of its own).

    A tied embedding is one leaf for the head and the embedding lookup: autograd sums a leaf's
    gradients before accumulating them, so it held the head's (the backward's first, 108 MiB fp32
    at SmolLM2) until the embedding's (its last) through the whole decoder backward, where a
    step's peak is; accumulated at once, it is the only copy from the second micro-batch on
    (with the root's reduce left to the last micro-batch, ``update_loop._reduce_root_grads``).
    """
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return weight, None
    leaf = weight.detach().requires_grad_()

    def accumulate(leaf: Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None:  # the head's backward added it into weight.grad itself
            return
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad.add_(grad)

    leaf.register_post_accumulate_grad_hook(accumulate)
    return leaf, lambda: weight.grad


def policy_log_probs(
    model: nn.Module,
    mb: MicroBatch,
    device: torch.device,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log_probs, entropy or None), each [n, R] fp32, zeros on padding positions: log-probs
    of ``logits / temperature`` cut to the top-k / top-p set (the distribution the rollout
    sampled from: vLLM's processed log-probs), computed in the head."""
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
          "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    if mb.packed:
        pb = mb.batch.pack(mb.rows).to(device)
        keep = pb.predict_mask[0].nonzero().squeeze(-1)
        log_probs, entropy = head_log_probs(
            model, pb.targets[:, keep], input_ids=pb.input_ids, position_ids=pb.position_ids,
            use_cache=False, logits_to_keep=keep, **pb.attention_kwargs, **kw,
        )

        def unpack(values: Tensor) -> Tensor:
            return pb.unpack_response(values.new_zeros(pb.num_tokens).index_put((keep,), values[0]))

        return unpack(log_probs), (unpack(entropy) if entropy is not None else None)
    responses = mb.column("responses", device)
    width = responses.shape[1]
    # The head sees the last width + 1 positions; the last predicts nothing (label 0, dropped).
    log_probs, entropy = head_log_probs(
        model, F.pad(responses, (0, 1)), input_ids=mb.column("input_ids", device),
        attention_mask=mb.column("attention_mask", device),
        position_ids=mb.column("position_ids", device), use_cache=False,
        logits_to_keep=width + 1, **kw,
    )
    valid = mb.column("attention_mask", device)[:, -width:].to(log_probs.dtype)
    log_probs = log_probs[:, :-1] * valid
    return log_probs, (entropy[:, :-1] * valid if entropy is not None else None)
