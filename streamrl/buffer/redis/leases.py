"""Admission slots as leases: a holder in a process that dies without putting or cancelling (a
``streamrl serve`` that crashed; no supervisor watches it) must not keep its slots, else the
bound stays reached and every later client is refused forever.

Each claim sets its holder's lease (the ADMIT and PUT scripts: Redis time + ``lease_s``), and
the client's ``Heartbeat`` renews the leases of the holders it claimed for every third of
``lease_s`` (the LEASE script), from a daemon thread that dies with the process. The same script
reclaims the slots of every holder whose lease is not live; it runs on each heartbeat and from
a learner waiting in ``take`` (``RedisBuffer``), so the slots of a dead process come back about
``lease_s`` after its last heartbeat, each holder's reclaim counted (``reclaimed``) and logged
once, by the client whose script reclaimed it. A thread rather than the writer's event loop:
the sync calls have no loop, and a beat every few seconds costs nothing next to them. Depends on
nothing of streamrl.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long ``stop`` waits for a renewal in progress."""


class Heartbeat:
    """Calls ``beat(holders)`` every ``interval_s`` from a daemon thread, started by the first
    ``hold``: ``holders`` are the names held so far (``drop`` forgets one). A beat that fails
    (Redis unreachable) is logged once until one succeeds again."""

    def __init__(self, beat: Callable[[list[str]], object], interval_s: float,
                 name: str) -> None:
        self._beat = beat
        self.interval_s = interval_s
        self._name = name
        self._holders: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, holder: str) -> None:
        with self._lock:
            self._holders.add(holder)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def drop(self, holder: str) -> None:
        with self._lock:
            self._holders.discard(holder)

    def holders(self) -> list[str]:
        with self._lock:
            return sorted(self._holders)

    def stop(self) -> list[str]:
        """Stop beating; the holders it renewed (forgotten here)."""
        with self._lock:
            thread, self._thread = self._thread, None
            holders, self._holders = sorted(self._holders), set()
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            # A beat stuck in a Redis call must not hang close: the daemon thread dies with
            # the process, and the leases it renewed then expire on their own.
            thread.join(timeout=STOP_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s: a lease renewal still runs after %.0f s (Redis not answering); "
                            "closing without it", self._name, STOP_TIMEOUT_S)
        return holders

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.interval_s):
            try:
                self._beat(self.holders())
            except Exception:
                if not failing:
                    log.warning("%s: renewing the admission leases failed; retrying every "
                                "%.1f s", self._name, self.interval_s, exc_info=True)
                failing = True
                continue
            if failing:
                log.info("%s: admission leases renewed again", self._name)
            failing = False
