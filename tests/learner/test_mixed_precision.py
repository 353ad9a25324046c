"""``learner.mixed_precision=bf16``: FSDP2 computes in bf16 on CPU (gloo) while the parameters
the optimizer steps, its state and the log-probs stay fp32; one update lands near fp32's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from streamrl.config import ConfigError
from streamrl.learner.fsdp import mixed_precision
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config, with_advantages

OVERRIDES = {"actor.ppo_max_token_len": 40, "actor.entropy_coeff": 0.01}


def update_once(model_dir: Path, out: Path, precision: str) -> dict[str, Any]:
    cfg = make_config(model_dir, out, **{**OVERRIDES, "learner.mixed_precision": precision})
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    model = worker.actor.model
    seen: set[torch.dtype] = set()  # what the decoder layers and the MLPs compute in

    def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        seen.add(hidden.dtype)

    hooks = [model.model.layers[0].register_forward_hook(record),
             model.model.layers[-1].mlp.register_forward_hook(record)]
    grads: set[torch.dtype] = set()  # what the optimizer steps with
    worker.actor.optimizer.register_step_pre_hook(lambda *_: grads.update(
        p.grad.dtype for p in model.parameters() if p.grad is not None))
    batch = with_advantages(worker.prepare(make_batch()), cfg)
    log_probs = worker.actor.compute_log_prob(batch)
    start = {k: v.clone() for k, v in worker.named_full_parameters()}
    metrics = worker.update(batch)
    for hook in hooks:
        hook.remove()
    state = worker.actor.optimizer.state
    return {
        "seen": seen,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": grads,
        "state_dtypes": {v.dtype for slots in state.values() for v in slots.values()
                         if isinstance(v, torch.Tensor) and v.numel() > 1},
        "log_probs": log_probs,
        "metrics": metrics,
        "step": {k: v - start[k] for k, v in worker.named_full_parameters()},
        "published": {v.dtype for _, v in worker.named_full_parameters(torch.bfloat16)},
    }


def test_bf16_computes_in_bf16_and_keeps_fp32_masters(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    bf16 = update_once(tiny_model_dir, tmp_path / "bf16", "bf16")
    fp32 = update_once(tiny_model_dir, tmp_path / "fp32", "fp32")
    assert bf16["seen"] == {torch.bfloat16} and fp32["seen"] == {torch.float32}
    for run in (bf16, fp32):
        assert run["param_dtypes"] == {torch.float32}  # masters, after the step
        assert run["grad_dtypes"] == {torch.float32}  # reduced in fp32
        assert run["state_dtypes"] == {torch.float32}  # AdamW moments
        assert run["log_probs"].dtype == torch.float32
        assert run["published"] == {torch.bfloat16}
    # bf16 noise, not a different computation: log-probs of the random tiny model (~ -5.8)
    # agree to ~1e-3 (measured 7e-4 mean, 2.4e-3 max), the update's metrics to ~1e-3.
    mask = make_batch().tensors["response_mask"].bool()
    gap = (bf16["log_probs"] - fp32["log_probs"])[mask].abs()
    assert float(gap.mean()) < 5e-3 and float(gap.max()) < 2e-2
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert bf16["metrics"][key] == pytest.approx(fp32["metrics"][key], rel=1e-2, abs=1e-3), key
    # The two optimizer steps point the same way (AdamW's first step is ~lr * sign(grad);
    # measured cosine 0.995).
    step_bf16 = torch.cat([v.flatten() for v in bf16["step"].values()])
    step_fp32 = torch.cat([v.flatten() for v in fp32["step"].values()])
    assert float(torch.nn.functional.cosine_similarity(step_bf16, step_fp32, dim=0)) > 0.95


def test_mixed_precision_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not mixed_precision("auto", cpu) and mixed_precision("auto", cuda)
    assert mixed_precision("bf16", cpu) and not mixed_precision("fp32", cuda)
    with pytest.raises(ValueError, match=r"learner\.mixed_precision"):
        mixed_precision("fp16", cpu)
    with pytest.raises(ConfigError, match=r"learner\.mixed_precision"):
        make_config("tiny", "out", **{"learner.mixed_precision": "bfloat16"})
