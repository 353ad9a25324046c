"""An offline SFT data set for the toy task (``streamrl data sft-toy --out FILE``).

One parquet file serves both stages of "SFT, then GRPO": each row holds the chat ``messages``
``sft`` trains on (user ``d=``, assistant ``dddddddd``: the answer that scores 1.0 under the
toy reward) *and* the verl RL columns (``prompt`` without the answer, ``data_source``
``toy/<task>``, ``reward_model.ground_truth``, ``extra_info``), so ``streamrl train
task.source=parquet task.train_files=[FILE]`` samples the very prompts SFT saw, rendered by the
same chat template. (The built-in ``task.source=toy`` prompts are plain text, not chat: a
model tuned on chat turns would be tested on a format it never saw.)
"""

from __future__ import annotations

import random
from pathlib import Path

from streamrl.data import toy
from streamrl.errors import ConfigError


def toy_sft_rows(
    task: str, size: int, seed: int, max_new_tokens: int = toy.DEFAULT_MAX_NEW_TOKENS
) -> list[dict[str, object]]:
    """``size`` rows with digits drawn from ``seed``; every answer scores 1.0 for ``task``."""
    if task not in toy.TASKS:
        raise ConfigError(f"--task={task!r}: the toy task must be one of {list(toy.TASKS)}")
    if size <= 0:
        raise ConfigError(f"--size={size}: must be > 0")
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(size):
        digit = str(rng.randrange(10))
        prompt = [{"role": "user", "content": f"{digit}="}]
        rows.append({
            "messages": [*prompt, {"role": "assistant", "content": digit * max_new_tokens}],
            "prompt": prompt,
            "data_source": toy.DATA_SOURCE_PREFIX + task,
            "reward_model": {"ground_truth": digit, "style": "rule"},
            # No max_new_tokens here: the replica adds rollout.max_new_tokens (rep's length).
            "extra_info": {"task": task},
        })
    return rows


def write_toy_sft(
    out: str | Path, task: str = "rep", size: int = 512, seed: int = 0,
    max_new_tokens: int = toy.DEFAULT_MAX_NEW_TOKENS,
) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(toy_sft_rows(task, size, seed, max_new_tokens)), path)
    return path
