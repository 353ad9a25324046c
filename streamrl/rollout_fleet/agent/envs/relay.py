"""``relay``: the toy multi-turn task a tiny random model learns on CPU (DESIGN.md §11 sizing).

The environment opens with the prompt's digit (toy prompts, ``task.source=toy``), written
``repeat`` times; every turn must repeat the digit of the environment's last message, and after
each turn but the last the environment answers with a new, different digit. A turn earns, over
its first ``turn_tokens`` tokens, 1 per token equal to its digit and ``digit_credit`` (0.1) per
other digit, divided by ``turn_tokens`` and capped at 1 (digits are single tokens); the
episode's reward is the mean over its ``turns`` turns (a turn never reached scores 0), so the
optimum is 1.

Why it tests multi-turn learning: from turn 1 on, the digit a turn must say exists only in the
environment's latest observation (an earlier digit is the wrong answer), so reward on those
turns needs the policy to condition on the observation. Turn 0 (the opening message, a
single-turn task) gives the random model a dense signal for the same skill, and the small
credit for any digit (a format reward) gets a random policy, which says a digit about once in
30 tokens, to digits within a few steps; together they make the task learnable in every mode
within minutes on 2 cores (without them, roughly one run in two learned within 50 steps).
``info`` reports, besides the reward:

- ``observation_reward``: the mean score of turns 1.. (the observation-conditioned ones);
- ``cross_reward`` / ``observation_cross_reward``: the same turns scored the same way against
  the next digit (another prompt's target): a collapse baseline (DESIGN.md §11); real learning
  shows reward well above it.

The n episodes of one prompt see the same digits.
"""

from __future__ import annotations

import random
from typing import Any

from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, StepResult


class RelayEnv(Environment):
    turns = 2
    turn_tokens = 4
    repeat = 8
    """How many times the environment writes its digit in a message."""
    digit_credit = 0.1
    """Credit for a digit that is not the turn's (a format reward; see the module doc)."""

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        digit = prompt.ground_truth
        if not (isinstance(digit, str) and len(digit) == 1 and digit.isdigit()):
            raise ValueError(f"relay: prompt {prompt.index} has ground truth {digit!r}; the relay "
                             "environment needs the toy task's digit prompts (task.source=toy)")
        if self.turns < 2:
            raise ValueError(f"relay: turns={self.turns}; needs >= 2 (turn 1 is the first to "
                             "answer an observation)")
        rng = random.Random(f"relay-{prompt.index}-{digit}")
        self.targets = [int(digit)]  # targets[i] is what turn i must say
        for _ in range(self.turns - 1):
            self.targets.append((self.targets[-1] + rng.randrange(1, 10)) % 10)
        self.scores: list[float] = []
        self.cross: list[float] = []
        return [self._say(0)]

    def _say(self, turn: int) -> dict[str, Any]:
        return {"role": "user", "content": str(self.targets[turn]) * self.repeat}

    def _score(self, text: str, digit: int) -> float:
        hits = text.count(str(digit))
        others = sum(c.isdigit() for c in text) - hits
        return min(hits + self.digit_credit * others, self.turn_tokens) / self.turn_tokens

    def step(self, turn: AssistantTurn) -> StepResult:
        target = self.targets[turn.index]
        self.scores.append(self._score(turn.text, target))
        self.cross.append(self._score(turn.text, (target + 1) % 10))
        observed = self.turns - 1
        info = {"cross_reward": sum(self.cross) / self.turns,
                "observation_reward": sum(self.scores[1:]) / observed,
                "observation_cross_reward": sum(self.cross[1:]) / observed}
        reward = self.scores[-1] / self.turns
        if turn.index + 1 >= self.turns:
            return StepResult(None, reward, True, info)
        return StepResult([self._say(turn.index + 1)], reward, False, info)
