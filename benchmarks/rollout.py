"""Rollout throughput: a vLLM replica against an hf-engine replica, same model, same prompts.

Each backend runs the real ``Replica`` loop (admission, n samples per prompt, decode, score,
``Group`` into a ``MemoryBuffer``) over the same ragged prompts until every prompt's group is in
the buffer; generated tokens / wall seconds is its throughput. Engine start-up and one warm-up
request are excluded. The scorer returns 0 without work so the engines are what is measured.
Both engines get one OpenMP thread (vLLM's engine core is a separate process; the hf engine runs
in this one). Prints absolute figures and the vLLM / hf ratio.

    .venv/bin/python benchmarks/rollout.py                    # 64 prompts, n=4, 32 new tokens
    .venv/bin/python benchmarks/rollout.py --backends vllm --prompts 256

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(vllm_vs_hf_rollout; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _key, _value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

import asyncio  # noqa: E402 - the environment above must be set before torch / vLLM load

from streamrl.testing import result_line  # noqa: E402

GOAL = 1.0  # the engine we ship must at least match the plain HF generate loop
FIRST_ORDINARY_TOKEN = 3  # the tiny tokenizer's ids 0-2 are special tokens


class ZeroScorer:
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return 0.0


async def run_replica(engine: Any, tokenizer: Any, prompts: list[Any], rollout: Any
                      ) -> tuple[float, Any, Any]:
    """The real ``Replica`` loop over ``prompts`` (scored 0) until each prompt's group is in a
    ``MemoryBuffer``: (wall seconds from its start, the stopped replica, the buffer)."""
    from streamrl.buffer.memory import MemoryBuffer
    from streamrl.data import ListPromptSource, PromptStream
    from streamrl.rollout_fleet.replica import Replica

    buffer = MemoryBuffer(groups_per_step=len(prompts), max_staleness=0)
    stream = PromptStream(ListPromptSource(prompts, name="bench"), shuffle=False, seed=0)
    replica = Replica(engine, buffer, stream, ZeroScorer(), tokenizer, rollout)
    start = time.perf_counter()
    replica.start()
    while buffer.stats().produced < len(prompts):
        await asyncio.sleep(0.005)
    wall_s = time.perf_counter() - start
    await replica.stop()
    return wall_s, replica, buffer


def ragged_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[Any]:
    from streamrl.data import Prompt

    rng = random.Random(seed)
    return [
        Prompt(index=i, data_source="bench", ground_truth=None, extra={},
               prompt_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, vocab)
                           for _ in range(rng.randint(min_len, max_len))])
        for i in range(count)
    ]


async def measure(backend: str, model_dir: str, prompts: list[Any], args: argparse.Namespace
                  ) -> dict[str, float]:
    from transformers import AutoTokenizer

    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet import make_engine
    from streamrl.rollout_fleet.engine import SamplingParams

    rollout = RolloutConfig(backend=backend, n=args.n, max_new_tokens=args.max_new_tokens,
                            max_inflight_groups=args.inflight, temperature=1.0,
                            max_model_len=512, seed=args.seed)
    start = time.perf_counter()
    engine = make_engine(rollout, model_dir)
    startup_s = time.perf_counter() - start
    try:
        await engine.generate(prompts[0].prompt_ids, SamplingParams(max_tokens=4), "warmup")
        wall_s, replica, _ = await run_replica(
            engine, AutoTokenizer.from_pretrained(model_dir), prompts, rollout)
        m = replica.metrics()
    finally:
        await engine.close()
    return {"startup_s": startup_s, "wall_s": wall_s, "tokens": m["tokens"],
            "tokens_per_s": m["tokens"] / wall_s, "groups": m["groups"],
            "failures": m["request_failures"] + m["groups_failed"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="vllm,hf", help="comma-separated (default vllm,hf)")
    p.add_argument("--prompts", type=int, default=64, help="number of prompts (groups)")
    p.add_argument("--min-len", type=int, default=4, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=60, help="longest prompt, tokens")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--inflight", type=int, default=8, help="rollout.max_inflight_groups")
    add_model_args(p)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help="HF model directory (default: an offline random tiny Qwen2, built once)")
    p.add_argument("--hidden-size", type=int, default=64,
                   help="width of the built model (heads of 32; default 64: the test model)")
    p.add_argument("--layers", type=int, default=2, help="layers of the built model")
    p.add_argument("--seed", type=int, default=0)


def model_dir_of(args: argparse.Namespace) -> str:
    """``--model-dir``, or the tiny model ``add_model_args``' options describe (built once)."""
    from streamrl.testing import build_tiny_model

    return args.model_dir or str(build_tiny_model(
        Path(tempfile.gettempdir()) / f"streamrl-bench-h{args.hidden_size}-l{args.layers}",
        hidden_size=args.hidden_size, num_layers=args.layers,
        num_heads=max(1, args.hidden_size // 32), intermediate_size=4 * args.hidden_size))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_of(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = ragged_prompts(args.prompts, args.min_len, args.max_len, vocab, args.seed)
    print(f"model {model_dir} (hidden {args.hidden_size}, {args.layers} layers): "
          f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens, n={args.n}, "
          f"{args.max_new_tokens} new tokens, {args.inflight} groups in flight")
    results: dict[str, dict[str, float]] = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        results[backend] = r = asyncio.run(measure(backend, model_dir, prompts, args))
        print(f"{backend:>5}: {r['tokens_per_s']:8.0f} tok/s  ({r['tokens']:.0f} tokens in "
              f"{r['wall_s']:.2f} s, {r['groups']:.0f} groups, {r['failures']:.0f} failures; "
              f"engine start {r['startup_s']:.1f} s)", flush=True)
    if "vllm" in results and "hf" in results:
        ratio = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        print(f"vllm / hf throughput: {ratio:.1f}x")
        print(result_line("vllm_vs_hf_rollout", ratio, ">=", GOAL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
