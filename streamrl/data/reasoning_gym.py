"""GSM8K-style prompts generated offline by reasoning-gym (no dataset download needed).

``load_reasoning_gym_source`` draws ``size`` problems, split evenly over the named datasets
(``gsm_symbolic``, ``basic_arithmetic``, ``chain_sum``, or any other reasoning-gym dataset),
from a fixed seed. Each becomes a one-message chat prompt asking for the final answer after
``####`` (the GSM8K convention verl's gsm8k preprocessing uses), rendered with the chat
template. ``data_source`` is ``reasoning_gym/<dataset>``, ``ground_truth`` the dataset's answer,
and ``extra["entry"]`` the whole entry (plain JSON types) so the dataset's own ``score_answer``
can grade a response (streamrl/rollout_fleet/rewards/rgym.py).
"""

from __future__ import annotations

import json
from typing import Any

from streamrl.data.base import ListPromptSource, Prompt, SkipCounter
from streamrl.errors import ConfigError

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE_PREFIX = "reasoning_gym/"


def _plain(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry with JSON types only (metadata may hold Fractions etc.): msgpack-safe."""
    return json.loads(json.dumps(entry, default=str))


def load_reasoning_gym_source(
    names: list[str], size: int, seed: int, tokenizer: Any, max_prompt_length: int
) -> ListPromptSource:
    import reasoning_gym

    if not names:
        raise ConfigError("task.name: give at least one reasoning-gym dataset name")
    if size <= 0:
        raise ValueError(f"task.size={size}: must be > 0")
    prompts: list[Prompt] = []
    skipped: dict[str, int] = {}
    for k, name in enumerate(names):
        count = size // len(names) + (1 if k < size % len(names) else 0)
        if count == 0:
            continue
        try:
            dataset = reasoning_gym.create_dataset(name, size=count, seed=seed + k)
        except Exception as exc:
            raise ConfigError(f"task.name={','.join(names)!r}: reasoning-gym dataset {name!r}: "
                              f"{exc}") from exc
        counter = SkipCounter(origin=f"reasoning_gym/{name}(seed={seed + k})")
        for i in range(count):
            entry = _plain(dict(dataset[i]))
            answer = entry.get("answer")
            if not isinstance(answer, str):
                counter.skip(i, "non-string answer", type(answer).__name__)
                continue
            messages = [{"role": "user", "content": f"{entry['question']} {INSTRUCTION}"}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) > max_prompt_length:
                counter.skip(i, "prompt longer than max_prompt_length",
                             f"{len(ids)} > {max_prompt_length}")
                continue
            prompts.append(Prompt(
                index=len(prompts), prompt_ids=ids, data_source=DATA_SOURCE_PREFIX + name,
                ground_truth=answer, extra={"entry": entry}, messages=messages,
            ))
        counter.summarize()
        for reason, n in counter.counts.items():
            skipped[reason] = skipped.get(reason, 0) + n
    return ListPromptSource(prompts, name="reasoning_gym:" + ",".join(names), skipped=skipped)
