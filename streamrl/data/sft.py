"""SFT conversations from verl-format parquet, tokenized with a loss mask on assistant tokens.

Columns: ``messages`` (verl's multi-turn SFT dataset: a list of ``{role, content}`` per row),
or, in a file without it, ``prompt`` + ``response`` (single turn: the prompt is a user text or
a list of chat messages, the response the assistant's text). The column names are
``data.messages_key`` / ``data.prompt_key`` / ``data.response_key``.

Which tokens are trained on (``assistant_token_mask``): the conversation is rendered with the
tokenizer's chat template and tokenized; for each assistant message ``i`` the tokens between
``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` are its own
(content and end-of-turn marker; the role header comes from the generation prompt, as at
inference, and is not trained on). This needs a template that only *appends* when a message
is added; one that rewrites earlier turns (e.g. dropping past ``<think>`` blocks) breaks the
prefix property and loading fails with a ``ConfigError`` naming the file and row: the
assistant's tokens cannot be told apart there.

A bad row (messages not a list of string role/content, no assistant message, longer than
``max_length`` tokens) is skipped with a log line (file, row, reason), as prompt loaders do. A
bad file (missing, not parquet, without the columns, a column of the wrong type) or a file set
without one usable conversation is a ``ConfigError`` naming the key, the file and the column.
Depends on data.base and errors only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrl.data.base import SkipCounter
from streamrl.errors import ConfigError


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]
    """1 where the token is an assistant token the loss is taken on."""


class TemplateSplitError(ValueError):
    """The chat template does not render a conversation turn by turn (see module docstring)."""


def _ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_token_mask(
    messages: list[dict[str, Any]], tokenizer: Any
) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 1 on each assistant message's own tokens)."""
    ids = _ids(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], generation_prompt=True)
        upto = _ids(tokenizer, messages[: i + 1], generation_prompt=False)
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            raise TemplateSplitError(
                f"the chat template does not render messages[:{i}] plus the generation prompt "
                f"as a token prefix of messages[:{i + 1}] and of the whole conversation")
        mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
    return ids, mask


def _messages_of(row: dict[str, Any], keys: tuple[str, str, str]) -> list[dict[str, Any]] | str:
    """The row's conversation, or why it is unusable."""
    messages_key, prompt_key, response_key = keys
    if messages_key in row:
        messages = row[messages_key]
    else:
        prompt, response = row.get(prompt_key), row.get(response_key)
        if not isinstance(response, str):
            return f"{response_key} is not a string"
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*(turns or []), {"role": "assistant", "content": response}]
    if not isinstance(messages, list) or not messages:
        return "not a non-empty list of chat messages"
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            return "a message without string role/content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message"
    # Only role and content: parquet gives every struct field of the column (None if unset).
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_columns(table: Any, file: str, key: str, keys: tuple[str, str, str]) -> None:
    import pyarrow as pa

    messages_key, prompt_key, response_key = keys
    names = table.column_names
    if messages_key in names:
        kind = table.schema.field(messages_key).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ConfigError(f"{key}: {file!r} column {messages_key!r} is {kind}, not a list "
                              "of {role, content} chat messages")
        return
    if prompt_key in names and response_key in names:
        kind = table.schema.field(response_key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(f"{key}: {file!r} column {response_key!r} is {kind}, not text")
        return
    raise ConfigError(f"{key}: {file!r} has neither a {messages_key!r} column nor "
                      f"{prompt_key!r} + {response_key!r} columns (has {', '.join(names)}): "
                      "set data.messages_key, or data.prompt_key and data.response_key")


def load_sft_examples(
    files: Sequence[str],
    tokenizer: Any,
    max_length: int,
    *,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
    key: str = "data.train_files",
) -> list[SFTExample]:
    """Every usable conversation of ``files`` (in file order), tokenized and masked; ``key``
    is the config key that named the files, for error messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = (messages_key, prompt_key, response_key)
    examples: list[SFTExample] = []
    skipped: dict[str, int] = {}
    for file in files:
        if not Path(file).is_file():
            raise ConfigError(f"{key}: parquet file {file!r} does not exist")
        try:
            table = pq.read_table(file)
        except pa.ArrowException as exc:
            raise ConfigError(f"{key}: {file!r} is not a readable parquet file: {exc}") from exc
        _check_columns(table, file, key, keys)
        counter = SkipCounter(origin=file)
        for row_number, row in enumerate(table.to_pylist()):
            messages = _messages_of(row, keys)
            if isinstance(messages, str):
                counter.skip(row_number, messages)
                continue
            try:
                ids, mask = assistant_token_mask(messages, tokenizer)
            except TemplateSplitError as exc:
                raise ConfigError(f"{key}: {file!r} row {row_number}: {exc}, so the assistant's "
                                  "tokens cannot be told apart") from exc
            if len(ids) > max_length:
                counter.skip(row_number, "longer than data.max_length",
                             f"{len(ids)} > {max_length}")
            elif sum(mask) == 0:
                counter.skip(row_number, "no assistant token")
            else:
                examples.append(SFTExample(ids, mask))
        counter.summarize()
        for reason, count in counter.counts.items():
            skipped[reason] = skipped.get(reason, 0) + count
    if not examples:
        raise ConfigError(f"{key}: no usable conversation in {', '.join(files)} "
                          f"(skipped: {skipped})")
    return examples


def collate(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask``, each [n, longest]."""
    width = max(len(e.input_ids) for e in examples)
    out = {name: torch.zeros(len(examples), width, dtype=torch.long)
           for name in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"].fill_(pad_token_id)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        out["input_ids"][row, :n] = torch.tensor(example.input_ids)
        out["attention_mask"][row, :n] = 1
        out["loss_mask"][row, :n] = torch.tensor(example.loss_mask)
    return out
