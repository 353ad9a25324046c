"""Learner step throughput against baselines measured in the same run.

1. ``Actor.update`` (FSDP2 at world size 1, PPO loss, global-count scaling, metrics) vs a bare
   torch loop (plain HF model, forward / backward / AdamW) over the very same packed
   micro-batches. Goal: update time <= 1.15x the bare time.
2. Dynamic batching (token budget + sequence packing) vs padded fixed-size micro-batches on
   ragged lengths, in real tokens/s. Goal: >= 1.5x.
3. A learner step (``prepare`` + ``update``, two epochs as by default) whose proximal
   log-probs come from the update's first forward (what ``prepare`` leaves to it with one
   mini-batch per epoch) vs one that computes them in a pass of their own first, as ``prepare``
   does with several mini-batches. Printed for information (no goal).

Run: ``.venv/bin/python benchmarks/learner.py [--repeats 3]`` (OMP_NUM_THREADS defaults to 1
here so numbers are comparable on a shared machine; set it yourself to use more cores).

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(learner_update_vs_bare_time and learner_dynamic_vs_padded; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, replace, validate
from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.worker import LearnerWorker
from streamrl.net import free_port
from streamrl.testing import build_tiny_model, result_line
from streamrl.types import Group, Trajectory

GROUPS, N = 8, 4
PROMPT, RESPONSE = (8, 48), (8, 200)  # ragged: most rows far shorter than the longest
BUDGET = 1024


def ragged_batch(seed: int = 0, vocab: int = 300) -> Batch:
    rng = random.Random(seed)
    groups = []
    for g in range(GROUPS):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT))]
        trajs = []
        for i in range(N):
            # long-tailed response lengths, as RL rollouts have; one row per group runs to
            # the length cap, so padding is set by the longest row
            r = RESPONSE[1] if i == 0 else min(RESPONSE[1], max(RESPONSE[0],
                                                                int(rng.expovariate(1 / 40))))
            trajs.append(Trajectory(
                uid=f"{g}-{i}", group_id=f"g{g}", prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(r)], loss_mask=[1] * r,
                logprobs=[-5.0] * r, versions=[0] * r, reward=rng.random()))
        groups.append(Group(group_id=f"g{g}", trajectories=trajs))
    return Batch.from_groups(groups, 0)


def config(model_dir: Path, out: Path, dynamic: bool, epochs: int = 1) -> Config:
    return validate(replace(Config(), **{
        "model.path": str(model_dir), "trainer.output_dir": str(out), "learner.device": "cpu",
        "task.train_batch_size": GROUPS, "task.max_prompt_length": PROMPT[1],
        "rollout.max_new_tokens": RESPONSE[1], "rollout.max_model_len": 512, "rollout.n": N,
        "actor.ppo_mini_batch_size": GROUPS, "actor.ppo_micro_batch_size": 2,
        "actor.use_dynamic_bsz": dynamic, "actor.ppo_max_token_len": BUDGET,
        "actor.ppo_epochs": epochs, "actor.optim.lr": 1e-5,
    }))


def with_advantages(batch: Batch) -> Batch:
    data = {**batch.tensors, "token_level_rewards": batch["token_level_scores"],
            "index": batch.non_tensors["index"]}
    adv, ret = algos.compute_advantage(data, "grpo", index_key="index")
    return Batch({**batch.tensors, "advantages": adv, "returns": ret}, batch.non_tensors,
                 batch.meta)


def update_step(worker: LearnerWorker, batch: Batch) -> Callable[[], None]:
    prepared = with_advantages(worker.prepare(batch))
    return lambda: worker.update(prepared)


def bare_step(model_dir: Path, batch: Batch, plan: list[list[int]]) -> Callable[[], None]:
    """Plain HF model, same packed micro-batches: forward, log-probs, backward, AdamW."""
    model = load_causal_lm(model_dir, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    packs = [batch.pack(rows) for rows in plan]

    def one_step() -> None:
        opt.zero_grad()
        for pb in packs:
            keep = pb.predict_mask[0].nonzero().squeeze(-1)
            logits = model(input_ids=pb.input_ids, position_ids=pb.position_ids,
                           use_cache=False, logits_to_keep=keep).logits[0]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, pb.targets[0, keep, None])
            (-logp.mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return one_step


def step_with_separate_proximal(worker: LearnerWorker, batch: Batch) -> Callable[[], None]:
    """prepare + update, the proximal log-probs computed by a pass of their own first."""
    def one_step() -> None:
        prepared = with_advantages(worker.prepare(batch))
        old = worker.actor.compute_log_prob(prepared)
        worker.update(prepared.union(Batch({"old_log_probs": old})))

    return one_step


def learner_step(worker: LearnerWorker, batch: Batch) -> Callable[[], None]:
    """prepare + update as the controller runs them."""
    return lambda: worker.update(with_advantages(worker.prepare(batch)))


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    work = Path(tempfile.mkdtemp(prefix="streamrl-bench-"))
    model_dir = build_tiny_model(work / "model", hidden_size=256, num_layers=4, num_heads=4,
                                 intermediate_size=1024)
    batch = ragged_batch()
    real_tokens = int(batch["attention_mask"].sum())
    padded_tokens = batch["attention_mask"].numel()
    print(f"batch: {len(batch)} rows, {real_tokens} real tokens, {padded_tokens} padded "
          f"({real_tokens / padded_tokens:.0%} real); model hidden 256 x 4 layers; "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)

    dynamic = LearnerWorker(config(model_dir, work / "o", True), 0, 1, "127.0.0.1", free_port())
    padded = LearnerWorker(config(model_dir, work / "p", False), 0, 1, "127.0.0.1", 0)
    two_epochs = LearnerWorker(config(model_dir, work / "e", True, epochs=2), 0, 1,
                               "127.0.0.1", 0)
    plan = [rows for mini in dynamic.plan(batch) for rows in mini]
    steps = {"update": update_step(dynamic, batch), "bare": bare_step(model_dir, batch, plan),
             "padded": update_step(padded, batch), "fused": learner_step(two_epochs, batch),
             "separate": step_with_separate_proximal(two_epochs, batch)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.repeats + 1):  # interleaved so machine load hits them all alike
        for name, fn in steps.items():
            elapsed = timed(fn)
            if i:  # the first round warms up
                times[name].append(elapsed)
    # the minimum is the least disturbed by other processes on a shared machine
    t_update, t_bare, t_padded = (min(times[k]) for k in ("update", "bare", "padded"))
    print(f"[1] actor.update {real_tokens / t_update:8.0f} tok/s ({t_update:.3f} s) | bare "
          f"torch loop {real_tokens / t_bare:8.0f} tok/s ({t_bare:.3f} s) | update/bare "
          f"time = {t_update / t_bare:.3f}x (goal <= 1.15x); {len(plan)} packed micro-batches",
          flush=True)

    print(f"[2] dynamic+packed {real_tokens / t_update:8.0f} tok/s | padded fixed micro "
          f"(2 groups) {real_tokens / t_padded:8.0f} tok/s | speed-up = "
          f"{t_padded / t_update:.2f}x (goal >= 1.5x)", flush=True)
    t_fused, t_separate = min(times["fused"]), min(times["separate"])
    print(f"[3] learner step, 2 epochs: proximal log-probs from the update's first forward "
          f"{t_fused:.3f} s | from a pass of their own {t_separate:.3f} s | "
          f"ratio {t_fused / t_separate:.3f}", flush=True)
    print(result_line("learner_update_vs_bare_time", t_update / t_bare, "<=", 1.15, digits=3))
    print(result_line("learner_dynamic_vs_padded", t_padded / t_update, ">=", 1.5))
    sys.exit(0)


if __name__ == "__main__":
    main()
