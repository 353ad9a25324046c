"""WeightedScorer: the weighted sum of several reward kinds (``reward.kind=[rule,model]``).

Each part scores the response concurrently; the reward is ``sum(weight * part score)``. A
part's failure already scores that part 0 (and is counted by the part), so the others still
count; a part's non-finite score (or a sum past float32) is passed on, and the replica drops
the group. ``metrics()`` has each part's counts under ``<kind>/``, and ``calls`` plus the failure
kinds summed over parts under their plain names, as the replica reads them from one scorer.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Protocol


class Part(Protocol):
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class WeightedScorer:
    def __init__(self, parts: list[tuple[str, float, Part]]) -> None:
        """``parts``: (kind, weight, scorer) in ``reward.kind`` order."""
        self.parts = parts
        self._calls = 0

    async def score(
        self, data_source: str, solution_str: str, ground_truth: str | None,
        extra_info: dict[str, Any],
    ) -> float:
        self._calls += 1
        scores = await asyncio.gather(*(
            part.score(data_source, solution_str, ground_truth, extra_info)
            for _, _, part in self.parts))
        return sum(weight * float(s) for (_, weight, _), s in zip(self.parts, scores, strict=True))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"calls": float(self._calls)}
        totals: Counter[str] = Counter()
        for kind, _, part in self.parts:
            for key, value in part.metrics().items():
                out[f"{kind}/{key}"] = value
                if key != "calls" and not key.startswith("extra/"):
                    totals[key] += value
        out.update(totals)
        return out

    def close(self) -> None:
        for _, _, part in self.parts:
            part.close()
