"""verl-format parquet prompt files, loaded as they are.

Columns (verl's data preprocessing scripts write them): ``prompt`` (a list of chat messages
``{role, content}``), ``data_source``, ``reward_model`` (``{ground_truth, style}``) and
``extra_info`` (a dict handed to reward functions). Other columns (``ability``, ...) are ignored.
Each prompt is rendered with the tokenizer's chat template and ``add_generation_prompt=True``,
then tokenized without adding special tokens again (as verl does).

A bad row (no prompt, a prompt longer than ``max_prompt_length`` tokens, a missing or non-string
ground truth, unreadable fields) is skipped with a log line naming file, row and reason. A bad
file (missing, not parquet, without one of the columns above) is a ``ConfigError`` naming the
config key and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamrl.data.base import ListPromptSource, Prompt, SkipCounter
from streamrl.errors import ConfigError

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


def _check_messages(value: Any) -> str | None:
    """Why ``value`` is not a usable list of chat messages (None if it is)."""
    if value is None:
        return "missing prompt"
    if not isinstance(value, list) or not value:
        return "prompt is not a non-empty list of chat messages"
    for msg in value:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(
            msg.get("content"), str
        ):
            return "prompt message without string role/content"
    return None


def _row_to_prompt(
    row: dict[str, Any], index: int, tokenizer: Any, max_prompt_length: int
) -> tuple[Prompt | None, str, str]:
    """Return (prompt, "", "") or (None, reason, detail)."""
    messages = row.get("prompt")
    why = _check_messages(messages)
    if why:
        return None, why, ""
    reward_model = row.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if ground_truth is None:
        return None, "missing reward_model.ground_truth", ""
    if not isinstance(ground_truth, str):
        return None, "non-string reward_model.ground_truth", f"{type(ground_truth).__name__}"
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        return None, "missing data_source", ""
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        return None, "extra_info is not a dict", f"{type(extra).__name__}"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) > max_prompt_length:
        return None, "prompt longer than max_prompt_length", f"{len(ids)} > {max_prompt_length}"
    prompt = Prompt(index=index, prompt_ids=ids, data_source=data_source,
                    ground_truth=ground_truth, extra=dict(extra), messages=list(messages))
    return prompt, "", ""


def load_parquet_source(
    files: tuple[str, ...] | list[str], tokenizer: Any, max_prompt_length: int,
    key: str = "task.train_files",
) -> ListPromptSource:
    """Load and tokenize verl-format parquet files into one prompt source (file order kept);
    ``key`` is the config key that named the files, for error messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts: list[Prompt] = []
    skipped: dict[str, int] = {}
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"{key}: parquet file {file!r} does not exist (GSM8K-style files "
                              "in verl's schema: `streamrl data gsm8k --out DIR`)")
        try:
            table = pq.read_table(path)
        except pa.ArrowException as exc:
            raise ConfigError(f"{key}: {file!r} is not a readable parquet file: {exc}") from exc
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise ConfigError(f"{key}: {file!r} lacks the column(s) {', '.join(missing)} (has "
                              f"{', '.join(table.column_names)}): verl-format files need "
                              f"{', '.join(REQUIRED_COLUMNS)}")
        counter = SkipCounter(origin=str(path))
        for row_number, row in enumerate(table.to_pylist()):
            prompt, reason, detail = _row_to_prompt(row, len(prompts), tokenizer,
                                                    max_prompt_length)
            if prompt is None:
                counter.skip(row_number, reason, detail)
            else:
                prompts.append(prompt)
        counter.summarize()
        for reason, count in counter.counts.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return ListPromptSource(prompts, name=",".join(str(f) for f in files), skipped=skipped)
