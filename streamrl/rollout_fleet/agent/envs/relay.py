"""``relay``: the toy multi-turn task a tiny random model learns on CPU (DESIGN.md §11 sizing).

The model speaks first (turn 0 is not scored); the environment then answers with a digit,
written ``repeat`` times, and each later turn must repeat the digit the environment said last:
the prompt's digit after turn 0 (toy prompts, ``task.source=toy``), then a new, different digit
after each further turn. A scored turn earns the share of its first ``turn_tokens`` tokens equal
to its digit (digits are single tokens); the episode's reward is the mean over the scored turns
(``turns - 1`` of them; a turn never reached scores 0), so the optimum is 1.

Why it tests multi-turn learning: the digit a turn must say exists only in the environment's
observation, so reward needs the policy to condition on it, as the single-turn ``rep`` task
needs it to condition on the prompt. ``info["cross_reward"]`` scores the same turns against the
next digit (another prompt's target): a collapse baseline (DESIGN.md §11); real learning shows
reward well above it. The n episodes of one prompt see the same digits.
"""

from __future__ import annotations

import random
from typing import Any

from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, StepResult

OPENING = "ready"


class RelayEnv(Environment):
    turns = 2
    turn_tokens = 4
    repeat = 8
    """How many times the environment writes its digit in a message."""

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        digit = prompt.ground_truth
        if not (isinstance(digit, str) and len(digit) == 1 and digit.isdigit()):
            raise ValueError(f"relay: prompt {prompt.index} has ground truth {digit!r}; the relay "
                             "environment needs the toy task's digit prompts (task.source=toy)")
        if self.turns < 2:
            raise ValueError(f"relay: turns={self.turns}; needs >= 2 (turn 0 is not scored)")
        rng = random.Random(f"relay-{prompt.index}-{digit}")
        self.targets = [int(digit)]  # targets[i] is what turn i + 1 must say
        for _ in range(self.turns - 2):
            self.targets.append((self.targets[-1] + rng.randrange(1, 10)) % 10)
        self.scores: list[float] = []
        self.cross: list[float] = []
        return [{"role": "user", "content": OPENING}]

    def _score(self, text: str, digit: int) -> float:
        return min(text.count(str(digit)), self.turn_tokens) / self.turn_tokens

    def step(self, turn: AssistantTurn) -> StepResult:
        reward = 0.0
        if turn.index > 0:
            target = self.targets[turn.index - 1]
            self.scores.append(self._score(turn.text, target))
            self.cross.append(self._score(turn.text, (target + 1) % 10))
            reward = self.scores[-1] / (self.turns - 1)
        info = {"cross_reward": sum(self.cross) / (self.turns - 1)}
        if turn.index + 1 >= self.turns:
            return StepResult(None, reward, True, info)
        said = str(self.targets[turn.index]) * self.repeat
        return StepResult([{"role": "user", "content": said}], reward, False, info)
