"""Loading without needless copies (fsdp.load_sharded): on two gloo ranks only rank 0 reads the
checkpoint, and every rank's actor, reference and critic end as a shard of exactly the model a
plain one-process load gives (weights, non-persistent buffers, the tie, the critic's zero
head)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from streamrl.learner.fsdp import (
    load_causal_lm,
    load_value_model,
)
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import make_config, run_ranks

CPU = torch.device("cpu")
LOADERS = {"actor": load_causal_lm, "critic": load_value_model}


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """Every entry of the state dict, unsharded, plus every buffer (non-persistent included)."""
    out = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
           for k, v in model.state_dict(keep_vars=True).items()}
    out.update({f"buffer:{k}": v.clone() for k, v in model.named_buffers()})
    return out


def is_tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def weights_only_on_rank0(model_dir: Path, tmp: Path) -> Path:
    """A copy of the model directory without its weight files: what rank 1 is pointed at."""
    bare = tmp / "no-weights"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return bare


def worker_on_rank(rank: int, world: int, port: int, model_dirs: list[str],
                   out: str) -> dict[str, Any]:
    overrides = {"learner.world_size": world, "actor.use_kl_loss": True,  # reference model on
                 "algorithm.adv_estimator": "gae"}  # critic on
    cfg = make_config(model_dirs[rank], out, **overrides)
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    assert worker.ref is not None and worker.critic is not None
    models = {"actor": worker.actor.model, "ref": worker.ref.model, "critic": worker.critic.model}
    result: dict[str, Any] = {role: full_state(model) for role, model in models.items()}
    result["local_rows"] = {role: model.get_input_embeddings().weight.to_local().shape[0]
                            for role, model in models.items()}
    result["tied"] = is_tied(worker.actor.model)
    worker.shutdown()
    return result


def test_only_rank0_reads_the_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 1's model directory has no weights at all: reading them there would fail."""
    bare = weights_only_on_rank0(tiny_model_dir, tmp_path)
    assert not list(bare.glob("*.safetensors")) and (bare / "config.json").is_file()
    ranks = run_ranks(2, worker_on_rank, [str(tiny_model_dir), str(bare)], str(tmp_path / "o"),
                      tmp=tmp_path)
    expected = {"actor": full_state(load_causal_lm(tiny_model_dir, CPU)),
                "critic": full_state(load_value_model(tiny_model_dir, CPU))}
    expected["ref"] = expected["actor"]
    vocab = expected["actor"]["model.embed_tokens.weight"].shape[0]
    for rank in ranks:
        for role, state in expected.items():
            assert rank[role].keys() == state.keys(), role
            assert [k for k in state if not torch.equal(rank[role][k], state[k])] == [], role
            assert rank["local_rows"][role] < vocab  # each rank holds a shard, not the whole
        assert rank["tied"]
    assert any("inv_freq" in k for k in expected["actor"])  # the rotary buffers were compared
    assert not ranks[0]["critic"]["score.weight"].any()  # the value head starts at 0
