"""Atomic, resumable checkpoints (torch DCP) and HF exports.

Layout under a root directory (the trainer's output_dir)::

    root/global_step_<N>/          one complete checkpoint
        .metadata, __*.distcp      DCP: model, optimizer, LR scheduler of each TrainState
        rng/rank_<r>.json          python / numpy / torch (/ cuda) RNG state of each rank
        extra.json                 caller state (buffer cursor, trained group ids, each
                                   replica's prompt cursor and groups in flight:
                                   docs/partials.md), msgspec JSON
        meta.json                  step, world size; written last: its presence marks "complete"
    root/latest                    "global_step_<N>", replaced atomically
    root/partials/                 not this module's: the replicas' groups in flight saved
                                   at their last stop (docs/partials.md)

Saving writes everything into ``root/.tmp-global_step_<N>``, renames it into place, then
rewrites ``latest`` through a temp file and ``os.replace``. A process killed at any moment
leaves the previous checkpoint and pointer intact (a stray temp dir is ignored and cleared by
the next save). ``max_to_keep`` prunes the oldest complete checkpoints. Nothing here pickles
caller data; RNG states are JSON too.

Parts: ``TrainState`` (DCP Stateful for model + optimizer + scheduler), ``save_checkpoint``,
``load_checkpoint``, ``find_latest``, ``export_hf``. Collective: every rank calls save/load.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from streamrl.files import write_atomic

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"
EXTRA = "extra.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


@dataclass
class TrainState:
    """Model + optimizer + LR scheduler as one DCP ``Stateful`` (sharded, resharding-safe).

    ``trainable_only`` (a LoRA actor): the model's part is its trainable parameters alone, the
    adapter; the frozen base weights come from ``model.path`` on resume."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trainable_only: bool = False

    def _options(self) -> StateDictOptions:
        # strict=False lets the frozen weights be absent; DCP still fails on a missing
        # adapter key, since the state it loads into names every one.
        return StateDictOptions(ignore_frozen_params=self.trainable_only,
                                strict=not self.trainable_only)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        if self.trainable_only:  # a tied head is frozen too, but escapes ignore_frozen_params
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=self._options(),
        )
        self.scheduler.load_state_dict(state["scheduler"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- RNG states as JSON ----------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                       for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                         float(cached)))

    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


# ---- save / load -----------------------------------------------------------------------------

def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    states: dict[str, TrainState],
    extra: dict[str, Any] | None = None,
    *,
    max_to_keep: int = 0,
) -> Path:
    """Save ``states`` + RNG + ``extra`` (JSON-encodable) as ``root/global_step_<step>``
    atomically, point ``root/latest`` at it and prune to ``max_to_keep`` (0: keep all).
    Every rank must call this; returns the final directory."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    extra_bytes = msgspec.json.encode(extra or {})  # fail before writing anything
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that was killed
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    dcp.save(dict(states), checkpoint_id=str(tmp))
    write_atomic(tmp / "rng" / f"rank_{_rank()}.json", msgspec.json.encode(rng_state()))
    _barrier()
    if _rank() == 0:
        write_atomic(tmp / EXTRA, extra_bytes)
        meta = {"step": step, "world_size": _world(), "states": sorted(states)}
        write_atomic(tmp / META, msgspec.json.encode(meta))
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (after a resume): move the old one out first
            trash = root / f".trash-{final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            shutil.rmtree(trash)
        os.rename(tmp, final)
        write_atomic(root / LATEST, f"{final.name}\n".encode())
        _fsync_dir(root)
        _prune(root, max_to_keep, keep=final)
    _barrier()
    return final


def _prune(root: Path, max_to_keep: int, keep: Path) -> None:
    if max_to_keep <= 0:
        return
    complete = _complete_steps(root)
    for _, path in complete[: max(0, len(complete) - max_to_keep)]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def find_latest(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``root/latest`` names if it is complete, else the newest complete one,
    else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / META).is_file():
            return target
    complete = _complete_steps(root)
    return complete[-1][1] if complete else None


def load_checkpoint(
    path: str | os.PathLike[str], states: dict[str, TrainState], *, restore_rng: bool = True
) -> tuple[int, dict[str, Any]]:
    """Load ``states`` in place from a complete checkpoint; returns (step, extra)."""
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META})")
    meta = msgspec.json.decode((path / META).read_bytes())
    missing = sorted(set(states) - set(meta["states"]))
    if missing:
        raise KeyError(f"checkpoint {path} has no state for {missing} (has {meta['states']})")
    dcp.load(dict(states), checkpoint_id=str(path))
    rng_file = path / "rng" / f"rank_{_rank()}.json"
    if restore_rng and rng_file.is_file():
        set_rng_state(msgspec.json.decode(rng_file.read_bytes()))
    elif restore_rng:
        log.warning("%s: no RNG state for rank %d (saved with world size %d)",
                    path, _rank(), meta["world_size"])
    return int(meta["step"]), msgspec.json.decode((path / EXTRA).read_bytes())


# ---- HF export -------------------------------------------------------------------------------

_WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|\.safetensors\.index\.json)$")


def export_hf(
    model: nn.Module, out_dir: str | os.PathLike[str], source_dir: str | os.PathLike[str],
    state: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """``save_pretrained`` of the full (unsharded) weights on rank 0, plus the tokenizer and
    other non-weight files of ``source_dir``; written to a temp dir and renamed into place.
    Every rank must call this (the state dict gather is collective); rank 0 returns the dir.
    ``state``: the full HF-named weights to write instead (a LoRA model's, merged), gathered
    by the caller."""
    if state is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    out = Path(out_dir)
    if _rank() != 0:
        _barrier()
        return None
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in Path(source_dir).iterdir():
        if src.is_file() and not _WEIGHT_FILES.search(src.name) and src.name != "config.json":
            shutil.copy2(src, tmp / src.name)
    model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    _barrier()
    return out
