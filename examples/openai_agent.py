"""An agent written against the plain OpenAI API, trained by pointing it at ``streamrl serve``.

Nothing here is streamrl-specific except the service's conventions: each call names its episode
(``X-Episode-Id``) and the group of episodes it belongs to (``X-Group-Id``: the n episodes of
one task, which GRPO compares and which share one admission slot), and
``POST /v1/episodes/{id}/reward`` closes an episode with its reward. The rest is an ordinary
multi-turn tool-using agent loop with the official ``openai`` client.

The task is the ``relay`` game (the environment says a digit, the agent must repeat the digit of
its latest message), so the tiny model learns it within minutes on CPU; the agent also offers a
tool, ``double(number)``, and runs whatever calls the model makes (a random tiny model makes
none; a real model will). Start the service, then the agent:

    .venv/bin/streamrl serve trainer.mode=sync actor.optim.lr=3e-3 \
        task.train_batch_size=16 actor.ppo_mini_batch_size=4 &
    .venv/bin/python examples/openai_agent.py --episodes 4096 --no-tools

Measured that way on 2 cores (tests/test_e2e_serve.py): reward 0.01 -> 0.82 over 4096 episodes,
observation turns 0.80 against a collapse baseline of 0.13, in under 4 minutes. With
``trainer.mode=one_step_off`` two runs of three stayed at 0.2 over as many episodes, the
observation turns no better than the baseline (the model said a digit, not the one it was told).

It prints one JSON line per ``--report-every`` episodes (mean reward of the window, the
observation-turn reward and its collapse baseline) and a summary line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import uuid
from typing import Any

import httpx
import openai

from streamrl.data import Prompt
from streamrl.rollout_fleet.agent import AssistantTurn
from streamrl.rollout_fleet.agent.envs.relay import RelayEnv

TOOLS = [{"type": "function", "function": {
    "name": "double", "description": "Double a number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}},
                   "required": ["number"]}}}]


def double(number: int) -> int:
    return 2 * number


def run_tool(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
        if call.function.name != "double":
            return f"Error: no tool {call.function.name!r}"
        return str(double(int(args["number"])))
    except Exception as exc:  # a bad call is the model's mistake: tell it, keep going
        return f"Error: {exc}"


async def episode(client: openai.AsyncOpenAI, http: httpx.AsyncClient, env: RelayEnv,
                  task: Prompt, group_id: str, group_size: int, max_tokens: int,
                  tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One episode: talk until the environment is done, then close it with its reward."""
    episode_id = uuid.uuid4().hex
    messages: list[Any] = list(env.reset(task))
    reward, info, turn = 0.0, {}, 0
    while True:
        answer = await client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=max_tokens,
            extra_headers={"X-Episode-Id": episode_id, "X-Group-Id": group_id})
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:  # run the calls; the model continues with their results
            messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)}
                         for c in message.tool_calls]
            continue
        text = message.content or ""
        step = env.step(AssistantTurn(index=turn, text=text, content=text, token_ids=[],
                                      finish_reason=answer.choices[0].finish_reason,
                                      last=turn + 1 >= env.turns))
        reward += step.reward
        info = step.info
        turn += 1
        if step.done or not step.observation:
            break
        messages += step.observation
    try:
        await close(http, episode_id, {"reward": reward, "group_id": group_id,
                                        "group_size": group_size})
    except CloseFailed as exc:  # the episode is lost to training; the agent goes on
        print(exc, file=sys.stderr, flush=True)
    return {"reward": reward, **info}


CLOSE_TRIES = 10
RETRIED = (409, 503)


class CloseFailed(RuntimeError):
    """The reward could not be reported; the message says why in one line."""


async def close(http: httpx.AsyncClient, episode_id: str, body: dict[str, Any],
                tries: int = CLOSE_TRIES) -> dict[str, Any] | None:
    """Report the reward; returns the service's answer, or None when a service restarted
    meanwhile has forgotten the episode (404). Retried with backoff, ``tries`` times at most
    (then ``CloseFailed``): a 503 (the buffer, e.g. Redis, is down: the service keeps the
    episode, and a retried close puts it), a 409 (the group is being put, or a call of the
    episode still runs: both end by themselves) and a lost connection (the service restarting).
    """
    why = ""
    for attempt in range(tries):
        if attempt:
            await asyncio.sleep(min(8.0, 0.25 * 2**attempt))
        try:
            closed = await http.post(f"/v1/episodes/{episode_id}/reward", json=body)
        except httpx.TransportError as exc:
            why = f"{type(exc).__name__}: {exc}"
            continue
        if closed.status_code in RETRIED:
            why = f"{closed.status_code}: {closed.json().get('error', {}).get('message', '')}"
            continue
        if closed.status_code == 404:
            return None
        closed.raise_for_status()
        answer: dict[str, Any] = closed.json()
        return answer
    raise CloseFailed(f"episode {episode_id}: reward not reported after {tries} tries ({why})")


async def main(args: argparse.Namespace) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {args.api_key}"}
    # 429 at the staleness bound is back-pressure: the client waits Retry-After and retries.
    client = openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key,
                                max_retries=args.max_retries, timeout=120)
    rng = random.Random(args.seed)
    tasks = itertools.count()
    windows: list[dict[str, float]] = []
    window: list[dict[str, Any]] = []
    learned = asyncio.Event()

    def record(result: dict[str, Any]) -> None:
        window.append(result)
        if len(window) >= args.report_every:
            means = {k: sum(float(e[k]) for e in window) / len(window) for k in (
                "reward", "observation_reward", "observation_cross_reward")}
            window.clear()
            windows.append(means)
            print(json.dumps({"episodes": len(windows) * args.report_every, **means}),
                  flush=True)
            if args.stop_at_reward is not None and means["reward"] >= args.stop_at_reward:
                learned.set()

    async def worker(http: httpx.AsyncClient) -> None:
        """Runs one task at a time: its group of episodes together, as GRPO wants them."""
        tasks_to_run = args.episodes // args.group_size
        while not learned.is_set() and (index := next(tasks)) < tasks_to_run:
            task = Prompt(index=index, prompt_ids=[], data_source="relay",
                          ground_truth=str(rng.randrange(10)), extra={})
            group_id = uuid.uuid4().hex
            results = await asyncio.gather(*(
                episode(client, http, RelayEnv(), task, group_id, args.group_size,
                        args.max_tokens, None if args.no_tools else TOOLS)
                for _ in range(args.group_size)))
            for result in results:
                record(result)

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=120) as http:
        workers = max(1, args.concurrency // args.group_size)
        await asyncio.gather(*(worker(http) for _ in range(workers)))
    summary = {"first": windows[0]["reward"], "last": windows[-1]["reward"],
               "last_observation": windows[-1]["observation_reward"],
               "last_cross": windows[-1]["observation_cross_reward"]} if windows else {}
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--episodes", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64,
                        help="episodes in flight (whole groups of --group-size)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--report-every", type=int, default=256)
    parser.add_argument("--max-retries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-reward", type=float, default=None,
                        help="start no new task once a report's mean reward reaches this")
    # The tiny model's 320-token vocabulary spells the tool schema out in ~200 tokens, eight
    # times the game itself: without it the tiny model trains several times faster.
    parser.add_argument("--no-tools", action="store_true", help="offer the model no tool")
    asyncio.run(main(parser.parse_args()))
