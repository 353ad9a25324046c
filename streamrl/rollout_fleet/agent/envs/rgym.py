"""``reasoning_gym``: any reasoning-gym task as a one-tool environment.

Prompts come from ``task.source=reasoning_gym`` (the dataset entry rides in
``prompt.extra["entry"]``). The model gets the question and one tool, ``submit_answer(answer)``,
graded by the dataset's own scorer (``rewards/rgym.py``); the observation says whether it was
right, so a wrong answer can be corrected in the next turn. The episode ends at the first
correct submission, after ``attempts`` submissions, or on a turn without a tool call. Reward:
the best score submitted (0 if none).
"""

from __future__ import annotations

from typing import Any

from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, StepResult
from streamrl.rollout_fleet.rewards.rgym import compute_score

SYSTEM = ("Answer the question. Submit your final answer with the submit_answer tool; if it is "
          "wrong you will be told and may submit again.")


class ReasoningGymEnv(Environment):
    attempts = 3

    @property
    def tools(self) -> list[Any]:  # type: ignore[override]
        return [self.submit_answer]

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        entry = prompt.extra.get("entry")
        if not isinstance(entry, dict) or "question" not in entry:
            raise ValueError(f"reasoning_gym env: prompt {prompt.index} has no reasoning-gym "
                             "entry (use task.source=reasoning_gym)")
        self.prompt = prompt
        self.scores: list[float] = []
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": str(entry["question"])}]

    def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the question.

        Args:
            answer: The answer, in the form the question asks for.
        """
        p = self.prompt
        score = float(compute_score(p.data_source, answer, p.ground_truth, p.extra))
        self.scores.append(score)
        return "correct" if score >= 1.0 else f"incorrect (score {score:g}); you may try again"

    def step(self, turn: AssistantTurn) -> StepResult:
        best = max(self.scores, default=0.0)
        info = {"submissions": len(self.scores), "best_score": best}
        finished = best >= 1.0 or len(self.scores) >= self.attempts
        if not turn.tool_messages or finished or turn.last:
            return StepResult(None, best, True, info)
        return StepResult(turn.tool_messages, 0.0, False, info)

    def truncate(self, turn: AssistantTurn) -> float:
        return max(self.scores, default=0.0)
