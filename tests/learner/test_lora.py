"""LoRA on the actor (``actor.lora.rank > 0``) with real peft and real FSDP2 on gloo: only the
adapter trains and has optimizer state, the reference policy is the adapter-disabled model,
the published weights are the adapter alone under PEFT's names (``actor.lora.publish=adapter``,
the default with vLLM) or the merged model (``merged``), checkpoints hold the adapter and
resume, and two ranks match one."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from streamrl.config import ConfigError, load_config
from streamrl.learner.actor import log_probs_over_plan
from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.lora import adapter_parameters, with_lora
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config, run_ranks, with_advantages

CPU = torch.device("cpu")
LORA = {"actor.lora.rank": 8, "actor.optim.lr": 3e-2}
SAMPLING = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


def lora_worker(model_dir: Path | str, out: Path | str, rank: int = 0, world: int = 1,
                port: int | None = None, **overrides: Any) -> LearnerWorker:
    cfg = make_config(model_dir, out, **{**LORA, "learner.world_size": world, **overrides})
    return LearnerWorker(cfg, rank, world, "127.0.0.1", port or free_port())


def train(worker: LearnerWorker, steps: int, first_seed: int = 0) -> list[dict[str, float]]:
    out = []
    for seed in range(first_seed, first_seed + steps):
        batch = worker.prepare(make_batch(seed=seed))
        out.append(worker.update(with_advantages(batch, worker.cfg)))
    return out


def log_probs(model: torch.nn.Module, worker: LearnerWorker, seed: int) -> torch.Tensor:
    batch = make_batch(seed=seed)
    return log_probs_over_plan(model, batch, worker.plan(batch), packed=True, device=CPU,
                               sampling=SAMPLING)[0]


@pytest.mark.parametrize(("override", "message"), [
    ("actor.lora.rank=-1", "actor.lora.rank=-1: must be >= 0"),
    ("actor.lora.alpha=0", "actor.lora.alpha=0.0: must be > 0"),
    ("actor.lora.dropout=1.0", "actor.lora.dropout=1.0: must be in [0, 1)"),
    ("actor.lora.target_modules=[]", "actor.lora.target_modules=(): must name at least one"),
    ("actor.lora.publish=both",
     "actor.lora.publish='both': must be one of auto | adapter | merged"),
    ("actor.lora.publish=adapter rollout.backend=hf",
     "actor.lora.publish='adapter': needs rollout.backend=vllm"),
])
def test_bad_lora_settings_are_one_line_config_errors(override: str, message: str) -> None:
    assert load_config([]).actor.lora.rank == 0  # off by default
    rank = [] if override.startswith("actor.lora.rank") else ["actor.lora.rank=8"]
    with pytest.raises(ConfigError) as info:
        load_config([*rank, *override.split()])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_only_the_adapter_trains_and_has_optimizer_state(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    worker = lora_worker(tiny_model_dir, tmp_path)
    named = dict(worker.actor.model.named_parameters())
    adapter = {n for n, p in named.items() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    optimized = [p for group in worker.actor.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(named[n]) for n in adapter}
    share = sum(named[n].numel() for n in adapter) / sum(p.numel() for p in named.values())
    assert share < 0.2, share
    before = {n: p.detach().clone() for n, p in named.items()}
    metrics = train(worker, 3)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    frozen = [n for n in named if n not in adapter]
    assert all(torch.equal(named[n], before[n]) for n in frozen)  # bit-identical base
    moved = [n for n in adapter if not torch.equal(named[n], before[n])]
    assert any(".lora_B." in n for n in moved)  # B starts at 0: the adapter now adds something
    # Adam's moments exist for the adapter only.
    assert {id(p) for p in worker.actor.optimizer.state} == {id(named[n]) for n in adapter}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_repeated_updates_on_one_batch_raise_its_objective(
    tiny_model_dir: Path, tmp_path: Path, checkpointing: bool
) -> None:
    """The adapter learns: each update on the same batch raises the advantage-weighted mean
    log-prob (the policy-gradient objective). An adapter without gradients (e.g. reentrant
    checkpointing with frozen inputs) or without optimizer state would leave it flat.
    Measured at lr 3e-3: -0.097 -> 0.062 after 5 steps, rising at every step; at lr 3e-2 it
    oscillated (-0.10, 0.05, 0.06, -0.03, ...): the adapter's step is too large there."""
    worker = lora_worker(tiny_model_dir, tmp_path, **{
        "actor.optim.lr": 3e-3, "model.gradient_checkpointing": checkpointing})
    batch = with_advantages(worker.prepare(make_batch(seed=0)), worker.cfg)
    weight = batch["advantages"] * batch["response_mask"]

    def objective() -> float:
        log_prob = worker.actor.compute_log_prob(batch)
        assert isinstance(log_prob, torch.Tensor)
        return float((weight * log_prob).sum() / batch["response_mask"].sum())

    seen = [objective()]
    for _ in range(5):
        worker.actor.update(batch)
        seen.append(objective())
    assert all(b > a for a, b in itertools.pairwise(seen)), seen
    assert seen[-1] > seen[0] + 0.1, seen


def test_the_reference_is_the_adapter_disabled_model(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    worker = lora_worker(tiny_model_dir, tmp_path, **{"actor.use_kl_loss": True})
    assert worker.ref is not None and worker.ref.model is worker.actor.model  # no second copy
    batch = worker.prepare(make_batch())
    # Step 0: B = 0, so the adapter adds exactly nothing and the KL is 0.
    assert torch.equal(batch["ref_log_prob"], worker.actor.compute_log_prob(batch))
    first = worker.update(with_advantages(batch, worker.cfg))
    assert first["actor/kl_loss"] == 0.0
    later = train(worker, 2, first_seed=1)
    assert later[-1]["actor/kl_loss"] > 0
    # After training, the reference is still the pretrained model, the actor is not.
    base = load_causal_lm(tiny_model_dir, CPU)
    ref = worker.prepare(make_batch(seed=7))["ref_log_prob"]
    torch.testing.assert_close(ref, log_probs(base, worker, seed=7), atol=1e-5, rtol=0)
    assert (log_probs(worker.actor.model, worker, seed=7) - ref).abs().max() > 1e-2


@pytest.mark.parametrize(("overrides", "adapter"), [
    ([], True),  # rollout.backend=vllm over the collective bus
    (["actor.lora.publish=merged"], False),
    (["rollout.backend=hf"], False),  # an engine that loads full weights only
    (["runtime.placement=colocated", "weight_bus.backend=colocated"], False),
])
def test_publish_auto_sends_the_adapter_where_replicas_serve_adapters(
    overrides: list[str], adapter: bool
) -> None:
    lora = load_config(["actor.lora.rank=8", *overrides])
    assert lora.actor.lora.publishes_adapter(lora.rollout.backend,
                                             lora.weight_bus.backend) is adapter


def test_published_adapter_is_what_peft_saves(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    worker = lora_worker(tiny_model_dir, tmp_path)  # publish=auto with vLLM: the adapter alone
    train(worker, 2)
    published = dict(worker.named_full_parameters())
    saved = get_peft_model_state_dict(worker.actor.model)  # adapter_model.safetensors's names
    assert set(published) == set(saved)
    assert sum(t.numel() for t in published.values()) == sum(
        p.numel() for _, p in adapter_parameters(worker.actor.model))
    # Loaded into a fresh adapter over the base weights, it is the learner's policy.
    fresh = with_lora(load_causal_lm, worker.cfg.actor.lora)(tiny_model_dir, CPU)
    set_peft_model_state_dict(fresh, published)
    actor = log_probs(worker.actor.model, worker, seed=5)
    assert (log_probs(fresh, worker, seed=5) - actor).abs().max() <= 1e-5
    assert (actor - log_probs(load_causal_lm(tiny_model_dir, CPU), worker, 5)).abs().max() > 1e-2
    cast = dict(worker.named_full_parameters(torch.bfloat16))
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}


def test_published_weights_are_the_merged_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = lora_worker(tiny_model_dir, tmp_path, **{"actor.lora.publish": "merged"})
    train(worker, 2)
    published = dict(worker.named_full_parameters())
    hf = load_causal_lm(tiny_model_dir, CPU)
    # Exactly the HF checkpoint's names (a tied lm_head travels as the embedding), no adapter.
    assert set(published) == {n for n, _ in hf.named_parameters()}
    unchanged = [n for n in published if "norm" in n or "embed" in n or n.endswith(".bias")]
    hf_params = dict(hf.named_parameters())
    assert all(torch.equal(published[n], hf_params[n]) for n in unchanged)
    hf.load_state_dict(published, strict=False)
    merged, actor = log_probs(hf, worker, seed=5), log_probs(worker.actor.model, worker, seed=5)
    assert (merged - actor).abs().max() <= 1e-5
    assert (merged - log_probs(load_causal_lm(tiny_model_dir, CPU), worker, 5)).abs().max() > 1e-2
    cast = dict(worker.named_full_parameters(torch.bfloat16))
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}


def test_checkpoint_holds_the_adapter_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = lora_worker(tiny_model_dir, tmp_path)
    train(worker, 2)
    path = worker.save_checkpoint(2)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("actor.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    # Another seed: another random A, which the checkpoint must overwrite.
    fresh = lora_worker(tiny_model_dir, tmp_path / "fresh", **{"learner.seed": 1})
    fresh.load_checkpoint(str(path))
    assert fresh.version == 2
    pairs = list(zip(worker.actor.model.parameters(), fresh.actor.model.parameters()))
    assert all(torch.equal(a, b) for a, b in pairs)
    # Optimizer and scheduler came back too: the next step is the same on both.
    train(worker, 1, first_seed=2)
    train(fresh, 1, first_seed=2)
    assert all(torch.equal(a, b) for a, b in pairs)


def _two_steps(rank: int, world: int, port: int, model_dir: str, out: str, publish: str
               ) -> dict[str, Any]:
    worker = lora_worker(model_dir, out, rank, world, port, **{"actor.lora.publish": publish})
    train(worker, 2)
    published = {n: t.clone() for n, t in worker.named_full_parameters()}
    if world > 1:
        worker.shutdown()
    return published


@pytest.mark.parametrize("publish", ["adapter", "merged"])
def test_two_ranks_match_one(tiny_model_dir: Path, tmp_path: Path, publish: str) -> None:
    two = run_ranks(2, _two_steps, str(tiny_model_dir), str(tmp_path / "two"), publish,
                    tmp=tmp_path)
    one = _two_steps(0, 1, free_port(), str(tiny_model_dir), str(tmp_path / "one"), publish)
    assert two[1] == {} and set(two[0]) == set(one)
    # Adam divides by sqrt(v): A's tiny gradients (B was 0 at the first step) turn the ranks'
    # other reduction order into ~1e-5 differences in A itself; merged, B @ A damps them.
    atol = 1e-4 if publish == "adapter" else 1e-5
    for name, tensor in one.items():
        torch.testing.assert_close(two[0][name], tensor, atol=atol, rtol=0, msg=name)


def test_export_merge_writes_the_base_model_with_the_adapter_merged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from streamrl.cli import main

    worker = lora_worker(tiny_model_dir, tmp_path / "run")
    train(worker, 2)
    worker.save_checkpoint(2)
    run = [f"model.path={tiny_model_dir}", "actor.lora.rank=8"]
    out = tmp_path / "merged"
    export = ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]
    assert main([*export, *run]) == 2  # a LoRA checkpoint without --merge: a config error
    assert main([*export, "--merge", *run]) == 0
    merged = load_causal_lm(out, CPU)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    expected = log_probs(worker.actor.model, worker, seed=3)  # base + adapter, unmerged
    assert (log_probs(merged, worker, seed=3) - expected).abs().max() <= 1e-5
    assert (expected - log_probs(load_causal_lm(tiny_model_dir, CPU), worker, 3)).abs().max() > 1e-2
