"""LoRA on the actor (``actor.lora.rank``) against full fine-tuning, per publish and in memory.

On SmolLM2-135M-Instruct (``model=smollm2-135m``; ``--model tiny`` for a quick check), one
learner at world size 1 per variant, each after one real update, publishes over the real
collective weight bus (gloo, a ``CollectiveReceiver`` in this process whose sink just counts):
- full fine-tuning: every parameter, as they are;
- LoRA: every base parameter with the adapter merged in (what replicas load today);
and, for information, the bytes an adapter-only publish would send (the adapter's tensors).
Printed: bytes and seconds per publish (median of ``--repeats``), trainable parameters and the
AdamW state held (2 fp32 moments per trainable parameter).

Goals: the merge costs the publish <= 1.3x the full publish's time; the adapter is <= 5 % of the
model's bytes (what an adapter-only publish would gain); AdamW state <= 5 % of full's.

Run: ``flock -x /tmp/heavy.lock .venv/bin/python benchmarks/lora.py [--model tiny] [--rank 16]``.
Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(lora_merged_publish_vs_full_time, lora_adapter_vs_full_bytes, lora_optimizer_state_vs_full;
``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from streamrl.batch import Batch
from streamrl.config import load_config
from streamrl.learner.lora import adapter_parameters
from streamrl.learner.worker import LearnerWorker
from streamrl.net import free_port
from streamrl.testing import random_groups, result_line
from streamrl.weight_bus.collective import CollectivePublisher, CollectiveReceiver

TIMEOUT_S = 120.0
PRESETS = {"smollm2": "model=smollm2-135m", "tiny": "model=tiny"}


def make_worker(args: argparse.Namespace, out: Path, rank: int) -> LearnerWorker:
    cfg = load_config([PRESETS[args.model], "learner.device=cpu", f"trainer.output_dir={out}",
                       f"actor.lora.rank={rank}", "task.train_batch_size=2", "rollout.n=2",
                       "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1",
                       "rollout.max_new_tokens=16", "task.max_prompt_length=16"])
    return LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())


def one_update(worker: LearnerWorker, vocab: int) -> None:
    """A real optimizer step, so LoRA's B is no longer 0 and the merge does real work."""
    from streamrl import algos

    groups = random_groups(2, 2, vocab=vocab, seed=0)
    batch = worker.prepare(Batch.from_groups(groups, 0))
    adv, _ = algos.compute_advantage(
        {**batch.tensors, "token_level_rewards": batch["token_level_scores"],
         "index": batch.non_tensors["index"]}, "grpo", index_key="index")
    worker.update(Batch({**batch.tensors, "advantages": adv}, dict(batch.non_tensors),
                        dict(batch.meta)))


def publish_seconds(worker: LearnerWorker, dtype: torch.dtype, repeats: int) -> tuple[float, int]:
    """Median seconds of gather (+ merge) + broadcast + ack, and bytes per publish."""
    got = threading.Event()

    def sink(weights: Any, version: int) -> None:
        for _ in weights:
            pass
        got.set()

    times, nbytes = [], 0
    with CollectivePublisher(bucket_mb=64, timeout_s=TIMEOUT_S) as pub, CollectiveReceiver(
            pub.endpoint, sink, receiver_id="bench", timeout_s=TIMEOUT_S):
        pub.wait_for_receivers(1)
        for version in range(1, repeats + 2):  # the first one sets up the plan: not timed
            got.clear()
            start = time.perf_counter()
            nbytes = pub.publish(version, worker.named_full_parameters(dtype)).nbytes
            assert got.wait(TIMEOUT_S)
            if version > 1:
                times.append(time.perf_counter() - start)
    return statistics.median(times), nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, rank in (("full", 0), ("lora", args.rank)):
            worker = make_worker(args, Path(tmp) / label, rank)
            dtype = getattr(torch, worker.cfg.rollout.dtype)
            vocab = int(worker.actor.model.config.vocab_size)
            one_update(worker, vocab)
            seconds, nbytes = publish_seconds(worker, dtype, args.repeats)
            trainable = sum(p.numel() for p in worker.actor.model.parameters() if p.requires_grad)
            adapter = sum(p.numel() for _, p in adapter_parameters(worker.actor.model))
            rows[label] = {"seconds": seconds, "bytes": nbytes, "trainable": trainable,
                           "adam_bytes": 8 * trainable,
                           "adapter_bytes": adapter * dtype.itemsize if rank else 0}
            print(f"{label:>4}: publish {seconds * 1e3:8.1f} ms, {nbytes / 2**20:8.2f} MiB; "
                  f"trainable {trainable / 1e6:8.3f} M params, AdamW state "
                  f"{8 * trainable / 2**20:8.2f} MiB"
                  + (f"; adapter alone {adapter * dtype.itemsize / 2**20:.2f} MiB" if rank else ""),
                  flush=True)
            worker.shutdown()
    full, lora = rows["full"], rows["lora"]
    print(result_line("lora_merged_publish_vs_full_time", lora["seconds"] / full["seconds"],
                      "<=", 1.3))
    print(result_line("lora_adapter_vs_full_bytes", lora["adapter_bytes"] / full["bytes"],
                      "<=", 0.05, digits=4))
    print(result_line("lora_optimizer_state_vs_full", lora["adam_bytes"] / full["adam_bytes"],
                      "<=", 0.05, digits=4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
