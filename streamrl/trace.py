"""A Chrome trace of a run (``trainer.trace=true``): open ``<output_dir>/trace.json`` in
Perfetto (ui.perfetto.dev) or chrome://tracing.

Two processes: "learner" (one track: take, prepare, update, publish of every step) and
"rollout" (a track per replica: each period with requests in its engine, "generate", and each
weight update). Spans are (name, wall-clock start, seconds); the file is rewritten every
``WRITE_EVERY`` steps and at the end, so a running or killed run still has a recent trace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

Span = tuple[str, float, float]
WRITE_EVERY = 10
PIDS = {"learner": 1, "rollout": 2}


class ChromeTrace:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for name, pid in PIDS.items()]
        self._tracks: dict[tuple[str, str], int] = {}
        self._steps = 0

    def add(self, process: str, track: str, spans: list[Span]) -> None:
        pid = PIDS[process]
        tid = self._tracks.get((process, track))
        if tid is None:
            tid = self._tracks[(process, track)] = len(self._tracks) + 1
            self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                "args": {"name": track}})
        self.events += [{"ph": "X", "name": name, "pid": pid, "tid": tid,
                         "ts": round(start * 1e6), "dur": round(seconds * 1e6)}
                        for name, start, seconds in spans]

    def step_done(self) -> None:
        self._steps += 1
        if self._steps % WRITE_EVERY == 0:
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)  # a reader never sees half a file
