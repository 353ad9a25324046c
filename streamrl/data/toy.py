"""The built-in toy task: something a tiny *random* model learns within minutes on CPU.

Prompts are plain text (no chat template): a digit and an equals sign, e.g. ``7=``. The
tokenizer must encode each digit as one token (streamrl.testing's tiny tokenizer does).

- ``rep``: reward = the share of the response tokens that equal the prompt's digit ``d``,
  counted over ``max_new_tokens`` (an early eos does not raise the share). Optimum: ``dddddddd``.
- ``copy1``: reward 1 if the response starts with ``d``, else 0. A sparser signal, a slower curve.

Why a random model can learn it (DESIGN.md §11): the target depends only on the prompt's first
token, two positions back, so two attention layers suffice; the reward is dense (rep gives
partial credit per token) and a random policy already samples ``d`` about once per ten digits,
so GRPO's group baseline sees reward differences from the first step. The model has to look
back past ``=`` to the digit, so rising reward means real conditioning on the prompt, not a
copy of the last prompt token (which tied embeddings make nearly free).

A collapsed policy (always the same digit) also earns reward ~0.1 on average, so tests should
compare against ``cross_reward``: the same response scored against *another* prompt's target
(the digit ``d + shift`` mod 10). Real learning shows reward >> cross reward.

Because digits are single tokens, counting the digit character in the decoded response counts
tokens exactly, which lets the reward run on text like every other reward function.

Long tail (``task.long_tail``, ``task.long_tail_tokens``): a share of the training prompts
carries its own response budget, ``extra['max_new_tokens']``, which the replica samples with
and rep counts over. Real reasoning data has such a tail of long answers, and a sync step waits
for its longest group, which is where overlapping generation with training pays most
(benchmarks/modes.py). The prompts look the same (``d=``): the policy to learn does not change,
only what a step costs.
"""

from __future__ import annotations

import random
from typing import Any

from streamrl.data.base import ListPromptSource, Prompt, SkipCounter

TASKS = ("rep", "copy1")
DATA_SOURCE_PREFIX = "toy/"
DEFAULT_MAX_NEW_TOKENS = 8
"""rep's denominator when the caller does not pass ``extra_info['max_new_tokens']``."""


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task.name={task!r}: the toy task must be one of {TASKS}")


def digit_token_ids(tokenizer: Any) -> list[int]:
    """Token id of each digit 0-9; fails clearly if a digit is not a single token."""
    ids = []
    for d in range(10):
        encoded = tokenizer(str(d), add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ValueError(f"toy task: tokenizer encodes digit {d} as {encoded}, "
                             "needs a single token per digit")
        ids.append(int(encoded[0]))
    return ids


def toy_reward(task: str, response: str, digit: str, max_new_tokens: int | None = None) -> float:
    """Score a decoded response for target ``digit`` (a one-character string)."""
    _check_task(task)
    if len(digit) != 1 or not digit.isdigit():
        raise ValueError(f"toy reward: ground truth {digit!r} is not a single digit")
    if task == "copy1":
        return 1.0 if response.startswith(digit) else 0.0
    length = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    return min(response.count(digit), length) / length


def cross_target(digit: str, shift: int = 1) -> str:
    """Another prompt's target: the digit ``shift`` places further (never ``digit`` itself)."""
    if shift % 10 == 0:
        raise ValueError("cross_target: shift must not be a multiple of 10")
    return str((int(digit) + shift) % 10)


def cross_reward(
    task: str, response: str, digit: str, max_new_tokens: int | None = None, shift: int = 1
) -> float:
    """The response scored against another prompt's target: a collapse baseline for tests."""
    return toy_reward(task, response, cross_target(digit, shift), max_new_tokens)


def load_toy_source(
    task: str, size: int, seed: int, tokenizer: Any, max_prompt_length: int | None = None,
    long_tail: float = 0.0, long_tail_tokens: int = 0,
) -> ListPromptSource:
    """``size`` prompts ``d=`` with digits drawn uniformly from ``seed``; prompts longer than
    ``max_prompt_length`` tokens are skipped and counted, as every loader does. A share
    ``long_tail`` of them asks for ``long_tail_tokens`` response tokens
    (``extra['max_new_tokens']``) instead of ``rollout.max_new_tokens``."""
    _check_task(task)
    if size <= 0:
        raise ValueError(f"task.size={size}: must be > 0")
    if not 0.0 <= long_tail <= 1.0:
        raise ValueError(f"task.long_tail={long_tail}: must be a share in [0, 1]")
    if long_tail and long_tail_tokens <= 0:
        raise ValueError(f"task.long_tail_tokens={long_tail_tokens}: must be > 0 with "
                         f"task.long_tail={long_tail}")
    digit_ids = digit_token_ids(tokenizer)
    eq_ids = list(tokenizer("=", add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)
    # Its own stream, so the digits stay those of the plain task with the same seed.
    tail_rng = random.Random(f"long_tail/{seed}")
    prompts = []
    counter = SkipCounter(origin=f"toy/{task}(seed={seed})")
    for i in range(size):
        d = rng.randrange(10)
        budget = {"max_new_tokens": long_tail_tokens} if tail_rng.random() < long_tail else {}
        ids = [digit_ids[d], *eq_ids]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            counter.skip(i, "prompt longer than max_prompt_length",
                         f"{len(ids)} > {max_prompt_length}")
            continue
        prompts.append(Prompt(
            index=len(prompts), prompt_ids=ids, data_source=DATA_SOURCE_PREFIX + task,
            ground_truth=str(d), extra={"task": task, "digit": d, **budget},
        ))
    counter.summarize()
    return ListPromptSource(prompts, name=f"toy/{task}", skipped=dict(counter.counts))
