"""A learner process's malloc gives every block from ``MMAP_THRESHOLD`` up a mapping of its own
(so it goes back to the system when freed), from the moment its ``Actor`` is built. Checked in
a fresh process: the setting is process-wide and lasts for the process's life. The decoder
layers' backward, where a step's peak is, holds no gathered root unit (fsdp.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from streamrl.learner import fsdp
from streamrl.learner.memory import MMAP_THRESHOLD, glibc, release_free_heap
from streamrl.learner.worker import LearnerWorker
from streamrl.testing import ResidentMemory
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
