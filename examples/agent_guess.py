"""A custom agent: an environment with its own tool, trained end to end with streamrl.

The game: the environment picks a digit; the model calls ``guess(number)`` and hears
"higher", "lower" or "correct"; it has up to ``rollout.max_turns`` turns. Reward 1 for a correct
guess, minus 0.1 per extra guess; 0 if it never guesses right. A second tool, ``hint`` (a plain
module-level function given through ``rollout.tools``), tells whether the digit is even.

    .venv/bin/python examples/agent_guess.py                        # the tiny model, 10 steps
    .venv/bin/python examples/agent_guess.py model.path=/models/Qwen2.5-0.5B-Instruct \
        trainer.total_steps=200

A random tiny model will not learn to call tools in 10 steps; the run shows the whole path
(episodes, tool calls and their errors, masked observations, GRPO over n episodes per prompt).
Any ``key=value`` argument is a config override, as for ``streamrl train``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from streamrl.rollout_fleet.agent import AssistantTurn, Environment, StepResult

HERE = Path(__file__).resolve()


def hint(number: int) -> str:
    """Say whether a number is even or odd.

    Args:
        number: Any integer.
    """
    return "even" if number % 2 == 0 else "odd"


class GuessEnv(Environment):
    """Guess the digit; the environment answers higher / lower / correct."""

    @property
    def tools(self) -> list[Any]:  # type: ignore[override]
        return [self.guess]  # a bound method: the tool sees this episode's secret

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        self.secret = random.Random(prompt.index).randrange(10)
        self.guesses = 0
        self.solved = False
        return [{"role": "system", "content": "Find the secret digit with the guess tool."},
                {"role": "user", "content": "I picked a digit from 0 to 9. Guess it."}]

    def guess(self, number: int) -> str:
        """Guess the secret digit.

        Args:
            number: Your guess, 0 to 9.
        """
        self.guesses += 1
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def step(self, turn: AssistantTurn) -> StepResult:
        info = {"guesses": self.guesses, "solved": float(self.solved)}
        if self.solved:
            return StepResult(None, max(0.0, 1.1 - 0.1 * self.guesses), True, info)
        if not turn.tool_messages:  # answered without a tool call: the game is over
            return StepResult(None, 0.0, True, info)
        return StepResult(turn.tool_messages, 0.0, False, info)


def main(overrides: list[str]) -> None:
    from streamrl.config import load_config
    from streamrl.controller import run_training

    cfg = load_config([
        f"rollout.agent={HERE}:GuessEnv", f"rollout.tools=[{HERE}:hint]",
        "rollout.max_turns=4", "rollout.max_new_tokens=24", "rollout.max_episode_tokens=256",
        # The tool list makes the first prompt long in the tiny byte-level tokenizer.
        "task.max_prompt_length=768", "rollout.max_model_len=1024",
        "task.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
        "trainer.total_steps=10", "runtime.num_cpus=2", "trainer.experiment_name=agent-guess",
        *overrides,
    ])
    result = run_training(cfg)
    for h in result.history:
        print(f"step {h['step']}: reward {h['reward/mean']:.3f}, "
              f"response length {h['response_length/mean']:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
