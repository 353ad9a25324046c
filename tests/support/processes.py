"""Commands run as child processes by end-to-end tests: started in a session of their own and
killed with all their processes at the end, and a bounded wait that shows the log on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``args`` in a process group of its own, its output appended to ``log``; the group is
    killed if still running when the block ends."""
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, log: Path, *,
             transient: tuple[type[Exception], ...] = (),
             proc: subprocess.Popen[bytes] | None = None) -> Any:
    """Poll ``predicate`` until it is truthy and return its value; ``transient`` errors count as
    not yet (a server still starting). Past ``timeout`` seconds, or as soon as ``proc`` (the
    process that should bring it about) has exited: an error with the log's tail."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if value := predicate():
                return value
        except transient:
            pass
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) before; log "
                                 f"tail:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s; log tail:\n{_tail(log)}")
        time.sleep(0.2)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""
