"""A SwiGLU MLP (``down(silu(gate(x)) * up(x))``, Llama / Qwen2 / Mistral) whose backward holds
two [tokens, intermediate] tensors instead of six.

Autograd's own MLP saves four of them (gate's output, its silu, up's output, their product) and
its backward adds two more at once (the product's gradient, then silu's and up's): six of the
recomputed decoder layer's largest tensors alive together under gradient checkpointing, where
a step's peak is (SmolLM2, 4096 tokens: [4096, 1536] fp32 is 24 MiB, 144 MiB of them).
``SwiGLU`` saves only the two projections' outputs (and the input, which ``gate`` saved too) and
goes through the backward ``CHUNK_BYTES`` of intermediate rows at a time: silu, the product and
every gradient are formed per chunk, the weight gradients summed over chunks (in fp32 for
bf16 weights).

``use_fused_mlp(model)`` sets it into every decoder layer whose MLP is the plain HF one (bias-free
``nn.Linear`` projections, SiLU; not a LoRA-wrapped projection); ``fsdp.parallelize`` calls it
when gradient checkpointing is on. Same numbers as the HF MLP: to the bit in one chunk, up to
summation order over several (``tests/learner/test_memory.py``). Depends on torch only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHUNK_BYTES = 8 * 2**20
"""One chunk's [rows, intermediate] block in the backward (two are alive): 1365 rows at
SmolLM2's 1536 in fp32."""

MIN_CHUNK_ROWS = 1024
"""Fewest rows per chunk: the weight gradients' matmuls reduce over rows, and at 341-683 rows
they ran 1.3-1.9x slower than at 1365-4096 (2 CPU threads, [rows, 1536] x [rows, 576])."""

_SILU = ("SiLU", "SiLUActivation")
"""torch's and transformers' SiLU modules (``hidden_act`` silu / swish)."""


class SwiGLU(torch.autograd.Function):
    """``F.linear(silu(x @ w_gate.T) * (x @ w_up.T), w_down)``, saving x, gate and up only."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return F.linear(F.silu(gate).mul_(up), w_down)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        hidden, inter = x.shape[-1], gate.shape[-1]
        x, gate, up = x.reshape(-1, hidden), gate.reshape(-1, inter), up.reshape(-1, inter)
        dy = grad_out.reshape(-1, hidden)
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        # Frozen projections (LoRA on the attention only) get no gradient and cost no matmul.
        d_gate, d_up, d_down = (torch.empty(w.shape, dtype=acc, device=w.device) if needed
                                else None for w, needed in zip((w_gate, w_up, w_down),
                                                                ctx.needs_input_grad[1:]))
        dx = torch.empty_like(x)
        rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (inter * gate.element_size()))
        for start in range(0, x.shape[0], rows):
            sl, first = slice(start, start + rows), start == 0
            g, u, d = gate[sl], up[sl], dy[sl]
            # Two [rows, inter] blocks, each reused in place: silu(g) becomes up's gradient,
            # the product (down's input) becomes the product's gradient, then gate's.
            act = F.silu(g)
            block = act * u
            _add_product(d_down, d.t(), block, first)
            torch.mm(d, w_down, out=block)
            _add_product(d_up, act.mul_(block).t(), x[sl], first)
            d_g = torch.ops.aten.silu_backward.grad_input(block.mul_(u), g, grad_input=block)
            _add_product(d_gate, d_g.t(), x[sl], first)
            torch.mm(d_g, w_gate, out=dx[sl])
            dx[sl] += act @ w_up  # autograd's sum of the two inputs' gradients, to the bit
            del act, block, d_g  # before the next chunk's: a name left on a block keeps it
        return (dx.reshape(grad_out.shape),
                *(None if d is None else d.to(w.dtype)
                  for d, w in ((d_gate, w_gate), (d_up, w_up), (d_down, w_down))))


def _add_product(out: Tensor | None, a: Tensor, b: Tensor, first: bool) -> None:
    """``out = a @ b`` (``first``) or ``out += a @ b``; out may be fp32 for bf16 operands, the
    sum over chunks kept in fp32. One chunk: autograd's numbers to the bit. None: not wanted."""
    if out is None:
        return
    if out.dtype != a.dtype:
        if first:
            out.copy_(a @ b)
        else:
            out.add_(a @ b)
    elif first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def fused_forward(mlp: nn.Module) -> Any:
    """A forward for ``mlp`` through ``SwiGLU``, or None when it is not the plain HF MLP."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is nn.Linear and p.bias is None for p in projections):
        return None
    if type(getattr(mlp, "act_fn", None)).__name__ not in _SILU:
        return None
    gate, up, down = projections

    def forward(x: Tensor) -> Tensor:
        return SwiGLU.apply(x, gate.weight, up.weight, down.weight)  # type: ignore[no-any-return]

    return forward


def use_fused_mlp(model: nn.Module) -> int:
    """Route every plain SwiGLU MLP of ``model`` through ``SwiGLU``; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("MLP") and (forward := fused_forward(module)):
            module.forward = forward  # type: ignore[method-assign]
            count += 1
    return count
