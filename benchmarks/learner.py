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

``--model smollm2`` measures the learner at real size instead: SmolLM2-135M-Instruct (the
``model=smollm2-135m`` preset's checkpoint, ``streamrl data smollm2``) under that preset with
``--precision fp32|bf16`` and ``--gradient-checkpointing``, on ``--micro-batches`` packed
micro-batches of ``actor.ppo_max_token_len=4096`` tokens of random ids (rows of 64 prompt + 192
response tokens), one optimizer step per update. Printed: tokens/s; MFU = 6·N·tokens/s over the
FLOP/s of a 2048² matmul on the same threads measured in the same run, bf16 or fp32, whichever
is faster (bf16 is emulated, ~100x slower, on cores without AMX / AVX512-BF16); the process's
peak RSS over the timed updates (high-water mark reset after the warm-up, so AdamW's state is
in it) against the fp32 params + grads + AdamW states (16 bytes per parameter); and the update
against a bare torch loop (plain HF model, same micro-batches, same precision and
checkpointing, full-logits log-softmax) on the same batch. The learner sets the process's
allocator up (``learner/memory.py``, process-wide: the bare loop runs under it too); the timed
update's page faults and system time, the allocator's cost, are printed. Goals (issue 40): peak
RSS <= 1.5x the states, MFU >= 0.5, update <= 1.05x bare. One process per configuration, e.g.

    OMP_NUM_THREADS=2 flock -x /tmp/heavy.lock .venv/bin/python benchmarks/learner.py \
        --model smollm2 --precision bf16 --gradient-checkpointing

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(learner_update_vs_bare_time and learner_dynamic_vs_padded; with ``--model smollm2``:
learner_smollm2_<precision>[_gc]_{rss_vs_states,mfu,update_vs_bare_time};
``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from streamrl import algos
from streamrl.batch import Batch
from streamrl.config import Config, load_config, replace, validate
from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.worker import LearnerWorker
from streamrl.net import free_port
from streamrl.testing import ResidentMemory, build_tiny_model, result_line
from streamrl.types import Group, Trajectory

GROUPS, N = 8, 4
PROMPT, RESPONSE = (8, 48), (8, 200)  # ragged: most rows far shorter than the longest
BUDGET = 1024


# --model smollm2: rows of 64 + 192 tokens, 16 to a 4096-token micro-batch
REAL_PROMPT, REAL_RESPONSE, REAL_BUDGET = 64, 192, 4096


def ragged_batch(seed: int = 0, vocab: int = 300, groups_n: int = GROUPS,
                 prompt_len: tuple[int, int] = PROMPT,
                 response_len: Callable[[random.Random, int], int] | None = None) -> Batch:
    rng = random.Random(seed)
    groups = []
    for g in range(groups_n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        trajs = []
        for i in range(N):
            r = (response_len or long_tailed)(rng, i)
            trajs.append(Trajectory(
                uid=f"{g}-{i}", group_id=f"g{g}", prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(r)], loss_mask=[1] * r,
                logprobs=[-5.0] * r, versions=[0] * r, reward=rng.random()))
        groups.append(Group(group_id=f"g{g}", trajectories=trajs))
    return Batch.from_groups(groups, 0)


def long_tailed(rng: random.Random, i: int) -> int:
    """Long-tailed response lengths, as RL rollouts have; one row per group runs to the length
    cap, so padding is set by the longest row."""
    if i == 0:
        return RESPONSE[1]
    return min(RESPONSE[1], max(RESPONSE[0], int(rng.expovariate(1 / 40))))


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


def bare_step(model_dir: Path, batch: Batch, plan: list[list[int]], bf16: bool = False,
              checkpointing: bool = False) -> Callable[[], None]:
    """Plain HF model, same packed micro-batches: forward, log-probs, backward, AdamW; with
    ``bf16``, forward and backward under CPU autocast (fp32 weights, grads and AdamW)."""
    model = load_causal_lm(model_dir, torch.device("cpu"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    packs = [batch.pack(rows) for rows in plan]
    precision = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                 else contextlib.nullcontext())

    def one_step() -> None:
        opt.zero_grad()
        for pb in packs:
            keep = pb.predict_mask[0].nonzero().squeeze(-1)
            with precision:
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


def matmul_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 10,
                 budget_s: float = 3.0) -> float:
    """FLOP/s of a ``size``² matmul in ``dtype`` on this process's threads (best of up to
    ``repeats``, fewer past ``budget_s``: an emulated bf16 matmul takes ~10 s)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    times = [timed(lambda: a @ b)]  # warm-up, kept only where it is the one timing
    while len(times) <= repeats and sum(times) < budget_s:
        times.append(timed(lambda: a @ b))
    return 2 * size**3 / min(times[1:] or times)


def real_model(args: argparse.Namespace) -> None:
    """The learner at real size: SmolLM2-135M, tokens/s, MFU, peak RSS, update vs bare."""
    from streamrl.models import resolve_model_path

    threads = int(os.environ["OMP_NUM_THREADS"])
    gc = args.gradient_checkpointing
    label = f"smollm2_{args.precision}{'_gc' if gc else ''}"
    work = Path(tempfile.mkdtemp(prefix="streamrl-bench-"))
    rows_per_micro = REAL_BUDGET // (REAL_PROMPT + REAL_RESPONSE)
    groups = args.micro_batches * rows_per_micro // N
    cfg = load_config([
        "model=smollm2-135m", f"learner.mixed_precision={args.precision}",
        f"model.gradient_checkpointing={gc}", f"trainer.output_dir={work / 'o'}",
        f"task.train_batch_size={groups}", f"rollout.n={N}",
        f"task.max_prompt_length={REAL_PROMPT}", f"rollout.max_new_tokens={REAL_RESPONSE}",
        f"actor.ppo_max_token_len={REAL_BUDGET}", "actor.ppo_epochs=1", "learner.device=cpu"])
    model_dir = Path(resolve_model_path(cfg.model.path))
    # the faster of the two: bf16 on AMX / AVX512-BF16 cores, fp32 where bf16 is emulated
    peak = {dtype: matmul_flops(dtype) for dtype in (torch.bfloat16, torch.float32)}
    best = max(peak, key=peak.__getitem__)
    flops = peak[best]
    batch = ragged_batch(vocab=49152, groups_n=groups, prompt_len=(REAL_PROMPT, REAL_PROMPT),
                         response_len=lambda rng, i: REAL_RESPONSE)
    tokens = int(batch["attention_mask"].sum())
    base_gb = ResidentMemory().base_mib / 1024

    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    params = sum(p.numel() for p in worker.actor.model.parameters())
    states_gb = 16 * params / 2**30  # fp32 params + grads + AdamW's two moments
    update = update_step(worker, batch)
    plan = [rows for mini in worker.plan(batch) for rows in mini]
    update()  # warm-up: allocates AdamW's state
    rss, usage = ResidentMemory(), resource.getrusage(resource.RUSAGE_SELF)
    times: dict[str, list[float]] = {"update": [timed(update)], "bare": []}
    peak_gb = rss.peak_mib() / 1024
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults, sys_s = after.ru_minflt - usage.ru_minflt, after.ru_stime - usage.ru_stime
    bare = bare_step(model_dir, batch, plan, bf16=args.precision == "bf16", checkpointing=gc)
    bare()  # warm-up
    for i in range(args.repeats):  # interleaved so machine load hits both alike
        times["bare"].append(timed(bare))
        if i + 1 < args.repeats:
            times["update"].append(timed(update))
    t_update, t_bare = min(times["update"]), min(times["bare"])
    tok_s = tokens / t_update
    mfu = 6 * params * tok_s / flops
    print(f"SmolLM2-135M ({params / 1e6:.1f}M params), learner {args.precision}"
          f"{', gradient checkpointing' if gc else ''}, {threads} threads; {len(batch)} rows, "
          f"{tokens} tokens in {len(plan)} micro-batches of <= {REAL_BUDGET}", flush=True)
    print(f"[1] update {tok_s:7.0f} tok/s ({t_update:.2f} s, min of {len(times['update'])}) | "
          f"bare torch loop {tokens / t_bare:7.0f} tok/s ({t_bare:.2f} s) | update/bare time = "
          f"{t_update / t_bare:.3f}x (goal <= 1.05x)", flush=True)
    print(f"[2] matmul 2048² on {threads} threads: bf16 {peak[torch.bfloat16] / 1e9:.1f}, fp32 "
          f"{peak[torch.float32] / 1e9:.1f} GFLOP/s | 6·N·tok/s "
          f"{6 * params * tok_s / 1e9:.0f} GFLOP/s | MFU {mfu:.2f} of the "
          f"{str(best).removeprefix('torch.')} matmul (goal >= 0.5)", flush=True)
    print(f"[3] peak RSS over the timed update {peak_gb:.2f} GB (process before the model "
          f"{base_gb:.2f} GB) | params + grads + AdamW (fp32) {states_gb:.2f} GB | ratio "
          f"{peak_gb / states_gb:.2f}x (goal <= 1.5x; {(peak_gb - base_gb) / states_gb:.2f}x "
          f"without the process's own)", flush=True)
    print(f"[4] timed update: {faults / 1e6:.2f} M page faults, {sys_s:.1f} s system time "
          f"(the allocator's cost)", flush=True)
    print(result_line(f"learner_{label}_rss_vs_states", peak_gb / states_gb, "<=", 1.5))
    print(result_line(f"learner_{label}_mfu", mfu, ">=", 0.5))
    print(result_line(f"learner_{label}_update_vs_bare_time", t_update / t_bare, "<=", 1.05,
                      digits=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                        help="--model smollm2: learner.mixed_precision")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="--model smollm2: model.gradient_checkpointing")
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="--model smollm2: 4096-token micro-batches per update")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.model == "smollm2":
        real_model(args)
        sys.exit(0)
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
