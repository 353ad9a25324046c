"""The learner process's host allocator: large freed blocks go back to the system at once.

A learner step allocates and frees gigabytes of activations, recomputed layers, logits chunks
and bf16 parameter copies, in blocks of 1-130 MB. glibc's malloc gives a block a mapping of its
own only above its *dynamic* mmap threshold, which every free of such a mapping raises (to 32
MiB at most): after a model is loaded it sits at the top, so most tensors land in the heap
arenas, whose freed space glibc keeps resident and fragments. On SmolLM2-135M (bf16, gradient
checkpointing, two 4096-token micro-batches) the arenas held 1.45 GB free after a step and the
peak resident set was 4.21 GB, 2.1x the fp32 params + grads + AdamW states.

``configure_allocator()`` fixes the threshold at ``MMAP_THRESHOLD`` (``mallopt``, which also
stops the dynamic rise): every tensor from 4 MiB up is a mapping of its own, unmapped when
freed, so the resident set follows what is alive. Same run: peak 3.39-3.72 GB (1.7-1.9x) in
two processes, update time unchanged. Lower thresholds trade time for little: at glibc's
initial 128 KiB the peak was 1.6x but the update 20 % slower, the many small tensors
(attention per sequence, norms) each mapped, faulted in and zeroed anew (docs/real-models.md,
"Learner memory").

``Actor`` calls it when built, so every learner process (Ray actors, hybrid workers, tests,
benchmarks) runs with it, process-wide for the process's life. A no-op where the C library is
not glibc.

What stays in the heap still fragments: the blocks under the threshold (parameters, AdamW's
moments, per-sequence tensors) leave ~0.3 GB of free heap resident after a step on SmolLM2.
``release_free_heap()`` (``malloc_trim``) hands the free pages back; the learner's forward
calls it before each micro-batch and again before the LM head, just ahead of the backward, where
the peak is (``logprobs.head_log_probs``). fp32 SmolLM2 step: peak 3.23 GB instead of 3.33-3.60
(1.61x the states instead of 1.66-1.80x), ~10 ms a call.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""
MMAP_THRESHOLD = 4 * 2**20
"""Blocks from this size up are mappings of their own: above the per-sequence and per-norm
tensors a step churns through by the thousand, below a layer's activations for a 4096-token
micro-batch (4.5 MiB and up at SmolLM2's width)."""


def configure_allocator() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for this process; False where malloc
    is not glibc's (nothing changed) or refused the setting (logged)."""
    libc = glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: freed tensors stay in the heap",
                    MMAP_THRESHOLD)
        return False
    return True


def release_free_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; a no-op elsewhere):
    what is freed below ``MMAP_THRESHOLD`` stays resident otherwise."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    libc = ctypes.CDLL(None)  # the symbols the process has loaded
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
