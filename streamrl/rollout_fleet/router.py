"""Router: spreads groups over N rollout engines, least-loaded first, around unhealthy ones.

Each ``generate`` call (one group: a prompt and its n samples) goes to the healthy engine with
the fewest calls in flight, ties broken round-robin so equal engines share work evenly. An
engine is taken out of rotation when its ``health()`` fails or times out, or after
``max_errors`` consecutive failed calls; after ``cooldown_s`` the next pick probes its health
and it rejoins if the probe passes. A failed call is retried on another engine up to
``max_retries`` times. When no engine is usable, ``NoHealthyEngineError`` says which engines
are down, why, and when each will be retried.

``lease()`` pins several calls to one engine (a multi-turn episode keeps its KV prefix there).
Depends only on the RolloutEngine protocol; single event loop (no locks needed: every state
change happens between awaits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


class NoHealthyEngineError(RuntimeError):
    """Every engine is down (or excluded after failing this request)."""


class RequestFailedError(RuntimeError):
    """A request failed on every engine it was tried on."""


@dataclass
class EngineState:
    engine: RolloutEngine
    in_flight: int = 0
    served: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    down_until: float | None = None
    """Monotonic time after which a down engine is probed again; None while it is up."""
    down_reason: str = ""
    probing: bool = False


class Router:
    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        *,
        max_errors: int = 2,
        cooldown_s: float = 10.0,
        health_timeout_s: float = 5.0,
        max_retries: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("Router needs at least one engine")
        if max_errors < 1:
            raise ValueError(f"Router max_errors={max_errors}: must be >= 1")
        self.states = [EngineState(e) for e in engines]
        self.max_errors = max_errors
        self.cooldown_s = cooldown_s
        self.health_timeout_s = health_timeout_s
        self.max_retries = max_retries
        self._clock = clock
        self._next = 0
        self._owner: dict[str, int] = {}

    # -- routing -------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        """Run one group on the least-loaded healthy engine, retrying elsewhere on failure."""
        tried: set[int] = set()
        last: Exception | None = None
        for _ in range(self.max_retries + 1):
            try:
                async with self.lease(exclude=tried) as (index, engine):
                    self._owner[request_id] = index
                    try:
                        return await engine.generate(prompt_ids, params, request_id)
                    finally:
                        self._owner.pop(request_id, None)
            except NoHealthyEngineError:
                if last is None:
                    raise
                break
            except Exception as exc:  # the engine failed this call: lease() recorded it
                tried.add(index)
                last = exc
        raise RequestFailedError(f"request {request_id!r} failed on engines {sorted(tried)}: "
                                 f"{type(last).__name__}: {last}") from last

    @contextlib.asynccontextmanager
    async def lease(
        self, exclude: set[int] | frozenset[int] = frozenset()
    ) -> AsyncIterator[tuple[int, RolloutEngine]]:
        """Hold the least-loaded healthy engine for the duration of the block.

        An exception out of the block counts as that engine's error (cancellation does not).
        """
        index = await self._pick(exclude)
        state = self.states[index]
        state.in_flight += 1
        try:
            yield index, state.engine
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._record_error(index, exc)
            raise
        else:
            state.served += 1
            state.consecutive_errors = 0
        finally:
            state.in_flight -= 1

    async def _pick(self, exclude: set[int] | frozenset[int]) -> int:
        now = self._clock()
        due = [i for i, s in enumerate(self.states)
               if s.down_until is not None and now >= s.down_until and not s.probing
               and i not in exclude]
        if due:
            await asyncio.gather(*(self._probe(i) for i in due))
        # no await from here to the caller's in_flight += 1: the choice cannot go stale
        up = [i for i, s in enumerate(self.states) if s.down_until is None and i not in exclude]
        if not up:
            raise NoHealthyEngineError(self._describe_down(exclude))
        least = min(self.states[i].in_flight for i in up)
        ties = [i for i in up if self.states[i].in_flight == least]
        choice = ties[self._next % len(ties)]
        self._next += 1
        return choice

    # -- health --------------------------------------------------------------------------------

    async def _probe(self, index: int) -> bool:
        state = self.states[index]
        state.probing = True
        try:
            ok = bool(await asyncio.wait_for(state.engine.health(), self.health_timeout_s))
            reason = "health() returned False"
        except Exception as exc:  # a timeout or a broken engine: both mean "not now"
            ok, reason = False, f"health() failed: {type(exc).__name__}: {exc}"
        finally:
            state.probing = False
        if ok:
            if state.down_until is not None:
                logger.info("engine #%d is healthy again", index)
            state.down_until, state.down_reason, state.consecutive_errors = None, "", 0
        else:
            self.mark_down(index, reason)
        return ok

    async def check_health(self) -> list[bool]:
        """Probe every engine now (e.g. periodically); unhealthy ones leave the rotation."""
        return list(await asyncio.gather(*(self._probe(i) for i in range(len(self.states)))))

    def mark_down(self, index: int, reason: str) -> None:
        state = self.states[index]
        if state.down_until is None:
            logger.warning("engine #%d marked down for %.1fs: %s", index, self.cooldown_s, reason)
        state.down_until = self._clock() + self.cooldown_s
        state.down_reason = reason

    def _record_error(self, index: int, exc: BaseException) -> None:
        state = self.states[index]
        state.errors += 1
        state.consecutive_errors += 1
        if state.consecutive_errors >= self.max_errors:
            self.mark_down(index, f"{state.consecutive_errors} consecutive errors, last: "
                                  f"{type(exc).__name__}: {exc}")

    def _describe_down(self, exclude: set[int] | frozenset[int]) -> str:
        now = self._clock()
        parts = []
        for i, s in enumerate(self.states):
            if s.down_until is not None:
                parts.append(f"#{i} down ({s.down_reason}; retried in "
                             f"{max(0.0, s.down_until - now):.1f}s)")
            elif i in exclude:
                parts.append(f"#{i} already failed this request")
        return f"no healthy rollout engine among {len(self.states)}: " + "; ".join(parts)

    # -- control -------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort a request on the engine running it (no-op if it is not running)."""
        index = self._owner.get(request_id)
        if index is not None:
            await self.states[index].engine.abort(request_id)

    def stats(self) -> list[dict[str, float | int | bool | str]]:
        return [
            {"engine": i, "in_flight": s.in_flight, "served": s.served, "errors": s.errors,
             "healthy": s.down_until is None, "down_reason": s.down_reason}
            for i, s in enumerate(self.states)
        ]
