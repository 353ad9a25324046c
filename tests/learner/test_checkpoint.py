"""Atomic DCP checkpoints: resume reproduces the next step, pruning, a kill mid-save, HF export."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.learner import checkpoint as ckpt
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, make_batch, make_config, with_advantages


def make_worker(model_dir: Path, out: Path) -> LearnerWorker:
    cfg = make_config(model_dir, out, **{"trainer.max_to_keep": 2, "actor.ppo_epochs": 2,
                                         "actor.ppo_mini_batch_size": 2})
    return LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())


def step(worker: LearnerWorker, seed: int) -> dict[str, float]:
    return worker.update(with_advantages(worker.prepare(make_batch(seed=seed)), worker.cfg))


def test_resume_reproduces_the_next_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    step(worker, seed=1)
    path = worker.save_checkpoint(1, {"cursor": 16, "trained_group_ids": ["g1", "g2"]})
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    expected = step(worker, seed=2)
    after = {k: v.clone() for k, v in worker.named_full_parameters()}

    fresh = make_worker(tiny_model_dir, tmp_path)
    assert ckpt.find_latest(tmp_path) == Path(path)
    extra = fresh.load_checkpoint(path)
    assert extra == {"cursor": 16, "trained_group_ids": ["g1", "g2"]} and fresh.version == 1
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    got = step(fresh, seed=2)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/lr"):
        assert got[key] == expected[key], key
    assert all(torch.equal(v, after[k]) for k, v in fresh.named_full_parameters())


def test_latest_pointer_and_pruning(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    assert ckpt.find_latest(tmp_path) is None
    for s in (1, 2, 3):
        worker.save_checkpoint(s, {"s": s})
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_2", "global_step_3"]
    assert (tmp_path / "latest").read_text().strip() == "global_step_3"
    worker.save_checkpoint(3, {"s": 33})  # re-saving a step replaces it atomically
    assert worker.load_checkpoint(str(ckpt.find_latest(tmp_path))) == {"s": 33}
    (tmp_path / "latest").write_text("global_step_9\n")  # dangling pointer: newest complete
    (tmp_path / ".tmp-global_step_4").mkdir()  # a killed save's leftovers are ignored
    assert ckpt.find_latest(tmp_path) == tmp_path / "global_step_3"
    with pytest.raises(TypeError):
        worker.save_checkpoint(4, {"bad": object()})  # never pickled: fails before writing
    assert ckpt.find_latest(tmp_path) == tmp_path / "global_step_3"


SAVER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from streamrl.learner import checkpoint as ckpt
    root = sys.argv[1]
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()  # optimizer state exists, so a save writes ~25 MB
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        ckpt.save_checkpoint(root, step, {"m": ckpt.TrainState(model, opt, sched)},
                             {"step": step}, max_to_keep=2)
        if step == 1:
            print("saved", flush=True)
""")


def test_kill_during_save_leaves_latest_loadable(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root)], stdout=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"saved"
        # Kill once a later save is under way (its temp dir exists), i.e. mid-save.
        deadline = time.monotonic() + 60
        while not list(root.glob(".tmp-global_step_*")) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    latest = ckpt.find_latest(root)
    assert latest is not None
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    saved_step, extra = ckpt.load_checkpoint(latest, {"m": ckpt.TrainState(model, opt, sched)},
                                             restore_rng=False)
    assert extra == {"step": saved_step} and latest.name == f"global_step_{saved_step}"
    assert all(bool((p == saved_step).all()) for p in model.parameters())
    assert opt.state  # optimizer state restored too


@pytest.mark.vllm
def test_hf_export_loads_in_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(tiny_model_dir, tmp_path)
    step(worker, seed=3)
    out = worker.export_hf(str(tmp_path / "hf"))
    assert out is not None and (Path(out) / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM

    reloaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, tensor in worker.named_full_parameters():
        assert torch.equal(reloaded[name], tensor), name
    script = textwrap.dedent(f"""
        from vllm import LLM, SamplingParams
        llm = LLM({out!r}, enforce_eager=True, max_model_len=256, dtype="float32")
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
        print("TOKENS", list(out[0].outputs[0].token_ids))
    """)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    assert len(json.loads(line.split(" ", 1)[1])) == 4
