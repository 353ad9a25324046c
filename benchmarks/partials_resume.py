"""Partial rollouts across a stop: tokens thrown away (and so sampled again) after a
SIGTERM-resume, per token in flight at the stop (issue 44; goal 0, and 1 before partials were
saved).

A real ``Replica`` on vLLM (the tiny model unless ``--model-dir``) samples groups of random
prompts; once ``--in-flight-tokens`` tokens are in flight it is stopped. Two arms per trial, on
the same engine and prompts:

- ``saved``: the stop ``ReplicaActor.stop`` makes on SIGTERM (``stop(save=True)``: requests
  aborted, groups saved to a ``FilePartialStore`` on disk); a new replica (a restarted
  process's) reads the snapshot from disk, resumes its groups and runs until each is in the
  buffer. Every response must start with its saved tokens, log-probs' versions unchanged.
- ``baseline``: the stop before issue 44 (``stop(cancel=True)``, nothing saved).

The engine counts every token it samples (aborted returns included). Tokens in flight at the
stop = what the stopped replica sampled - the response tokens of the groups it put (in the
saved arm this equals the snapshot's tokens, printed beside it). Tokens thrown away = tokens
sampled - response tokens of the groups put, over both replicas: the figure is that over the
tokens in flight (the baseline's is 1 by this count, measured with the same counters). Also
printed: the size and wall time of the save and of the load.

    .venv/bin/python benchmarks/partials_resume.py                  # 3 trials
    .venv/bin/python benchmarks/partials_resume.py --trials 5 --in-flight-tokens 4000

Ends with ``RESULT partials_regenerated value=<x> goal=<=0 met=yes|no`` (the saved arm, mean
over trials; ``streamrl.testing.result_line``).
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

GOAL = 0.0
FIRST_ORDINARY_TOKEN = 3  # the tiny tokenizer's ids 0-2 are special tokens
WAIT_S = 300.0


class ZeroScorer:
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return 0.0


class CountingEngine:
    """The real engine, counting every token it samples (aborted returns included)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.sampled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        out = await self._engine.generate(prompt_ids, params, request_id)
        self.sampled += sum(len(c.token_ids) for c in out)
        return out


def random_prompts(count: int, vocab: int, seed: int) -> list[Any]:
    from streamrl.data import Prompt

    rng = random.Random(seed)
    return [Prompt(index=i, prompt_ids=[rng.randrange(FIRST_ORDINARY_TOKEN, vocab)
                                        for _ in range(rng.randint(4, 24))],
                   data_source="bench", ground_truth=None, extra={}) for i in range(count)]


async def wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {WAIT_S:.0f} s")
        await asyncio.sleep(0.005)


class Arm:
    """One arm of a trial: a replica sampling ``prompts`` until ``target`` tokens are in
    flight, then stopped (and, when ``save``, resumed by a second replica)."""

    def __init__(self, engine: Any, tokenizer: Any, prompts: list[Any], rollout: Any,
                 store_dir: Path) -> None:
        from streamrl.data import ListPromptSource

        self.engine, self.tokenizer, self.rollout = engine, tokenizer, rollout
        self.source = ListPromptSource(prompts, name="bench")
        self.store_dir = store_dir

    def replica(self, engine: Any, groups: int, cursor: int, **kwargs: Any) -> Any:
        from streamrl.buffer.memory import MemoryBuffer
        from streamrl.data import PromptStream
        from streamrl.rollout_fleet.replica import Replica

        return Replica(engine, MemoryBuffer(groups_per_step=groups, max_staleness=0),
                       PromptStream(self.source, False, 0, cursor=cursor), ZeroScorer(),
                       self.tokenizer, self.rollout, name="replica-0", **kwargs)

    async def run(self, target: int, save: bool) -> dict[str, float]:
        from streamrl.rollout_fleet.partials import FilePartialStore

        store = FilePartialStore(self.store_dir)
        counting = CountingEngine(self.engine)
        first = self.replica(counting, len(self.source), 0, partials=store)
        first.start()
        await wait(lambda: sum(self.engine.num_tokens(r) for r in first.request_ids) >= target,
                   f"{target} tokens in flight")
        start = time.perf_counter()
        await first.stop(save=save, cancel=True)
        sampled, kept = counting.sampled, first.counters.tokens
        out = {"in_flight": float(sampled - kept), "save_s": time.perf_counter() - start}
        if save:
            size = (self.store_dir / "replica-0.msgpack").stat().st_size
            resumed = await self.resume(store)
            out.update(resumed, bytes=float(size))
            sampled += resumed.pop("sampled")
            kept += resumed.pop("kept")
        out["thrown_away"] = float(sampled - kept)
        out["ratio"] = out["thrown_away"] / out["in_flight"]
        return out

    async def resume(self, store: Any) -> dict[str, float]:
        """A restarted replica: read the snapshot, finish its groups, check their prefixes."""
        start = time.perf_counter()
        snapshot = store.take("replica-0")
        load_s = time.perf_counter() - start
        assert snapshot is not None
        counting = CountingEngine(self.engine)
        second = self.replica(counting, len(snapshot.groups), snapshot.cursor)
        second.resume(snapshot.groups, max_staleness=0)
        second.start()
        await wait(lambda: second.buffer.stats().queued == len(snapshot.groups),
                   f"the {len(snapshot.groups)} resumed groups")
        await second.stop()
        groups = second.buffer.take(len(snapshot.groups), learner_version=0, timeout=10)
        saved = {g.group_id: g for g in snapshot.groups}
        for g in groups:  # the saved tokens open the finished responses, unchanged
            for t, s in zip(g.trajectories, saved[g.group_id].samples or [], strict=True):
                k = len(s.token_ids)
                assert list(t.response_ids[:k]) == s.token_ids
                assert list(t.versions[:k]) == s.versions
        return {"sampled": float(counting.sampled), "kept": float(second.counters.tokens),
                "saved_tokens": float(snapshot.num_tokens), "groups": float(len(groups)),
                "load_s": load_s}


async def measure(model_dir: str, args: argparse.Namespace
                  ) -> list[tuple[dict[str, float], dict[str, float]]]:
    from transformers import AutoConfig, AutoTokenizer

    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet import make_engine

    rollout = RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens,
                            max_inflight_groups=args.inflight, temperature=1.0,
                            max_model_len=512, seed=args.seed)
    engine = make_engine(rollout, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    results = []
    try:
        for i in range(args.trials):
            prompts = random_prompts(4 * args.inflight, vocab, args.seed + i)
            with tempfile.TemporaryDirectory() as tmp:
                arm = Arm(engine, tokenizer, prompts, rollout, Path(tmp))
                saved = await arm.run(args.in_flight_tokens, save=True)
                base = await arm.run(args.in_flight_tokens, save=False)
            results.append((saved, base))
            print(f"trial {i}: saved: {saved['in_flight']:.0f} tokens in flight at the stop "
                  f"({saved['saved_tokens']:.0f} saved, {saved['groups']:.0f} groups), thrown "
                  f"away {saved['thrown_away']:.0f} ({saved['ratio']:.3f}); save "
                  f"{saved['save_s'] * 1e3:.0f} ms, {saved['bytes'] / 1e3:.0f} kB, load "
                  f"{saved['load_s'] * 1e3:.1f} ms | baseline: {base['in_flight']:.0f} in "
                  f"flight, thrown away {base['thrown_away']:.0f} ({base['ratio']:.3f})",
                  flush=True)
    finally:
        await engine.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--inflight", type=int, default=16, help="rollout.max_inflight_groups")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--in-flight-tokens", type=int, default=2000,
                   help="stop once this many tokens are in flight")
    p.add_argument("--model-dir", default=None,
                   help="HF model directory (default: the offline tiny Qwen2, built once)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from streamrl.testing import build_tiny_model

    model_dir = args.model_dir or str(build_tiny_model(
        Path(tempfile.gettempdir()) / "streamrl-bench-h64-l2"))
    print(f"model {model_dir}: n={args.n}, {args.inflight} groups in flight, "
          f"{args.max_new_tokens} new tokens, stop at {args.in_flight_tokens} tokens in flight")
    results = asyncio.run(measure(model_dir, args))
    ratio = sum(s["ratio"] for s, _ in results) / len(results)
    base = sum(b["ratio"] for _, b in results) / len(results)
    print(f"tokens thrown away / tokens in flight at the stop: saved {ratio:.3f}, baseline "
          f"(nothing saved) {base:.3f}; saved / baseline = {ratio / base:.3f}")
    print(result_line("partials_regenerated", ratio, "<=", GOAL, digits=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
