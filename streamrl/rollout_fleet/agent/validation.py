"""Validation for agent runs: one greedy episode per validation prompt, scored by its env.

``validate_episodes(agent, engine, prompts)`` is what ``ReplicaActor.validate`` runs when the
replica has an agent (single-turn replicas keep their greedy completion + scorer path). Requests
go straight to the engine (no retries or abort handling: validation runs between updates).
Depends on loop.py and engine.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from streamrl.rollout_fleet.agent.loop import Agent, run_episode
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams

GREEDY = SamplingParams(n=1, temperature=0.0)


async def validate_episodes(agent: Agent, engine: RolloutEngine, prompts: Sequence[Any],
                            greedy: SamplingParams = GREEDY) -> dict[str, float]:
    """Mean reward, response length, turns, tool errors and truncation over ``prompts``
    (``greedy``: the run's greedy sampling parameters, its stops; each turn sets max_tokens)."""
    start = time.perf_counter()

    async def sample(prompt_ids: list[int], max_tokens: int, request_id: str) -> Completion:
        params = dataclasses.replace(greedy, max_tokens=max_tokens)
        (c,) = await engine.generate(prompt_ids, params, request_id)
        return c

    episodes = await asyncio.gather(*(run_episode(agent, prompts[i], sample, f"val-{i}")
                                      for i in range(len(prompts))))
    if not episodes:
        return {}
    n = len(episodes)
    return {
        "reward/mean": sum(e.reward for e in episodes) / n,
        "response_length/mean": sum(len(e.response_ids) for e in episodes) / n,
        "turns/mean": sum(e.turns for e in episodes) / n,
        "tool_errors/mean": sum(e.tool_errors for e in episodes) / n,
        "truncated/share": sum(e.truncated for e in episodes) / n,
        "seconds": time.perf_counter() - start,
    }
