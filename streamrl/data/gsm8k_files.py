"""GSM8K-shaped parquet files generated offline (``streamrl data gsm8k --out DIR``).

No package ships GSM8K itself, so reasoning-gym's ``gsm_symbolic`` (GSM8K problems with their
numbers redrawn) stands in for it. ``write_gsm8k`` writes ``DIR/train.parquet`` and
``DIR/test.parquet`` in the schema verl's ``examples/data_preprocess/gsm8k.py`` writes, so a run
configured for verl's gsm8k files takes these unchanged (``task.source=parquet``, scored by
``rewards/gsm8k.py`` through ``data_source``):

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": answer}
    extra_info    {"split", "index", "answer": worked solution ending "#### answer", "question"}

The default sizes are GSM8K's (7,473 train, 1,319 test): generating both takes ~0.2 s. Train and
test come from different seeds, and no question appears twice in a file or in both files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from streamrl.data.reasoning_gym import INSTRUCTION
from streamrl.errors import ConfigError

DATA_SOURCE = "openai/gsm8k"
TEST_SEED_OFFSET = 1_000_003
"""The test split is drawn from ``seed + TEST_SEED_OFFSET`` (train from ``seed``)."""


def _problems(seed: int, count: int) -> Iterator[dict[str, Any]]:
    """gsm_symbolic entries from ``seed``; up to twice ``count`` of them (duplicates are
    dropped by the caller: ~1% of draws repeat a question)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=2 * count + 100, seed=seed)
    for i in range(len(dataset)):
        yield dataset[i]


def _worked_answer(entry: dict[str, Any]) -> str:
    """GSM8K's answer field: the worked solution, its last line ``#### <ground truth>``
    (gsm_symbolic's own last line sometimes reads ``#### 8.0`` for the answer ``8``)."""
    cot = str(entry.get("metadata", {}).get("answer_cot") or "")
    steps = cot.rsplit("####", 1)[0].rstrip()
    return f"{steps}\n#### {entry['answer']}" if steps else f"#### {entry['answer']}"


def gsm8k_rows(split: str, size: int, seed: int, exclude: Iterable[str] = ()
               ) -> list[dict[str, Any]]:
    """``size`` verl-gsm8k rows of ``split``, distinct questions, none of them in ``exclude``."""
    if size <= 0:
        raise ConfigError(f"--{split}-size={size}: must be > 0")
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    for entry in _problems(seed, size):
        question = entry["question"]
        if question in seen:
            continue
        seen.add(question)
        answer = str(entry["answer"])
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(rows), "answer": _worked_answer(entry),
                           "question": question},
        })
        if len(rows) == size:
            return rows
    raise ConfigError(f"--{split}-size={size}: gsm_symbolic gave only {len(rows)} distinct "
                      f"questions from seed {seed}")


def write_gsm8k(out_dir: str | Path, train_size: int = 7473, test_size: int = 1319,
                seed: int = 0) -> Path:
    """Write ``train.parquet`` and ``test.parquet`` into ``out_dir``; returns ``out_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    train = gsm8k_rows("train", train_size, seed)
    test = gsm8k_rows("test", test_size, seed + TEST_SEED_OFFSET,
                      exclude={row["extra_info"]["question"] for row in train})
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.replace(out / f"{name}.parquet")
    return out
