"""A learner process's malloc gives every block from ``MMAP_THRESHOLD`` up a mapping of its own
(so it goes back to the system when freed), from the moment its ``Actor`` is built. Checked in
a fresh process: the setting is process-wide and lasts for the process's life."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.learner.memory import MMAP_THRESHOLD, glibc, release_free_heap
from streamrl.testing import ResidentMemory

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
