"""A learner process's malloc gives every block from ``MMAP_THRESHOLD`` up a mapping of its own
(so it goes back to the system when freed), from the moment its ``Actor`` is built. Checked in
a fresh process: the setting is process-wide and lasts for the process's life. The decoder
layers' backward, where a step's peak is, holds no gathered root unit (fsdp.py), no second root
gradient (update_loop.py) and, for a SwiGLU MLP, two [tokens, intermediate] blocks (swiglu.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from streamrl.learner import fsdp, logprobs, swiglu, update_loop
from streamrl.learner.memory import MMAP_THRESHOLD, glibc, release_free_heap
from streamrl.learner.worker import LearnerWorker
from streamrl.testing import ResidentMemory
from tests.learner.test_logprobs import peak_live_bytes
from tests.support.learner import free_port, make_batch, make_config, with_advantages

pytestmark = pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's")

BLOCK = 24 << 20
"""Over ``MMAP_THRESHOLD``, under glibc's highest dynamic threshold (32 MiB)."""

CHILD = """
import ctypes, sys
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_config

class MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def where(size):
    before = libc.mallinfo2().hblkhd  # bytes in blocks mapped on their own
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblkhd - before >= size
    libc.free(block)
    return "mapped" if mapped else "heap"

model_dir, out, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Freeing a mapped block raises glibc's dynamic threshold to its size, as loading a model does:
# from then on a smaller block comes from the heap, unless the threshold was fixed.
libc.free(libc.malloc(size + (4 << 20)))
print(where(size))
LearnerWorker(make_config(model_dir, out), 0, 1, "127.0.0.1", free_port())
print(where(size))
"""


def test_learner_process_maps_large_blocks_of_their_own(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    assert MMAP_THRESHOLD < BLOCK
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_model_dir), str(tmp_path / "out"), str(BLOCK)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert child.returncode == 0, child.stderr[-2000:]
    before, after = child.stdout.split()[-2:]
    assert before == "heap"  # glibc's default, which the test would not tell apart otherwise
    assert after == "mapped"


def test_release_free_heap_returns_freed_small_blocks() -> None:
    libc = glibc()
    assert libc is not None
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    size, count = 64 << 10, 2048  # 128 MiB in blocks under every mmap threshold: heap blocks
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)  # resident
    for block in blocks[::2]:  # holes between live blocks: no trim at the heap's top frees them
        libc.free(block)
    memory = ResidentMemory()
    release_free_heap()
    released = -memory.extra_mib()[1]
    for block in blocks[1::2]:
        libc.free(block)
    assert released >= 0.75 * count // 2 * size / 2**20


def test_decoder_backward_holds_no_gathered_root(tiny_model_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient checkpointing, several micro-batches: while the decoder layers backpropagate,
    the root unit (tied embedding + head) is resharded, its gathered copy freed; the gradients
    equal those of FSDP2's default (the root gathered until its post-backward) to 1e-5."""
    batch = make_batch()
    config = {"model.gradient_checkpointing": True, "actor.ppo_micro_batch_size": 1,
              "actor.grad_clip": 0.0}

    def grads_and_states(tmp: Path) -> tuple[list[Tensor], list[bool]]:
        worker = LearnerWorker(make_config(tiny_model_dir, tmp, **config), 0, 1, "127.0.0.1",
                               free_port())
        model = worker.actor.model
        sharded: list[bool] = []

        def on_first_layer(module: nn.Module, args: tuple, output: object) -> None:
            if args[0].requires_grad:  # its gradient arrives after the last layer's backward
                args[0].register_hook(lambda grad: sharded.append(
                    isinstance(model.get_input_embeddings().weight, DTensor)))

        model.model.layers[0].register_forward_hook(on_first_layer)
        grads: list[Tensor] = []
        worker.actor.optimizer.register_step_pre_hook(lambda *_: grads.extend(
            p.grad.full_tensor().clone() for p in model.parameters()))
        worker.update(with_advantages(worker.prepare(batch), worker.cfg))
        return grads, sharded

    monkeypatch.setattr(fsdp, "_reshard_root_in_backward", lambda model: lambda *_: None)
    reference, gathered = grads_and_states(tmp_path / "default")
    monkeypatch.undo()
    grads, sharded = grads_and_states(tmp_path / "resharded")
    assert len(sharded) >= 2 and all(sharded)  # every micro-batch's decoder backward
    assert gathered and not any(gathered)  # what the check tells apart
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_equals_the_hf_mlp_and_holds_two_blocks(monkeypatch: pytest.MonkeyPatch,
                                                            dtype: torch.dtype) -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    T, H, inter, rows = 512, 32, 256, 128
    monkeypatch.setattr(swiglu, "MIN_CHUNK_ROWS", rows)  # four chunks
    monkeypatch.setattr(swiglu, "CHUNK_BYTES", 0)
    torch.manual_seed(0)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=H, intermediate_size=inter, hidden_act="silu")).to(dtype)
    x = torch.randn(2, T // 2, H, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(2, T // 2, H, dtype=dtype)
    fused = swiglu.fused_forward(mlp)
    assert fused is not None

    def grads_and_peak(forward) -> tuple[list[Tensor], Tensor, int]:
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        out = forward(x)
        peak = peak_live_bytes(lambda: out.backward(grad_out))
        return [x.grad, *(p.grad for p in mlp.parameters())], out.detach(), peak

    want, want_out, hf_peak = grads_and_peak(mlp.forward)
    got, got_out, peak = grads_and_peak(fused)
    tolerance = ({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                 else {"atol": 0.05, "rtol": 0.02})
    torch.testing.assert_close(got_out, want_out, **tolerance)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    # The gradients (bf16 weights' summed in fp32 first) and two blocks of one chunk's rows;
    # autograd's MLP holds [T, I] tensors (4 saved, 2 more made in its backward).
    weights = sum(p.numel() for p in mlp.parameters()) * (4 + (2 if dtype != torch.float32 else 0))
    bound = x.nbytes + weights + 2 * rows * inter * x.element_size() + (64 << 10)
    assert peak <= bound < hf_peak
    assert swiglu.fused_forward(nn.Sequential()) is None  # not a SwiGLU MLP: left as it is


def test_update_with_fused_mlp_and_one_root_reduce_equals_autograd(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient checkpointing, several micro-batches: the decoder layers' MLPs run through
    ``swiglu.SwiGLU``, the tied head's gradient is on the parameter before the decoder layers'
    backward (not held by autograd until the embedding's), and the root unit's gradient is
    reduced once, after the mini-batch's last micro-batch (no sharded one before it); the
    gradients equal those of autograd's MLP and tie with a reduce per micro-batch to 1e-5."""
    batch = make_batch()
    config = {"model.gradient_checkpointing": True, "actor.ppo_micro_batch_size": 1,
              "actor.grad_clip": 0.0}

    def grads_and_states(tmp: Path) -> tuple[list[Tensor], list[bool], list[bool], list[bool]]:
        worker = LearnerWorker(make_config(tiny_model_dir, tmp, **config), 0, 1, "127.0.0.1",
                               free_port())
        model = worker.actor.model
        fused = ["forward" in vars(layer.mlp) for layer in model.model.layers]
        reduced: list[bool] = []  # per training forward: the root has a sharded gradient
        gathered: list[Tensor] = []  # the head's weight as its forward saw it
        head_grad: list[bool] = []  # per backward: on that weight when the decoder's starts

        def before_fsdp(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                weight = model.get_input_embeddings().weight
                assert isinstance(weight, DTensor)  # the sharded parameter, before the gather
                reduced.append(weight.grad is not None)

        def on_last_layer(module: nn.Module, args: tuple, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:  # its gradient arrives once the head's backward is done
                hidden.register_hook(lambda grad: head_grad.append(gathered[-1].grad is not None))

        model.register_forward_pre_hook(before_fsdp, prepend=True)
        model.lm_head.register_forward_pre_hook(lambda m, a: gathered.append(m.weight))
        model.model.layers[-1].register_forward_hook(on_last_layer)
        grads: list[Tensor] = []
        worker.actor.optimizer.register_step_pre_hook(lambda *_: grads.extend(
            p.grad.full_tensor().clone() for p in model.parameters()))
        worker.update(with_advantages(worker.prepare(batch), worker.cfg))
        return grads, fused, reduced, head_grad

    monkeypatch.setattr(fsdp, "use_fused_mlp", lambda model: 0)
    monkeypatch.setattr(logprobs, "_own_leaf", lambda weight: (weight, None))
    monkeypatch.setattr(update_loop, "_reduce_root_grads", lambda model, now: None)
    reference, autograd_mlp, reduced_each, held = grads_and_states(tmp_path / "before")
    monkeypatch.undo()
    grads, fused, reduced_once, head_grad = grads_and_states(tmp_path / "after")
    assert all(fused) and not any(autograd_mlp)
    assert len(reduced_once) >= 2 and not any(reduced_once)
    assert reduced_each[1:] and all(reduced_each[1:])  # what the checks tell apart
    assert len(head_grad) == len(reduced_once) and all(head_grad)
    assert not held[0]  # the first backward: autograd held it, the parameter had none yet
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
