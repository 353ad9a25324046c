"""JudgeServer: an LLM judge on a rollout engine, served to every replica from one actor.

The judge's prompt is ``reward.judge.prompt_template`` with {prompt}, {response} and
{ground_truth} filled in (one pass, so braces in the texts themselves, such as LaTeX's
``\\boxed{}``, are never taken for placeholders), sent as one user message through the judge
model's chat template. The engine (vLLM, or ``hf`` for tests) batches concurrent calls itself.

The answer becomes a reward by ``parse_judgement``, in this order:

1. the last ``Score: x`` (or ``score = x``),
2. else a number the answer starts with,
3. else the last verdict word: correct/right/yes/true/pass -> 1, incorrect/wrong/no/false/fail
   -> 0.

A score outside [0, 1] or an answer with none of these is ``None``: the client scores it 0 and
counts it (``unparseable``); the first such answers are logged, to debug a template.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from streamrl.config import JudgeConfig, RolloutConfig
from streamrl.rollout_fleet.rewards.prompt import PromptLike, as_text

logger = logging.getLogger(__name__)

LOG_EVERY = 100
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_LABELLED = re.compile(r"score\s*[:=]\s*" + _NUMBER, re.IGNORECASE)
_LEADING = re.compile(r"\s*" + _NUMBER + r"(?![\d.])")
_VERDICT = re.compile(r"\b(correct|incorrect|right|wrong|yes|no|true|false|pass|fail)\b",
                      re.IGNORECASE)
_POSITIVE = frozenset({"correct", "right", "yes", "true", "pass"})
_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")


def fill_template(template: str, prompt: str, response: str, ground_truth: str | None) -> str:
    values = {"prompt": prompt, "response": response, "ground_truth": ground_truth or ""}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_judgement(answer: str) -> float | None:
    """The reward in an answer (see the module docstring), or None."""
    labelled = _LABELLED.findall(answer)
    leading = _LEADING.match(answer)
    number = labelled[-1] if labelled else leading.group(1) if leading else None
    if number is not None:
        value = float(number)
        return value if 0.0 <= value <= 1.0 else None
    verdicts = _VERDICT.findall(answer)
    if verdicts:
        return 1.0 if verdicts[-1].lower() in _POSITIVE else 0.0
    return None


class JudgeServer:
    def __init__(self, cfg: JudgeConfig, path: str) -> None:
        """``path``: ``cfg.model_path`` resolved (``remote.resolve_paths``)."""
        self.cfg, self.path = cfg, path
        self.engine: Any = None
        self._counts = {"calls": 0, "unparseable": 0}

    async def setup(self) -> None:
        """Start the engine (here: vLLM binds to the event loop it starts on)."""
        from transformers import AutoTokenizer

        from streamrl.rollout_fleet import make_engine
        from streamrl.rollout_fleet.engine import SamplingParams

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        rollout = RolloutConfig(
            backend=cfg.backend, max_model_len=cfg.max_model_len, dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_inflight_groups=cfg.max_concurrency,
        )
        self.engine = make_engine(rollout, self.path, self.path)
        self.params = SamplingParams(n=1, temperature=cfg.temperature,
                                     max_tokens=cfg.max_new_tokens)

    def prompt_ids(self, prompt: PromptLike, response: str, ground_truth: str | None
                   ) -> list[int]:
        text = fill_template(self.cfg.prompt_template, as_text(prompt), response, ground_truth)
        if self.cfg.apply_chat_template and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False)
        else:
            ids = self.tokenizer(text)["input_ids"]
        ids = list(ids)
        if len(ids) + self.cfg.max_new_tokens > self.cfg.max_model_len:
            raise ValueError(f"the judge prompt has {len(ids)} tokens: with "
                             f"reward.judge.max_new_tokens={self.cfg.max_new_tokens} it exceeds "
                             f"reward.judge.max_model_len={self.cfg.max_model_len}")
        return ids

    async def judge(self, prompt: PromptLike, response: str, ground_truth: str | None
                    ) -> tuple[float | None, str]:
        """(the reward or None, the judge's answer)."""
        if self.engine is None:
            raise RuntimeError("JudgeServer: call setup() first")
        ids = self.prompt_ids(prompt, response, ground_truth)
        [completion] = await self.engine.generate(ids, self.params, f"judge-{uuid.uuid4().hex}")
        answer = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return parse_judgement(answer), answer

    async def score(self, prompt: PromptLike, response: str, ground_truth: str | None
                    ) -> float | None:
        self._counts["calls"] += 1
        value, answer = await self.judge(prompt, response, ground_truth)
        if value is None:
            self._counts["unparseable"] += 1
            n = self._counts["unparseable"]
            if n == 1 or n % LOG_EVERY == 0:
                logger.warning("judge answer #%d without a score in [0, 1] or a verdict "
                               "(scored 0): %r", n, answer[-300:])
        return value

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._counts.items()}

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.close()
