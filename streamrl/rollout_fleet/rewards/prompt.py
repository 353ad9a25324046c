"""The prompt a response answered, as reward models and judges read it.

Rule scorers grade the response alone; a reward model and a judge need the prompt too. The
replica passes it in ``extra_info[PROMPT_KEY]`` (verl's name for it; ``reward_prompt`` builds
it): the prompt's chat messages where the data source has them, else its decoded text.
"""

from __future__ import annotations

from typing import Any

PROMPT_KEY = "raw_prompt"

PromptLike = str | list[dict[str, Any]]


def prompt_of(extra_info: dict[str, Any]) -> PromptLike:
    prompt = extra_info.get(PROMPT_KEY)
    if not isinstance(prompt, (str, list)):
        raise KeyError(f"extra_info has no {PROMPT_KEY!r} (the prompt's messages or text): the "
                       "replica must pass it for reward.kind=model|judge")
    return prompt


def as_messages(prompt: PromptLike) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def as_text(prompt: PromptLike) -> str:
    """Plain text: the text itself, or the messages' contents one per line (with their role
    when there is more than one)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return str(prompt[0].get("content") or "")
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in prompt)


def reward_prompt(prompt: Any, tokenizer: Any) -> PromptLike:
    """What a replica puts in ``extra_info[PROMPT_KEY]`` for ``prompt`` (a ``data.Prompt``):
    its chat messages where the source has them, else its ids decoded by the policy's
    ``tokenizer``."""
    messages = getattr(prompt, "messages", None)
    if messages:
        return list(messages)
    return str(tokenizer.decode(prompt.prompt_ids, skip_special_tokens=True))


def scoring_extra(prompt: Any, max_new_tokens: int, tokenizer: Any) -> dict[str, Any]:
    """What a scorer gets beside the response to ``prompt``: rep-style rewards count over the
    token budget; prompt fields take precedence; reward models and judges read the prompt."""
    return {"max_new_tokens": max_new_tokens, **prompt.extra,
            PROMPT_KEY: reward_prompt(prompt, tokenizer)}
