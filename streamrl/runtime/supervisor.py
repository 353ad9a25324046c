"""Replica supervision: a dead or hung replica is noticed within seconds, the admissions it held
are given back, and it is re-created; when it cannot be, the run stops naming it and the cause.

A thread in the driver checks every replica each ``runtime.heartbeat_s`` (``ReplicaActor
.health``). A replica is replaced when:

- its actor died (Ray raises ``RayActorError`` for the call: kill -9, OOM, a crash),
- its engine core died (``health`` reports the engine unhealthy),
- it is hung: it has not answered its heartbeat, or has held requests in flight without one
  finishing, for ``runtime.stall_timeout_s``.

Replacing: kill the actor (a hung one must not put late), ``buffer.release`` its holder (exactly
the slots that incarnation held: the staleness accounting stays exact) and give back its rolling
swap token if it held one (it swaps no more, so the others' turns come), then, after a backoff,
start a new incarnation in the same placement bundle, resume its prompt cursor, wait until the
weight bus has given it the current weights (the publisher's late-joiner catch-up) and start its
loop. Each replica may be re-created ``runtime.max_restarts`` times; past that, or when creating
it fails that often, ``failure`` names the replica and the cause and the controller stops.

The learner is not watched here: a call to a dead rank raises ``LearnerDied`` in the controller,
which restarts the ranks from the last checkpoint (``LearnerGroup.restart``: new ranks in the
same bundles, the running replicas joined to their new bus) ``runtime.max_restarts`` times.

Depends on the buffer protocol and Ray; the controller sees it only through ``Fleet``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from streamrl.buffer.base import BufferConsumer
from streamrl.buffer.remote import RemoteBuffer
from streamrl.config import Config
from streamrl.errors import RunStopped

log = logging.getLogger(__name__)
BACKOFF_CAP_S = 30.0
START_TIMEOUT_S = 600.0
"""Longest a new incarnation may take to set up (engine start-up, model load)."""


class LearnerDied(RunStopped):
    """A learner rank died: the controller restarts the ranks from the last checkpoint
    (``runtime.max_restarts`` times), else the run stops with this message."""


def holder_name(index: int, incarnation: int) -> str:
    return f"replica-{index}.{incarnation}"


def shut_down(actor: Any, name: str, timeout: float) -> None:
    """Ask ``actor`` to shut down (``timeout``), then kill it; a dead or stuck actor is only
    logged, so it never stops the clean-up of the others."""
    try:
        ray.get(actor.shutdown.remote(), timeout=timeout)
    except Exception as exc:
        log.warning("%s: shutdown failed: %s", name, first_line(exc))
    ray.kill(actor)


@dataclass
class Member:
    """One replica position of the fleet and the incarnation that fills it now."""

    index: int
    actor: Any
    incarnation: int = 0
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    """Its prompt cursor as of the last heartbeat (a replacement resumes there)."""
    silent_since: float | None = None
    live: bool = True

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def holder(self) -> str:
        return holder_name(self.index, self.incarnation)


Spawn = Callable[[int, str], Any]
"""(replica index, holder) -> a new ReplicaActor handle, placed in that replica's bundle."""
NOT_RECREATED = ("a co-located hybrid worker holds a learner rank and is not re-created: "
                 "trainer.resume=auto continues from the last checkpoint")


class Supervisor:
    def __init__(self, cfg: Config, members: list[Member], buffer: BufferConsumer,
                 spawn: Spawn | None, loops: bool, lock: threading.RLock,
                 swap_tokens: Any = None) -> None:
        """``spawn`` None: members are never re-created (hybrid workers); the first death
        stops the run. ``swap_tokens``: the rolling update's tokens actor
        (``actors.start_swap_tokens``), where a replacement gives back the dead one's turn."""
        self.cfg = cfg
        self.swap_tokens = swap_tokens
        self.members = members
        self.buffer = buffer
        self.spawn = spawn
        self.loops = loops
        self.lock = lock  # shared with Fleet: a member is swapped while no call uses it
        self.failure: str | None = None
        self.restarts = 0
        self.released = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="replica-supervisor",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.runtime.heartbeat_s + 60)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.runtime.heartbeat_s):
            self._probe_buffer()
            for member in list(self.members):
                if self._stop.is_set():
                    return
                if not member.live:
                    continue
                cause = self.probe(member)
                if cause is not None:
                    self.replace(member, cause)

    def _probe_buffer(self) -> None:
        """A call to the memory buffer actor each heartbeat: if it died, this call re-creates
        it (``RemoteBuffer``), so the replicas waiting to re-attach wait a heartbeat, not until
        the controller's next call, which may be a long learner step away."""
        if not isinstance(self.buffer, RemoteBuffer) or self.failure is not None:
            return
        try:
            self.buffer.stats()
        except RunStopped as exc:  # its re-creations are used up
            self.failure = str(exc)
            log.error("%s", self.failure)

    def probe(self, member: Member) -> str | None:
        """None if ``member`` is healthy, else why it must be replaced."""
        rt = self.cfg.runtime
        try:
            health = ray.get(member.actor.health.remote(), timeout=rt.heartbeat_s)
        except RayActorError as exc:
            return f"its actor died ({first_line(exc)})"
        except GetTimeoutError:
            now = time.monotonic()
            member.silent_since = member.silent_since or now
            if now - member.silent_since >= rt.stall_timeout_s:
                return (f"it answered no heartbeat for {now - member.silent_since:.0f} s "
                        f"(runtime.stall_timeout_s={rt.stall_timeout_s})")
            return None
        member.silent_since = None
        member.state = dict(health["state"])
        if not health["engine_ok"]:
            return "its engine core died"
        if health["stalled_s"] >= rt.stall_timeout_s:
            return (f"it held requests for {health['stalled_s']:.0f} s without finishing one "
                    f"(runtime.stall_timeout_s={rt.stall_timeout_s})")
        return None

    def replace(self, member: Member, cause: str) -> None:
        """Kill ``member``'s incarnation, give back its admissions, and re-create it."""
        rt = self.cfg.runtime
        with self.lock:
            member.live = False
        ray.kill(member.actor, no_restart=True)
        released = self.buffer.release(member.holder)
        self.released += released
        log.error("%s: %s; %d admission(s) it held given back", member.name, cause, released)
        if self.swap_tokens is not None:  # a dead replica samples nothing: its turn is over
            try:
                ray.get(self.swap_tokens.give_back.remote(member.name), timeout=60)
            except Exception as exc:  # its incarnation's first load takes it over instead
                log.warning("%s: giving back its swap token failed: %s", member.name,
                            first_line(exc))
        if self.spawn is None:
            self.failure = f"{member.name} {cause}; {NOT_RECREATED}"
            log.error("%s", self.failure)
            return
        while member.restarts < rt.max_restarts and not self._stop.is_set():
            member.restarts += 1
            self.restarts += 1
            backoff = min(BACKOFF_CAP_S, 2.0 ** (member.restarts - 1))
            log.warning("%s: re-creating it in %.0f s (restart %d of runtime.max_restarts=%d)",
                        member.name, backoff, member.restarts, rt.max_restarts)
            if self._stop.wait(backoff):
                return
            try:
                actor = self._start(member)
            except Exception as exc:
                cause = f"re-creating it failed: {first_line(exc)}"
                log.error("%s: %s", member.name, cause)
                continue
            with self.lock:
                member.actor, member.live = actor, True
            log.warning("%s: re-created (incarnation %d) and producing again", member.name,
                        member.incarnation)
            return
        if not self._stop.is_set():
            self.failure = (f"{member.name} {cause}, and runtime.max_restarts={rt.max_restarts} "
                            "re-creations are used up")
            log.error("%s", self.failure)

    def _start(self, member: Member) -> Any:
        """A new incarnation of ``member``: set up, at the current weights, loop started."""
        member.incarnation += 1
        assert self.spawn is not None
        actor = self.spawn(member.index, member.holder)
        try:
            try:
                ray.get(actor.setup.remote(), timeout=START_TIMEOUT_S)
            except GetTimeoutError:
                raise TimeoutError(f"it did not set up within {START_TIMEOUT_S:.0f} s") from None
            if member.state:
                ray.get(actor.load_state.remote(member.state), timeout=60)
            self._wait_for_weights(actor, member)
            if self.loops:
                ray.get(actor.start.remote(), timeout=60)
        except BaseException:
            ray.kill(actor, no_restart=True)
            self.released += self.buffer.release(member.holder)  # if its loop had started
            raise
        return actor

    def _wait_for_weights(self, actor: Any, member: Member) -> None:
        """Until the new incarnation serves the newest published weights (at most
        ``weight_bus.timeout_s``): groups sampled from older ones would be dropped as stale."""
        every = self.cfg.weight_bus.sync_every
        published = self.buffer.stats().learner_version // every * every
        deadline = time.monotonic() + self.cfg.weight_bus.timeout_s
        while (version := int(ray.get(actor.version.remote(), timeout=60))) < published:
            # Behind until a catch-up (the learner waiting for groups) or the next publish.
            if time.monotonic() > deadline:
                log.warning("%s: still at weight version %d, the learner published %d; "
                            "starting it anyway (its first groups may be dropped as stale)",
                            member.name, version, published)
                return
            time.sleep(0.2)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
