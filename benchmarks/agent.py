"""Agent episodes vs single-turn generation: engine tokens/s on the same replica and engine.

One vLLM engine serves two runs of the real ``Replica`` loop over the same prompts:

- ``agent``: ``rollout.agent`` = this file's ``BenchEnv``; each episode has ``--turns``
  assistant turns of ``--turn-tokens`` tokens with a short ``user`` observation in between,
  so every turn after the first is a new request on a longer prompt (the chat-template delta
  appended to the episode's ids);
- ``single``: the same first prompts, one turn of ``turns x turn-tokens`` tokens.

Throughput is sampled (policy) tokens / wall seconds, from the first admission to the last
group in the buffer; engine start-up and a warm-up request are excluded. The random model
rarely ends a turn early, so both runs sample about the same number of tokens. The breakdown
sums the time each episode spent in rendering deltas, decoding + parsing tool calls, tools and
the environment (all on the replica's event loop), and leaves the rest to what multi-turn costs
the engine itself: the re-prefill of each turn's longer prompt and a smaller running batch while
episodes sit between turns.

    .venv/bin/python benchmarks/agent.py                       # 32 prompts, n=4, 4 turns x 32
    .venv/bin/python benchmarks/agent.py --hidden-size 256 --layers 4

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(agent_vs_single_turn; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

# benchmarks/rollout.py (this file's directory is on sys.path) sets the engines' environment
# when imported: it must come before anything that loads torch or vLLM.
from rollout import add_model_args, model_dir_of, run_replica

from streamrl.rollout_fleet.agent import Environment, StepResult
from streamrl.testing import result_line

GOAL = 0.7
PHASES = ("render_s", "parse_s", "tool_s", "env_s")


class BenchEnv(Environment):
    """``TURNS`` turns; each observation is a short user message; reward 0."""

    TURNS = 4

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"count with me: {prompt.index}"}]

    def step(self, turn: Any) -> StepResult:
        if turn.index + 1 >= self.TURNS:
            return StepResult(None, 0.0, True)
        return StepResult([{"role": "user", "content": f"go on {turn.index}"}], 0.0, False)


async def run(engine: Any, tokenizer: Any, prompts: list[Any], rollout: Any
              ) -> dict[str, float]:
    wall_s, replica, buffer = await run_replica(engine, tokenizer, prompts, rollout)
    groups = buffer.take(len(prompts), 0, timeout=10)
    trajs = [t for g in groups for t in g.trajectories]
    out = {"wall_s": wall_s, "sampled": float(sum(t.num_policy_tokens for t in trajs)),
           "observation": float(sum(len(t.loss_mask) - t.num_policy_tokens for t in trajs)),
           "episodes": float(len(trajs)), "failures": replica.metrics()["groups_failed"]}
    out["tokens_per_s"] = out["sampled"] / wall_s
    for phase in PHASES:
        out[phase] = sum(t.metrics.get(phase, 0.0) for t in trajs)
    return out


async def measure(model_dir: str, args: argparse.Namespace) -> tuple[dict, dict]:
    from transformers import AutoTokenizer

    from streamrl.config import RolloutConfig
    from streamrl.data import Prompt
    from streamrl.rollout_fleet import make_engine
    from streamrl.rollout_fleet.agent import ChatRenderer
    from streamrl.rollout_fleet.engine import SamplingParams

    BenchEnv.TURNS = args.turns
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer)
    prompts = []
    for i in range(args.prompts):
        prompt = Prompt(index=i, prompt_ids=[], data_source="bench", ground_truth=None, extra={})
        prompts.append(Prompt(index=i, prompt_ids=renderer.prompt(BenchEnv().reset(prompt)),
                              data_source="bench", ground_truth=None, extra={}))
    common = {"n": args.n, "max_inflight_groups": args.inflight, "temperature": 1.0,
              "max_model_len": 1024, "seed": args.seed}
    engine = make_engine(RolloutConfig(**common), model_dir)
    try:
        await engine.generate(prompts[0].prompt_ids, SamplingParams(max_tokens=4), "warmup")
        agent = await run(engine, tokenizer, prompts, RolloutConfig(
            **common, agent=f"{Path(__file__).resolve()}:BenchEnv", max_turns=args.turns,
            max_new_tokens=args.turn_tokens, max_episode_tokens=args.turns * args.turn_tokens
            + 32 * args.turns))
        single = await run(engine, tokenizer, prompts, RolloutConfig(
            **common, max_new_tokens=args.turns * args.turn_tokens))
    finally:
        await engine.close()
    return agent, single


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32, help="number of prompts (groups)")
    p.add_argument("--n", type=int, default=4, help="episodes per prompt")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=32, help="sampled tokens per turn")
    p.add_argument("--inflight", type=int, default=8, help="rollout.max_inflight_groups")
    add_model_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_of(args)
    print(f"model {model_dir}: {args.prompts} prompts x n={args.n}, {args.turns} turns x "
          f"{args.turn_tokens} tokens vs one turn of {args.turns * args.turn_tokens}, "
          f"{args.inflight} groups in flight")
    agent, single = asyncio.run(measure(model_dir, args))
    for name, r in (("agent", agent), ("single", single)):
        print(f"{name:>6}: {r['tokens_per_s']:8.0f} sampled tok/s  ({r['sampled']:.0f} sampled + "
              f"{r['observation']:.0f} observation tokens in {r['wall_s']:.2f} s, "
              f"{r['episodes']:.0f} trajectories, {r['failures']:.0f} failed groups)")
    ratio = agent["tokens_per_s"] / single["tokens_per_s"]
    lost = max(agent["wall_s"] - agent["sampled"] / single["tokens_per_s"], 0.0)
    loop_s = sum(agent[p] for p in PHASES)
    print(f"agent / single-turn: {ratio:.2f}; agent run took {lost:.2f} s longer than its "
          "tokens at the single-turn rate. Where it went (event-loop seconds, summed over "
          "episodes):")
    for phase in PHASES:
        print(f"  {phase[:-2]:>7}: {agent[phase]:7.3f} s  "
              f"({1e3 * agent[phase] / max(agent['episodes'], 1):.2f} ms per episode)")
    print(f"  engine (re-prefill per turn, smaller batches between turns): "
          f"~{max(lost - loop_s, 0.0):.2f} s")
    print(result_line("agent_vs_single_turn", ratio, ">=", GOAL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
