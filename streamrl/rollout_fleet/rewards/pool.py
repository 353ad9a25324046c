"""RewardScorer: reward functions in worker processes, with a per-call timeout.

A reward function is user code: it may raise, hang, or return NaN. None of that may stall or
crash a replica, so every call runs in a worker process and

- an exception scores 0.0 (counted as ``failures``),
- a call running past ``reward.timeout_s`` scores 0.0 (``timeouts``); its worker is killed and
  replaced, so a hang never blocks later calls,
- a score is passed on as returned, finite or not: the replica drops a group whose reward is not
  finite in float32 (NaN, +-inf, 1e39), counting and logging it with the group's id.

Each kind logs one warning line with the cause the first time, then every
``LOG_EVERY``-th occurrence with the running count; ``metrics()`` has the exact counts.

Design: ``reward.num_workers`` slots, each a one-process ``ProcessPoolExecutor`` (forkserver
start method where available, else spawn: never fork a process that runs threads and torch).
A one-process executor per slot is what lets us kill exactly the hung worker and nothing else.
Calls queue; an idle worker takes what is queued (spread over the idle workers, at most
``MAX_BATCH``) and scores it in one call: a replica's responses finish in bursts, and one
round trip per response cost the replica's process more than most reward functions do. A batch
gets ``timeout_s`` as a whole; one that runs past it, or whose worker dies, is scored again one
response per call, so only a response whose own call runs past ``timeout_s`` (or crashes its
worker) scores 0. The timeout never counts time spent queueing; a fresh worker's start-up and
imports (``dispatch.warmup``) are likewise not charged to a call. The first workers start in
the constructor, so a custom reward file that does not load fails there with a clear error
instead of scoring everything 0.

Calls may come from any one event loop at a time (the replica's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

from streamrl.config import RewardConfig
from streamrl.rollout_fleet.rewards import dispatch
from streamrl.rollout_fleet.rewards.dispatch import Item, ScorerSpec, die_with_parent

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("failures", "timeouts")
LOG_EVERY = 100
MAX_BATCH = 64  # most responses one worker call scores

Result = tuple[float, dict[str, float]] | str  # (score, extras), or the failure kind


class _Call(NamedTuple):
    item: Item
    future: asyncio.Future[Result]


class RewardConfigError(ValueError):
    """The reward workers cannot start (e.g. the custom reward file does not load)."""


def _mp_context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Preloading the (light) dispatch module in the fork server makes replacement workers
        # start in milliseconds; the preload also ties the fork server's life to its parent's.
        # Ignored if the fork server is already running.
        ctx.set_forkserver_preload(["streamrl.rollout_fleet.rewards.fork_server"])
        return ctx
    return multiprocessing.get_context("spawn")


class _Worker:
    """One worker process behind a one-process executor."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, spec: ScorerSpec) -> None:
        self.executor = ProcessPoolExecutor(max_workers=1, mp_context=ctx,
                                            initializer=die_with_parent)
        self.ready: Future[int] = self.executor.submit(dispatch.warmup, spec)

    def kill(self) -> None:
        # The executor API cannot stop a running call; killing its only process can. The
        # executor then fails its futures with BrokenProcessPool and is dropped.
        for proc in list(getattr(self.executor, "_processes", {}).values()):
            with contextlib.suppress(OSError, ValueError):  # already gone
                proc.kill()
        self.executor.shutdown(wait=False, cancel_futures=True)


class RewardScorer:
    """Scores responses with the reward ``cfg`` selects; see the module docstring."""

    def __init__(self, cfg: RewardConfig, *, sources: tuple[str, ...] = (),
                 start_timeout_s: float = 120.0) -> None:
        if cfg.num_workers < 1:
            raise ValueError(f"reward.num_workers={cfg.num_workers}: must be >= 1")
        if cfg.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={cfg.timeout_s}: must be > 0")
        if cfg.name not in dispatch.NAMES:
            raise ValueError(f"reward.name={cfg.name!r}: must be one of {dispatch.NAMES}")
        if cfg.name == "custom" and not cfg.custom_path:
            raise ValueError("reward.custom_path: required with reward.name=custom")
        self.cfg = cfg
        self.spec = ScorerSpec(cfg.name, cfg.custom_path, cfg.custom_name, sources)
        self._ctx = _mp_context()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._extra_sum: Counter[str] = Counter()
        self._extra_n: Counter[str] = Counter()
        self._idle = [_Worker(self._ctx, self.spec) for _ in range(cfg.num_workers)]
        self._waiting: deque[_Call] = deque()
        self._serving: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatch_scheduled = False
        self._in_flight = 0
        self._closed = False
        for worker in self._idle:
            try:
                worker.ready.result(timeout=start_timeout_s)
            except Exception as exc:
                self.close()
                raise RewardConfigError(f"reward workers failed to start ({self.spec}): "
                                        f"{type(exc).__name__}: {exc}") from exc

    # -- scoring -----------------------------------------------------------------------------

    async def score(
        self, data_source: str, solution_str: str, ground_truth: str | None,
        extra_info: dict[str, Any],
    ) -> float:
        """The reward of one response; 0.0 (and counted) on failure or timeout."""
        score, _ = await self.score_with_info(data_source, solution_str, ground_truth, extra_info)
        return score

    async def score_with_info(
        self, data_source: str, solution_str: str, ground_truth: str | None,
        extra_info: dict[str, Any],
    ) -> tuple[float, dict[str, float]]:
        """Like ``score``, plus the extra numeric keys a dict-returning function gave."""
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        loop = self._bind(asyncio.get_running_loop())
        with self._lock:
            self._counts["calls"] += 1
        future: asyncio.Future[Result] = loop.create_future()
        self._waiting.append(_Call((data_source, solution_str, ground_truth, extra_info), future))
        if not self._dispatch_scheduled:  # after this loop turn: the burst's calls go together
            self._dispatch_scheduled = True
            loop.call_soon(self._dispatch)
        self._in_flight += 1
        try:
            result = await future
        finally:
            self._in_flight -= 1
        if isinstance(result, str):  # a failure kind
            return 0.0, {}
        score, extras = result
        with self._lock:
            for key, value in extras.items():
                self._extra_sum[key] += value
                self._extra_n[key] += 1
        return score, extras

    def _bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        if self._loop is not loop:
            if self._in_flight:
                raise RuntimeError("RewardScorer: called from a second event loop while calls "
                                   "from another are in flight")
            self._loop, self._dispatch_scheduled = loop, False
        return loop

    def _dispatch(self) -> None:
        """Hand the queued calls to the idle workers, spread evenly, one batch each."""
        self._dispatch_scheduled = False
        while self._idle and self._waiting and not self._closed:
            size = min(MAX_BATCH, -(-len(self._waiting) // len(self._idle)))
            batch = []
            while self._waiting and len(batch) < size:
                call = self._waiting.popleft()
                if not call.future.done():  # its caller was cancelled while it queued
                    batch.append(call)
            if batch:
                assert self._loop is not None
                task = self._loop.create_task(self._serve(self._idle.pop(), batch))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)

    async def _serve(self, worker: _Worker, batch: list[_Call]) -> None:
        try:
            worker, results = await self._run(worker, [call.item for call in batch])
            if results is None:  # the batch as a whole failed: one response per call
                results = []
                for call in batch:
                    worker, one = await self._run(worker, [call.item])
                    assert one is not None
                    results.extend(one)
            for call, result in zip(batch, results, strict=True):
                if not call.future.done():
                    call.future.set_result(result)
        except BaseException as exc:  # the loop going away, or a bug: no caller waits forever
            worker = self._replace(worker)  # its call may still run: never give it another
            for call in batch:
                if call.future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    call.future.cancel()
                else:
                    call.future.set_exception(exc)
            raise
        finally:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
                self._dispatch()

    async def _run(self, worker: _Worker, items: list[Item]
                   ) -> tuple[_Worker, list[Result] | None]:
        """Score ``items`` in one call on ``worker``: the (possibly replaced) worker and each
        item's result (its failure kind for one that raised). None when a call of several ran
        past ``timeout_s`` or killed its worker: its items are then scored one by one."""
        try:
            await asyncio.wrap_future(worker.ready)
        except Exception as exc:
            cause = f"worker start: {exc!r}"
            return self._replace(worker), [self._record("failures", cause) for _ in items]
        future = worker.executor.submit(dispatch.score_batch_in_worker, self.spec, items)
        source = items[0][0]
        try:
            outcomes = await asyncio.wait_for(asyncio.wrap_future(future), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            worker = self._replace(worker)
            return worker, None if len(items) > 1 else [self._record(
                "timeouts", f"{source}: no result after {self.cfg.timeout_s}s, worker replaced")]
        except BrokenProcessPool as exc:
            worker = self._replace(worker)
            return worker, None if len(items) > 1 else [
                self._record("failures", f"{source}: worker died: {exc}")]
        except Exception as exc:  # e.g. an argument that does not pickle
            return worker, None if len(items) > 1 else [
                self._record("failures", f"{source}: {type(exc).__name__}: {exc}")]
        return worker, [outcome if isinstance(outcome, tuple)
                        else self._record("failures", f"{item[0]}: {outcome}")
                        for item, outcome in zip(items, outcomes, strict=True)]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        return _Worker(self._ctx, self.spec)

    def _record(self, kind: str, cause: str) -> str:
        with self._lock:
            self._counts[kind] += 1
            n = self._counts[kind]
        if n == 1 or n % LOG_EVERY == 0:
            logger.warning("reward %s #%d (scored 0.0; reward.name=%s): %s", kind, n,
                           self.cfg.name, cause)
        return kind

    # -- reporting and lifetime --------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counts since start (calls, failures, timeouts) and extra-key means."""
        with self._lock:
            out = {k: float(self._counts[k]) for k in ("calls", *FAILURE_KINDS)}
            for key, total in self._extra_sum.items():
                out[f"extra/{key}"] = total / self._extra_n[key]
        return out

    def close(self) -> None:
        """Stop the worker processes (a running call is killed, not waited for); calls still
        queued fail with an error saying so."""
        self._closed = True
        for worker in self._idle:
            worker.kill()
        self._idle = []
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_waiting)

    def _fail_waiting(self) -> None:
        while self._waiting:
            call = self._waiting.popleft()
            if not call.future.done():
                call.future.set_exception(RuntimeError("RewardScorer is closed"))

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

