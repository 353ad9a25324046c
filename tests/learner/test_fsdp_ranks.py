"""Two FSDP2 ranks on gloo train like one rank; a 2-rank checkpoint loads into 1 rank;
gradient checkpointing changes no number, on one rank or two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config, run_ranks, with_advantages

OVERRIDES = {
    "actor.ppo_mini_batch_size": 2,  # two mini-batches of 2 groups, 4 rows per rank each
    "actor.ppo_epochs": 2,
    "actor.ppo_max_token_len": 40,  # several packed micro-batches, counts differ by rank
    "actor.use_kl_loss": True,
    "algorithm.adv_estimator": "gae",  # critic on
    "actor.grad_clip": 0.0,
}


def train_once(rank: int, world: int, port: int, model_dir: str, out: str) -> dict[str, Any]:
    cfg = make_config(model_dir, out, **{**OVERRIDES, "learner.world_size": world})
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    prepared = with_advantages(worker.prepare(make_batch()), cfg)
    metrics = worker.update(prepared)
    params = {k: v.clone() for k, v in worker.named_full_parameters()}
    worker.save_checkpoint(1, {"from_world": world})
    if world > 1:
        worker.shutdown()
    return {"prepared": {k: prepared[k] for k in ("old_log_probs", "ref_log_prob", "values")},
            "metrics": metrics, "params": params}


def test_two_ranks_match_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    two = run_ranks(2, train_once, str(tiny_model_dir), str(tmp_path / "two"), tmp=tmp_path)
    one = train_once(0, 1, free_port(), str(tiny_model_dir), str(tmp_path / "one"))
    assert two[1]["params"] == {}  # only rank 0 yields full parameters
    for key, value in one["prepared"].items():
        torch.testing.assert_close(two[0]["prepared"][key], value, atol=2e-5, rtol=0)
        assert torch.equal(two[0]["prepared"][key], two[1]["prepared"][key])  # all ranks whole
    m1, m2 = one["metrics"], two[0]["metrics"]
    assert m2 == two[1]["metrics"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy",
                "critic/vf_loss", "critic/grad_norm", "actor/ppo_kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-6), key
    initial = LearnerWorker(make_config(tiny_model_dir, tmp_path / "x", **OVERRIDES), 0, 1,
                            "127.0.0.1", free_port())
    start = dict(initial.named_full_parameters())
    moved = max(float((one["params"][k] - start[k]).abs().max()) for k in start)
    diff = max(float((one["params"][k] - two[0]["params"][k]).abs().max()) for k in start)
    assert diff < 2e-2 * moved  # AdamW ~ lr * sign(g) amplifies fp noise where |g| ~ eps
    # DCP reshards: the 2-rank checkpoint loads into a 1-rank learner.
    extra = initial.load_checkpoint(str(tmp_path / "two" / "global_step_1"))
    assert extra == {"from_world": 2} and initial.version == 1
    loaded = dict(initial.named_full_parameters())
    assert all(torch.equal(loaded[k], two[0]["params"][k]) for k in loaded)


CHECKPOINTING = {"actor.ppo_max_token_len": 40, "actor.entropy_coeff": 0.01,
                 "actor.grad_clip": 0.0}


def update_once(rank: int, world: int, port: int, model_dir: str, out: str,
                checkpointing: bool) -> dict[str, Any]:
    cfg = make_config(model_dir, out, **{**CHECKPOINTING, "learner.world_size": world,
                                         "model.gradient_checkpointing": checkpointing})
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    batch = with_advantages(worker.prepare(make_batch()), cfg)
    calls = []  # the first decoder layer's forwards during the update, recomputations included
    worker.actor.model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    metrics = worker.update(batch)
    return {"metrics": metrics, "layer_calls": len(calls),
            "params": dict(worker.named_full_parameters(every_rank=True))}


def update_with_and_without_checkpointing(rank: int, world: int, port: int, model_dir: str,
                                          out: str) -> dict[bool, dict[str, Any]]:
    """One update of the same batch with ``model.gradient_checkpointing`` off, then on."""
    results = {on: update_once(rank, world, port, model_dir, out, on) for on in (False, True)}
    if world > 1:
        dist.destroy_process_group()
    return results


def assert_checkpointing_changes_nothing(results: dict[bool, dict[str, Any]]) -> None:
    off, on = results[False], results[True]
    assert on["layer_calls"] == 2 * off["layer_calls"] > 0  # each layer forward recomputed once
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=1e-7), key
    for name, value in off["params"].items():
        torch.testing.assert_close(on["params"][name], value, atol=1e-6, rtol=0)


def test_gradient_checkpointing_one_and_two_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = update_with_and_without_checkpointing(0, 1, free_port(), str(tiny_model_dir),
                                                str(tmp_path / "one"))
    assert_checkpointing_changes_nothing(one)
    two = run_ranks(2, update_with_and_without_checkpointing, str(tiny_model_dir),
                    str(tmp_path / "two"), tmp=tmp_path)
    for rank in two:
        assert_checkpointing_changes_nothing(rank)
