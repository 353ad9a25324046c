"""Prompts, prompt sources and the resumable prompt stream.

Parts:
- ``Prompt``: one prompt, already tokenized (token-in/token-out from here on), with what its
  reward needs (``data_source``, ``ground_truth``, ``extra``) and the chat ``messages`` it was
  rendered from (None for plain-text prompts such as the toy task).
- ``PromptSource``: an immutable sequence of prompts (``__len__``/``__getitem__``);
  ``ListPromptSource`` is the one implementation every loader returns.
- ``SkipCounter``: bad rows are skipped, never fatal; it logs one line per skipped row (file,
  row, reason; the first ``LOG_FIRST`` per file, then a per-file summary) and keeps counts.
- ``PromptStream``: an endless, thread-safe, deterministic walk over a source. Epoch ``e`` is
  the permutation drawn from ``seed + e``; ``cursor`` counts prompts handed out so far, so a
  checkpoint that stores it resumes exactly where it left off.

Depends on nothing else in streamrl.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in its source: unique within the source, used as the group's prompt_index."""
    prompt_ids: list[int]
    data_source: str
    ground_truth: str | None
    extra: dict[str, Any]
    """Passed to reward functions as ``extra_info`` (verl's name)."""
    messages: list[dict[str, Any]] | None = None


class PromptSource(Sequence[Prompt]):
    """An immutable, indexable collection of prompts."""

    name: str = ""
    skipped: dict[str, int]
    """Rows skipped while loading, by reason."""


class ListPromptSource(PromptSource):
    def __init__(
        self, prompts: list[Prompt], name: str = "", skipped: dict[str, int] | None = None
    ) -> None:
        self._prompts = prompts
        self.name = name
        self.skipped = dict(skipped or {})

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Prompt:  # type: ignore[override]
        return self._prompts[i]

    def __repr__(self) -> str:
        return f"ListPromptSource({self.name!r}, {len(self)} prompts, skipped={self.skipped})"


@dataclass
class SkipCounter:
    """Counts and logs skipped rows of one input (a file or a generator)."""

    origin: str
    counts: Counter[str] = field(default_factory=Counter)

    LOG_FIRST = 10

    def skip(self, row: int, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if sum(self.counts.values()) <= self.LOG_FIRST:
            more = f" ({detail})" if detail else ""
            logger.warning("skipping %s row %d: %s%s", self.origin, row, reason, more)

    def summarize(self) -> None:
        total = sum(self.counts.values())
        if total > self.LOG_FIRST:
            logger.warning("skipped %d rows of %s in all: %s", total, self.origin,
                           dict(self.counts))


class PromptStream:
    """Endless deterministic prompt order over a source; ``cursor`` resumes it exactly."""

    def __init__(self, source: PromptSource, shuffle: bool, seed: int, cursor: int = 0) -> None:
        if len(source) == 0:
            raise ValueError(f"PromptStream: prompt source {source!r} is empty")
        if cursor < 0:
            raise ValueError(f"PromptStream: cursor={cursor} must be >= 0")
        self.source = source
        self.shuffle = shuffle
        self.seed = seed
        self._cursor = cursor
        self._lock = threading.Lock()
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def cursor(self) -> int:
        """Prompts handed out so far (over all epochs): save it, pass it back to resume."""
        with self._lock:
            return self._cursor

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._cursor // len(self.source)

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.source)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next(self) -> Prompt:
        with self._lock:
            epoch, pos = divmod(self._cursor, len(self.source))
            index = self._epoch_order(epoch)[pos]
            self._cursor += 1
        return self.source[index]

    def take(self, n: int) -> list[Prompt]:
        return [self.next() for _ in range(n)]
