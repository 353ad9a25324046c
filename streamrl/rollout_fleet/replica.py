"""Replica: one engine sampling groups continuously into the replay buffer (DESIGN.md §5).

The loop, on one asyncio event loop::

    while running:
        wait for a free slot (at most rollout.max_inflight_groups groups in flight, so the
        engine batches continuously) and for no drain in progress
        a slot a put claimed, or buffer.admit_up_to(free slots, a replica's share of them)
                                                       none -> back off (the bound, §2)
        hold it while weights the bus received are not loaded yet (``weights_pending``)
        prompt = a saved group (``resume``) first, else prompts.next()
        start a group task: sample n -> decode -> score -> Trajectories -> put
                   or, with rollout.agent: run n episodes (agent/loop.py) -> put
        put: buffer.put_and_admit(Group): the put and the next group's admission in one call

DAPO shaping, all off by default (``algorithm=dapo`` turns on the first two):

- overlong punishment (``rollout.overlong_buffer``): each trajectory's reward gets
  ``overlong_penalty(length, budget, ...)`` added as it is scored;
- dynamic sampling (``rollout.filter_groups``): a group whose rewards are all equal (advantage 0
  for every member) is not put; its admission is given back like a failed group's and counted
  (``groups_filtered``), and the loop, finding the slot free, admits another group in its place:
  the replicas oversample until the learner has ``train_batch_size`` informative groups, and
  ``started == consumed + queued + in_flight`` stays exact;
- overlong filtering (``rollout.overlong_filter``): a response cut at the budget
  (finish_reason ``length``) gets loss_mask 0; it stays in its group for the baseline.

ReMax (``rollout.greedy_baseline``, set by ``algorithm=remax``): beside the n samples, one greedy
response to the same prompt is sampled and scored the same way; its reward travels in the group
(``Group.baseline_reward``) for the advantage, and the response itself is not trained on.

Agent groups: each of the n samples is one multi-turn episode; the environment scores it (the
scorer is not used). Every turn's request goes through the same request machinery as a
single-turn group (``_sample_with_retries``: retries, the abort gate, resumption), so an episode
survives ``pause`` and ``abort`` updates with exact per-token versions, and an episode whose
environment raises fails its group like a failed request does.

A group task retries a failed request up to ``rollout.max_retries`` times; a group that still
fails, or whose building fails, is counted and its admission given back
(``buffer.cancel_admission``): nothing a request, a reward function or a bad prompt does stops
the replica. A reward function that raises scores 0 and is counted (the pool in ``rewards/``
already does this; the replica guards any scorer). A reward that is not finite in float32 (NaN,
+-inf, or 1e39, which the learner's float32 tensors would hold as inf) is no reward at all: its
group is dropped, counted (``groups_bad_reward``) and logged in one line naming the group, the
prompt, its data source and the value, and its admission given back, as a failed group's is.

Weight updates (``update_weights(weights, version, policy)``), atomic in every case because
``engine.load_weights`` swaps between two engine steps:

- ``drain``: start no new group, wait for the in-flight ones, swap, continue.
- ``pause``: ``engine.pause`` (requests freeze), swap, ``engine.resume``: in-flight requests
  continue on the new weights; their later tokens carry the new version.
- ``abort``: abort every in-flight request, swap, resubmit prompt + partial response with the
  remaining token budget and concatenate. No sampled token is lost; the partial tokens keep
  their versions and log-probs.
- ``rolling``: ``pause`` in turns: wait for one of the fleet's ``SwapTokens`` (at most k
  replicas swap at once), pause only this engine, swap, resume, give the token back; the other
  replicas keep sampling. Until its swap is done the replica starts no group and claims no
  slot (``swapping``), so a replica still on version V-1 never starts a group for V.

With ``weight_bus.receive=streamed`` the weights handed to ``update_weights`` are not received
yet: the swap itself receives them, bucket by bucket, after the policy paused, aborted or
drained (the broadcast waits meanwhile; config.py refuses ``rolling``). A swap that fails
partway leaves the engine paused until a whole version is loaded (the engine refuses
``resume``), so no token is sampled from a half-new model.

The buffer is awaited, never blocked on (``aadmit_up_to``, ``aput_and_admit``, ``aput``,
``acancel_admission``), so streaming requests and weight updates go on during its round trips. A
put or give-back is under way before the first await, and a group settles its admission with
exactly one of them, so a cancelled group can never be both put and given back. A put also
claims the slot of the loop's next group (``put_and_admit``: one round trip instead of two with
Redis); a claimed slot no group will use (the replica stops) is given back, like any other.

Partial rollouts (partials.py, docs/partials.md): each group in flight records its samples as
of every return of their requests. ``snapshot()`` aborts the requests (under the update lock,
as an ``abort`` update does), waits for them to come back with their tokens, reads the groups
and the prompt cursor in one step, and resumes the requests (a checkpoint keeps it; a flush
every ``partial_flush_s`` saves it to the ``partials`` store); ``stop(save=True)`` aborts them
for good and saves what came back to the store. ``resume(groups)`` makes a new replica
continue saved samples as an ``abort`` update's are continued, before any new prompt, dropping
those too stale to train.

Metrics: counters (``ReplicaCounters``), ``busy_s`` (wall time with a request in the engine:
what ``rollouter/idle_ratio`` is made of) and, with ``trace``, the spans a Chrome trace shows
(``drain_spans``): each busy period ("generate") and each weight update.

Dependencies: engine.py (protocol), buffer/base.py (protocol), agent/ (episodes), partials.py,
types.py, config.py, and duck-typed prompt stream (``next() -> Prompt``, ``cursor``), scorer
(``await score(...)``) and tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

from streamrl.buffer.base import BufferProducer
from streamrl.config import UPDATE_POLICIES, RolloutConfig
from streamrl.rollout_fleet.agent import Episode, make_agent, run_episode
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams, TokenSink
from streamrl.rollout_fleet.partials import (
    PartialGroup,
    PartialSample,
    PartialSnapshot,
    PartialStore,
    snapshot_of,
    usable,
)
from streamrl.rollout_fleet.rewards.prompt import scoring_extra
from streamrl.types import Group, Trajectory, fits_float32, new_uid

logger = logging.getLogger(__name__)


EQUAL_REWARDS_TOL = 1e-6
"""Dynamic sampling treats a group whose rewards spread no more than this as all equal."""
FILTERED_STREAK_WARNING = 100
"""A replica logs a warning after each run of this many consecutive filtered groups."""
MAX_SPANS = 100_000
"""Trace spans a replica keeps between two drains (the controller drains every step)."""
RETURN_WAIT_S = 60.0
"""How long saving partials waits for aborted requests to come back with their tokens."""


async def _all(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather``, except that when one fails the others are cancelled (a failed
    group must not leave its siblings sampling) before the failure propagates."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def overlong_penalty(length: int, budget: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``budget - buffer_len`` tokens, then falling
    linearly to ``-factor`` at ``budget`` tokens (rollout.overlong_buffer)."""
    return min(0.0, -(length - (budget - buffer_len)) / buffer_len * factor)


class PromptLike(Protocol):
    index: int
    prompt_ids: list[int]
    data_source: str
    ground_truth: str | None
    extra: dict[str, Any]


class PromptSupply(Protocol):
    def next(self) -> Any:
        """The next prompt (a ``streamrl.data.Prompt``)."""

    @property
    def cursor(self) -> int:
        """Prompts handed out so far (saved with the partials of the groups in flight)."""


class Scorer(Protocol):
    async def score(
        self, data_source: str, solution_str: str, ground_truth: str | None,
        extra_info: dict[str, Any],
    ) -> float: ...


@runtime_checkable
class Staged(Protocol):
    """Weights the weight bus already received inside the engine (``vllm_receiver``)."""

    async def load_into(self, engine: Any, version: int) -> None: ...


class _Cancelled(Exception):
    """The group was aborted because the replica is stopping with cancel=True."""


class _BadReward(Exception):
    """A reward the learner cannot hold in float32: the group is dropped."""


Tracker = Callable[[int, Completion], None]
"""Told sample i of a group as of each return of its requests (``_InFlight.record``)."""


@dataclass
class _InFlight:
    """A group from the moment its prompt is picked until it is sampled: what a snapshot saves
    of it (``PartialGroup``). ``samples`` holds each sample as of its last request's return
    (the first, or one an abort cut), so after aborting every request it is exact."""

    prompt: PromptLike
    group_id: str
    saved: list[Completion] | None = None
    """Samples a resumed group continues from (None: sample from the prompt)."""
    samples: list[Completion] | None = None
    sampled: bool = False
    """Every sample finished: the group is being scored and put, so no snapshot holds it."""

    def record(self, i: int, c: Completion) -> None:
        samples = self.samples = self.samples or []
        samples.extend(Completion() for _ in range(i + 1 - len(samples)))
        samples[i] = c

    def partial(self) -> PartialGroup:
        p = self.prompt
        samples = self.samples if self.samples is not None else self.saved
        return PartialGroup(
            group_id=self.group_id, index=p.index, prompt_ids=list(p.prompt_ids),
            data_source=p.data_source, ground_truth=p.ground_truth, extra=dict(p.extra),
            samples=None if samples is None else [
                PartialSample(token_ids=list(c.token_ids), logprobs=list(c.logprobs),
                              versions=list(c.versions), finish_reason=c.finish_reason)
                for c in samples])


def sampling_params(rollout: RolloutConfig) -> SamplingParams:
    """The group sampling parameters a replica uses (n samples of one prompt)."""
    return SamplingParams(
        n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        max_tokens=rollout.max_new_tokens, stop=tuple(rollout.stop),
        stop_token_ids=tuple(rollout.stop_token_ids),
    )


def greedy_params(rollout: RolloutConfig) -> SamplingParams:
    """One greedy answer with the run's stops (validation)."""
    return SamplingParams(n=1, temperature=0.0, max_tokens=rollout.max_new_tokens,
                          stop=tuple(rollout.stop), stop_token_ids=tuple(rollout.stop_token_ids))


@dataclass
class ReplicaCounters:
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    request_failures: int = 0
    """Requests that raised (each is retried up to rollout.max_retries times)."""
    groups_failed: int = 0
    """Groups given up on (retries exhausted or building failed); admission given back."""
    groups_cancelled: int = 0
    groups_filtered: int = 0
    """Groups dropped by dynamic sampling (equal rewards); admission given back."""
    reward_failures: int = 0
    """Reward calls that raised (scored 0)."""
    groups_bad_reward: int = 0
    """Groups dropped for a reward not finite in float32; admission given back."""
    reward_sum: float = 0.0
    overlong_filtered: int = 0
    """Responses cut at the token budget and masked out (rollout.overlong_filter)."""
    resumed_requests: int = 0
    """Partial responses resubmitted after an abort-policy weight update."""
    aborted_requests: int = 0
    """Requests aborted in the engine (abort-policy updates, cancelling stops)."""
    admission_refused: int = 0
    loop_errors: int = 0
    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    """Tool calls that became error observations (ill-formed, raised, timed out, junk)."""
    episodes_truncated: int = 0
    weight_updates: int = 0
    held_for_weights: int = 0
    """Groups that waited, admitted, for weights already received to be loaded."""
    weight_pause_s: float = 0.0
    """How long the last weight update kept the replica from starting work (drain wait,
    rolling turn wait and swap)."""
    swap_wait_s: float = 0.0
    """How long the last rolling update waited for its turn (a ``SwapTokens`` token)."""
    busy_s: float = 0.0
    """Wall seconds with at least one request in the engine (finished busy periods)."""
    partials_resumed: int = 0
    """Saved groups picked up with sampled tokens to continue from (``resume``)."""
    partials_dropped: int = 0
    """Saved groups whose tokens were too stale for the learner: started again from the prompt."""
    partials_saved: int = 0
    """Snapshots of the groups in flight written to the partial store (flushes and stops)."""


class Replica:
    """One engine's continuous rollout loop; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        buffer: BufferProducer | None,
        prompts: PromptSupply,
        scorer: Scorer,
        tokenizer: Any,
        rollout: RolloutConfig,
        *,
        name: str = "replica",
        admit_backoff_s: float = 0.02,
        trace: bool = False,
        weights_pending: Callable[[], bool] = lambda: False,
        partials: PartialStore | None = None,
        partial_flush_s: float = 0.0,
        swap_tokens: SwapGate | None = None,
    ) -> None:
        """``buffer``: None for a replica that only answers ``sample_one`` (``streamrl serve``).
        ``weights_pending``: whether newer weights have arrived that the engine has not
        loaded yet (the weight bus's receiver knows): no group starts until they are, so a
        group admitted once the learner published version V samples from V onwards.
        ``partials``: where ``save_partials`` and ``stop(save=True)`` write the groups in
        flight, and every ``partial_flush_s`` seconds while the loop runs (0: only then).
        ``swap_tokens``: the fleet's turns at swapping, shared by its replicas (``SwapTokens``
        or its Ray actor): needed by ``update_weights`` under the rolling policy."""
        if rollout.max_inflight_groups <= 0:
            raise ValueError(f"rollout.max_inflight_groups={rollout.max_inflight_groups}: "
                             "must be > 0")
        self.engine = engine
        self.buffer = buffer
        self.prompts = prompts
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.name = name
        self.admit_backoff_s = admit_backoff_s
        self.weights_pending = weights_pending
        self.swap_tokens = swap_tokens
        self.params = sampling_params(rollout)
        self.agent = make_agent(rollout, tokenizer) if rollout.agent else None
        self.counters = ReplicaCounters()
        self._groups: set[asyncio.Task[None]] = set()
        self._requests: set[str] = set()  # engine request ids in flight
        self._changed = asyncio.Event()  # a slot freed, a drain ended, or stop was asked
        self._may_start = asyncio.Event()  # cleared while a drain update waits
        self._may_start.set()
        self._gate = asyncio.Event()  # cleared while an abort update swaps: no new requests
        self._gate.set()
        self._update_lock = asyncio.Lock()
        self._updating = 0  # weight updates entered and not finished (``swapping``)
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._cancelling = False
        self._started_at = time.monotonic()
        self._progressed_at = time.monotonic()
        self._filtered_streak = 0  # consecutive groups dynamic sampling dropped
        self._credits = 0  # slots claimed (admit_up_to, put_and_admit) no group has used yet
        # Claimed per call at most: replicas that wait together split a new version's slots
        # instead of the first one taking them all (it claims again at once if they do not).
        self._share = -(-rollout.max_inflight_groups // max(1, rollout.num_replicas))
        self._late: set[asyncio.Future[None]] = set()  # give-backs of slots claimed after stop
        self._busy_since = 0.0  # perf_counter when the engine last went from idle to busy
        self._spans: list[tuple[str, float, float]] | None = [] if trace else None
        self.partials = partials
        self.partial_flush_s = partial_flush_s
        self._inflight: dict[str, _InFlight] = {}  # groups picked and not yet sampled
        self._resumes: list[PartialGroup] = []  # saved groups to pick up before new prompts
        self._max_staleness = 0  # the bound saved groups are checked against (``resume``)
        self._flusher: asyncio.Task[None] | None = None
        self._saving = False  # stop(save=True) in progress: cancelled groups keep their record

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Start the loop on the running event loop; returns its task."""
        if self.buffer is None:
            raise RuntimeError(f"{self.name}: has no buffer (it only answers sample_one calls)")
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError(f"{self.name}: already running")
        self._stopping = self._cancelling = False
        self._started_at = time.monotonic()
        self._loop_task = asyncio.create_task(self._run(), name=f"{self.name}-loop")
        if self.partials is not None and self.partial_flush_s > 0:
            self._flusher = asyncio.create_task(self._flush_partials(),
                                                name=f"{self.name}-partials")
        return self._loop_task

    @property
    def request_ids(self) -> frozenset[str]:
        """Engine request ids in flight now (for routers and progress checks)."""
        return frozenset(self._requests)

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def stop(self, cancel: bool = False, timeout: float | None = None, save: bool = False
                   ) -> PartialSnapshot | None:
        """Stop starting groups; finish the in-flight ones, or with ``cancel`` abort them.

        Groups still running after ``timeout`` seconds are cancelled. Every group that is not
        put gives its admission back. ``save`` (implies ``cancel``): the groups still sampling
        are saved, with their tokens so far and the prompt cursor, into ``partials`` and
        returned, so a replica given them (``resume``) continues where these stopped.
        """
        self._stopping = True
        self._saving = save
        self._changed.set()
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._loop_task is not None:
            await self._loop_task
        if cancel or save:
            self._cancelling = True
            self._gate.set()  # resumptions waiting on a swap must see the cancel
            await self._abort_requests()
        pending = set(self._groups)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        while self._credits:  # slots puts claimed that no group will use now
            self._credits -= 1
            await self._give_back()
        if self._late:
            await asyncio.gather(*self._late)  # _give_back logs its failures, never raises
        if not save:
            return None
        # Every group has ended: each cancelled one recorded its samples as its aborted
        # requests came back, and kept its record (``_saving``).
        snapshot = self._snapshot()
        self._inflight.clear()
        self._resumes.clear()
        self._saving = False
        try:
            await self._store(snapshot)
        except Exception:
            logger.exception("%s: saving %d partial groups at stop failed", self.name,
                             len(snapshot.groups))
        return snapshot

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            self._changed.clear()  # cleared before checking: no wake-up is lost
            full = len(self._groups) >= self.rollout.max_inflight_groups
            if full or not self._may_start.is_set() or self._updating:
                await self._changed.wait()
                continue
            if not self._credits:  # no slot claimed yet (by a put): claim free ones at once
                try:  # not `_credits += await ...`: puts may add credits during the await
                    claimed = await self.buffer.aadmit_up_to(
                        min(self.rollout.max_inflight_groups - len(self._groups), self._share))
                    self._credits += claimed
                except Exception:
                    self.counters.loop_errors += 1
                    logger.exception("%s: buffer.admit_up_to failed; retrying", self.name)
                    await self._wait_changed(self.admit_backoff_s * 10)
                    continue
            if not self._credits:
                self.counters.admission_refused += 1
                await self._wait_changed(self.admit_backoff_s)
                continue
            self._credits -= 1
            if not await self._unheld():
                await self._give_back()
                break
            try:
                live = self._pick()
            except Exception:
                self.counters.loop_errors += 1
                logger.exception("%s: prompts.next() failed; retrying", self.name)
                await self._give_back()
                await self._wait_changed(self.admit_backoff_s * 10)
                continue
            task = asyncio.create_task(self._group(live), name=f"{self.name}-group")
            self._groups.add(task)
            task.add_done_callback(self._group_done)

    def _held(self) -> bool:
        """No group may start: weights were received and not loaded, or an update began (the
        claim was under way when it did): a group must not start on weights it outlives."""
        return self._updating > 0 or self.weights_pending()

    async def _unheld(self) -> bool:
        """Wait while ``_held``; False if the replica began stopping meanwhile."""
        if self._held():
            self.counters.held_for_weights += 1
            while self._held() and not self._stopping:
                await self._wait_changed(self.admit_backoff_s)
        return not self._stopping

    async def _wait_changed(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # -- partial rollouts (partials.py) -------------------------------------------------------

    def resume(self, groups: list[PartialGroup], max_staleness: int) -> None:
        """Pick up these saved groups before any new prompt (their prompts were handed out
        before the saved cursor). Each is checked against ``max_staleness`` when it starts, at
        the engine's version then (``partials.usable``)."""
        self._resumes.extend(groups)
        self._max_staleness = max_staleness

    def _pick(self) -> _InFlight:
        """The next group to start, registered as in flight in the same step (a snapshot can
        never miss it): a saved group first, else the next prompt."""
        if not self._resumes:
            live = _InFlight(self.prompts.next(), new_uid())
        else:
            saved = self._resumes.pop(0)
            fresh = usable(saved, self.engine.version, self._max_staleness)
            if fresh is None:
                self.counters.partials_dropped += 1
                logger.info("%s: saved group %s of prompt %s is staler than max_staleness=%d "
                            "at version %d: its %d tokens dropped, sampled again", self.name,
                            saved.group_id, saved.index, self._max_staleness,
                            self.engine.version, saved.num_tokens)
                fresh = msgspec.structs.replace(saved, samples=None)
            samples = fresh.samples if self.agent is None else None  # episodes are not saved
            if samples is not None and fresh.num_tokens:
                self.counters.partials_resumed += 1
            live = _InFlight(fresh, fresh.group_id, saved=None if samples is None else [
                Completion(token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                           versions=list(s.versions), finish_reason=s.finish_reason)
                for s in samples])
        self._inflight[live.group_id] = live
        return live

    def _snapshot(self) -> PartialSnapshot:
        """The groups not yet sampled and the prompt cursor, read in one step (no await)."""
        groups = [*self._resumes,
                  *(g.partial() for g in self._inflight.values() if not g.sampled)]
        return snapshot_of(self.name, self.prompts.cursor, groups)

    async def snapshot(self) -> PartialSnapshot:
        """Every group in flight with its tokens so far, while the loop goes on: its requests
        are aborted (as an abort-policy update does, under the same lock, so the two never
        interleave), recorded as they come back, and resumed."""
        async with self._update_lock:
            self._gate.clear()
            try:
                await self._abort_requests()
                await self._requests_returned()
                return self._snapshot()
            finally:
                self._gate.set()

    async def _requests_returned(self) -> None:
        """Wait (at most RETURN_WAIT_S) until no request is in the engine: each aborted one has
        come back and recorded its tokens. One still out after that is saved as of its last
        return (fewer tokens, still exact)."""
        deadline = time.monotonic() + RETURN_WAIT_S
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self._requests:
            logger.warning("%s: %d aborted requests did not come back within %.0f s to record "
                           "their partial tokens; saved as of their last return", self.name,
                           len(self._requests), RETURN_WAIT_S)

    async def _store(self, snapshot: PartialSnapshot) -> None:
        if self.partials is None:
            return
        await asyncio.to_thread(self.partials.save, snapshot)
        self.counters.partials_saved += 1

    async def _flush_partials(self) -> None:
        """Save a snapshot every ``partial_flush_s``: a replica killed without warning loses at
        most the tokens sampled since the last one."""
        while True:
            await asyncio.sleep(self.partial_flush_s)
            try:
                await self._store(await self.snapshot())
            except Exception:
                self.counters.loop_errors += 1
                logger.exception("%s: saving partial rollouts failed; retrying in %g s",
                                 self.name, self.partial_flush_s)

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self._groups.discard(task)
        self._changed.set()

    def _filtered(self, rewards: list[float]) -> bool:
        """Dynamic sampling: drop a group whose rewards are all equal (counted, logged when a
        long run of groups is dropped, so a task nothing ever solves is not a silent wait)."""
        if not self.rollout.filter_groups or max(rewards) - min(rewards) > EQUAL_REWARDS_TOL:
            self._filtered_streak = 0
            return False
        self.counters.groups_filtered += 1
        self._filtered_streak += 1
        if self._filtered_streak % FILTERED_STREAK_WARNING == 0:
            logger.warning("%s: the last %d groups all had equal rewards (%s) and were filtered "
                           "(rollout.filter_groups=true): is the task too easy or too hard?",
                           self.name, self._filtered_streak, rewards[0])
        return True

    async def _give_back(self) -> None:
        try:
            await self.buffer.acancel_admission()
        except Exception:
            logger.exception("%s: buffer.cancel_admission failed", self.name)

    async def _put(self, group: Group) -> None:
        """Put ``group``; unless stopping or mid-swap, claim the loop's next slot in the same
        buffer call (a replica waiting for its swap leaves new slots to the swapped ones). The
        claim is counted when the call completes, even if this task is cancelled first."""
        if self._stopping or self._updating:
            await self.buffer.aput(group)
            return
        call = asyncio.ensure_future(self.buffer.aput_and_admit(group))
        call.add_done_callback(self._claimed)
        await asyncio.shield(call)

    def _claimed(self, call: asyncio.Future[bool]) -> None:
        if call.cancelled() or call.exception() is not None or not call.result():
            return
        if self._stopping:  # no group will start on it: give it back now
            give_back = asyncio.ensure_future(self._give_back())
            self._late.add(give_back)
            give_back.add_done_callback(self._late.discard)
            return
        self._credits += 1
        self._changed.set()

    # -- one group ----------------------------------------------------------------------------

    async def _group(self, live: _InFlight) -> None:
        prompt, group_id = live.prompt, live.group_id
        settled = False  # a put or give-back of this group's admission is under way
        try:
            # Checked again: an update may have begun after the loop's check and before this
            # task's first step (a stopping replica goes on: a cancel stops its first request).
            await self._unheld()
            sample = (self._single_turn(prompt, live) if self.agent is None
                      else self._episodes(prompt, group_id))
            if self.rollout.greedy_baseline:
                trajectories, baseline = await _all(sample, self._greedy_reward(prompt, group_id))
            else:
                trajectories, baseline = await sample, None
            live.sampled = True
            group = Group(group_id=group_id, trajectories=list(trajectories),
                          prompt_index=prompt.index, created_ts=time.time(),
                          baseline_reward=baseline)
            settled = True
            if self._filtered(group.rewards):
                await self._give_back()  # the loop admits another group in its place
                return
            try:
                await self._put(group)
            except Exception:
                await self._give_back()  # the put failed: nothing was recorded
                raise
        except _Cancelled:  # stop(cancel=True) aborted its requests
            self.counters.groups_cancelled += 1
            if not settled:
                await self._give_back()
            return
        except asyncio.CancelledError:  # stop()'s timeout ran out
            self.counters.groups_cancelled += 1
            if not settled:
                await self._give_back()
            raise
        except _BadReward as exc:  # raised while scoring: before the group was built
            self.counters.groups_bad_reward += 1
            logger.warning("%s: group %s of prompt %s dropped, admission given back: %s",
                           self.name, group_id, prompt.index, exc)
            if not settled:
                await self._give_back()
            return
        except Exception:
            self.counters.groups_failed += 1
            logger.exception("%s: group for prompt %s failed; admission given back",
                             self.name, prompt.index)
            if not settled:
                await self._give_back()
            return
        finally:
            if not self._saving:  # a saving stop snapshots the groups it cancelled once they end
                self._inflight.pop(group_id, None)
        c = self.counters
        c.groups += 1
        c.trajectories += len(group.trajectories)
        c.tokens += sum(len(t.response_ids) for t in group.trajectories)
        c.reward_sum += sum(group.rewards)

    async def _single_turn(self, prompt: PromptLike, live: _InFlight) -> list[Trajectory]:
        group_id = live.group_id
        start = time.perf_counter()
        completions = await self._sample_with_retries(
            prompt.prompt_ids, self._params_for(prompt), group_id, f"prompt {prompt.index}",
            saved=live.saved, track=live.record)
        extra_info = self._scoring_extra(prompt)  # once per group: it decodes the prompt
        gen_s = time.perf_counter() - start
        return list(await asyncio.gather(
            *(self._trajectory(prompt, group_id, c, gen_s, extra_info) for c in completions)))

    async def _greedy_reward(self, prompt: PromptLike, group_id: str) -> float:
        """ReMax's baseline: the reward of one greedy response to the prompt, scored (and
        shaped) as the group's own responses are."""
        params = dataclasses.replace(self._params_for(prompt), n=1, temperature=0.0)
        (c,) = await self._sample_with_retries(prompt.prompt_ids, params, f"{group_id}-greedy",
                                               f"the greedy baseline of prompt {prompt.index}")
        reward, _ = await self._score(prompt, c, self._scoring_extra(prompt))
        return reward

    async def _episodes(self, prompt: PromptLike, group_id: str) -> list[Trajectory]:
        assert self.agent is not None
        episodes = await _all(*(run_episode(self.agent, prompt, self._sample_turn,
                                            f"{group_id}-e{i}") for i in range(self.rollout.n)))
        return [self._episode_trajectory(prompt, group_id, e) for e in episodes]

    async def _sample_turn(self, prompt_ids: list[int], max_tokens: int, request_id: str
                           ) -> Completion:
        """One agent turn: a single sample through the retry / abort-resume machinery."""
        return await self.sample_one(
            prompt_ids, dataclasses.replace(self.params, max_tokens=max_tokens), request_id)

    async def sample_one(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink | None = None,
    ) -> Completion:
        """One sample of ``prompt_ids`` through the replica's request machinery: retried on
        failure, resumed after an abort-policy update, exact per-token versions. With
        ``on_tokens`` (``streamrl serve`` streaming) sampled ids are also reported as they
        arrive, and a request that fails after reporting some is not retried."""
        params = dataclasses.replace(params, n=1)
        reported = False

        def report(ids: list[int]) -> None:
            nonlocal reported
            reported = True
            if on_tokens is not None:
                on_tokens(ids)

        sink = report if on_tokens is not None else None
        (c,) = await self._sample_with_retries(prompt_ids, params, request_id, request_id, sink,
                                               lambda: reported)
        return c

    async def _sample_with_retries(
        self, prompt_ids: list[int], params: SamplingParams, key: str, what: str,
        on_tokens: TokenSink | None = None, reported: Callable[[], bool] = lambda: False,
        *, saved: list[Completion] | None = None, track: Tracker | None = None,
    ) -> list[Completion]:
        """``saved``: samples to continue instead of a first request (a resumed group; each
        attempt starts from them again). ``track``: told each sample as of every return."""
        last: Exception | None = None
        for attempt in range(self.rollout.max_retries + 1):
            try:
                return await self._sample(prompt_ids, params, f"{key}-{attempt}", on_tokens,
                                          saved, track)
            except _Cancelled:
                raise
            except Exception as exc:
                if reported():  # a stream's client already has tokens: a retry would repeat
                    raise
                self.counters.request_failures += 1
                last = exc
                logger.warning("%s: request %s-%d failed (%s: %s)", self.name, key, attempt,
                               type(exc).__name__, exc)
                await asyncio.sleep(min(1.0, self.admit_backoff_s * 2**attempt))
        raise RuntimeError(f"{self.name}: sampling failed {self.rollout.max_retries + 1} "
                           f"times for {what}") from last

    async def _sample(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink | None = None, saved: list[Completion] | None = None,
        track: Tracker | None = None,
    ) -> list[Completion]:
        if saved is None:
            completions = await self._request(prompt_ids, params, request_id, on_tokens)
        else:  # copies: resuming sets a finish reason, and a retry starts from these again
            completions = [dataclasses.replace(c) for c in saved]
        if track is not None:  # recorded before the next await: no snapshot can miss them
            for i, c in enumerate(completions):
                track(i, c)
        return list(await asyncio.gather(*(
            self._resume_if_aborted(prompt_ids, c, params, f"{request_id}-{i}", on_tokens,
                                    None if track is None else functools.partial(track, i))
            for i, c in enumerate(completions))))

    async def _request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink | None = None,
    ) -> list[Completion]:
        await self._gate.wait()
        if self._cancelling:
            raise _Cancelled
        if not self._requests:  # the stall clock and a busy period start here
            self._progressed_at = time.monotonic()
            self._busy_since = time.perf_counter()
        self._requests.add(request_id)
        try:
            if on_tokens is not None:
                completions = await self.engine.stream(prompt_ids, params, request_id,
                                                       on_tokens)
            else:
                completions = await self.engine.generate(prompt_ids, params, request_id)
            self._progressed_at = time.monotonic()
            return completions
        finally:
            self._requests.discard(request_id)
            if not self._requests:
                self.counters.busy_s += time.perf_counter() - self._busy_since
                self._span("generate", self._busy_since)

    async def _resume_if_aborted(
        self, prompt_ids: list[int], done: Completion, params: SamplingParams, request_id: str,
        on_tokens: TokenSink | None = None, track: Callable[[Completion], None] | None = None,
    ) -> Completion:
        """Continue a response an abort (a weight update, a partials snapshot) interrupted, or
        one saved by a stopped replica, keeping its partial tokens; ``track`` is told the
        response after each return."""
        empty_aborts = 0
        part = 0
        while done.finish_reason == "abort":
            if self._cancelling:
                raise _Cancelled
            remaining = params.max_tokens - len(done.token_ids)
            if remaining <= 0:
                done.finish_reason = "length"
                break
            part += 1
            self.counters.resumed_requests += 1
            (rest,) = await self._request(
                prompt_ids + done.token_ids,
                dataclasses.replace(params, n=1, max_tokens=remaining), f"{request_id}-r{part}",
                on_tokens)
            # An engine that keeps aborting without progress must not loop forever.
            empty_aborts = empty_aborts + 1 if not rest.token_ids else 0
            if empty_aborts > self.rollout.max_retries:
                raise RuntimeError(f"{request_id}: aborted {empty_aborts} times without progress")
            done = Completion(
                token_ids=done.token_ids + rest.token_ids,
                logprobs=done.logprobs + rest.logprobs,
                versions=done.versions + rest.versions,
                finish_reason=rest.finish_reason,
            )
            if track is not None:
                track(done)
        return done

    async def _trajectory(
        self, prompt: PromptLike, group_id: str, c: Completion, gen_s: float,
        extra_info: dict[str, Any],
    ) -> Trajectory:
        reward, metrics = await self._score(prompt, c, extra_info)
        metrics["gen_s"] = gen_s
        return Trajectory(
            uid=new_uid(), group_id=group_id, prompt_ids=list(prompt.prompt_ids),
            response_ids=list(c.token_ids), loss_mask=self._mask([1] * len(c.token_ids),
                                                                 c.finish_reason),
            logprobs=list(c.logprobs), versions=list(c.versions), reward=reward,
            finish_reason=c.finish_reason, data_source=prompt.data_source,
            ground_truth=prompt.ground_truth, extra=dict(prompt.extra), metrics=metrics,
        )

    def _params_for(self, prompt: PromptLike) -> SamplingParams:
        """The group's sampling parameters: a prompt may carry its own response budget
        (``extra['max_new_tokens']``, the toy task's long tail), which the scorer reads too."""
        budget = prompt.extra.get("max_new_tokens")
        if budget is None:
            return self.params
        return dataclasses.replace(self.params, max_tokens=int(budget))

    def _scoring_extra(self, prompt: PromptLike) -> dict[str, Any]:
        return scoring_extra(prompt, self.rollout.max_new_tokens, self.tokenizer)

    async def _score(self, prompt: PromptLike, c: Completion, extra_info: dict[str, Any]
                     ) -> tuple[float, dict[str, float]]:
        """The shaped reward of one completion and its timing metrics; a scorer that raises
        scores 0 (counted), one whose value is not finite in float32 drops the group."""
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        start = time.perf_counter()
        try:
            reward = float(await self.scorer.score(prompt.data_source, text, prompt.ground_truth,
                                                   extra_info))
        except Exception as exc:
            self.counters.reward_failures += 1
            logger.warning("%s: reward for %s raised %s: %s; scored 0", self.name,
                           prompt.data_source, type(exc).__name__, exc)
            reward = 0.0
        if not fits_float32(reward):
            raise _BadReward(f"the reward function for data_source {prompt.data_source!r} "
                             f"returned {reward!r}, not finite in float32")
        metrics = {"score_s": time.perf_counter() - start}
        reward += self._overlong(len(c.token_ids), self._params_for(prompt).max_tokens, metrics)
        return reward, metrics

    def _overlong(self, length: int, budget: int, metrics: dict[str, float]) -> float:
        """The soft overlong punishment of a ``length``-token response (0 when it is off)."""
        cfg = self.rollout.overlong_buffer
        if not cfg.enable:
            return 0.0
        metrics["overlong_penalty"] = overlong_penalty(length, budget, cfg.len,
                                                       cfg.penalty_factor)
        return metrics["overlong_penalty"]

    def _mask(self, loss_mask: list[int], finish_reason: str) -> list[int]:
        """Overlong filtering: a response cut at the token budget is not trained on."""
        if self.rollout.overlong_filter and finish_reason == "length":
            self.counters.overlong_filtered += 1
            return [0] * len(loss_mask)
        return loss_mask

    def _episode_trajectory(self, prompt: PromptLike, group_id: str, e: Episode) -> Trajectory:
        c = self.counters
        c.episodes += 1
        c.turns += e.turns
        c.tool_calls += e.tool_calls
        c.tool_errors += e.tool_errors
        c.episodes_truncated += e.truncated
        reward = e.reward
        if not fits_float32(reward):
            raise _BadReward(f"the environment's reward for data_source {prompt.data_source!r} "
                             f"is {reward!r}, not finite in float32")
        metrics = dict(e.seconds)
        reward += self._overlong(len(e.response_ids), self.rollout.max_episode_tokens, metrics)
        return Trajectory(
            uid=new_uid(), group_id=group_id, prompt_ids=e.prompt_ids,
            response_ids=e.response_ids, loss_mask=self._mask(e.loss_mask, e.finish_reason),
            logprobs=e.logprobs, versions=e.versions, reward=reward,
            finish_reason=e.finish_reason, data_source=prompt.data_source,
            ground_truth=prompt.ground_truth,
            extra={**prompt.extra, "episode": e.summary(), "env": e.info}, metrics=metrics,
        )

    # -- weight updates -----------------------------------------------------------------------

    async def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | Staged, version: int, policy: str
    ) -> None:
        """Swap the engine to ``version`` under ``policy`` (drain | pause | abort | rolling).

        ``weights``: full HF-named (name, tensor) pairs, or weights the weight bus staged inside
        the engine (anything with ``load_into(engine, version)``). From the call until the
        swap is done the replica is ``swapping``: it starts no group and claims no slot.
        ``rolling`` is ``pause`` taken in turns: the replica waits for one of the fleet's
        ``swap_tokens`` and pauses only itself, while the replicas without one keep sampling.
        """
        if getattr(weights, "hot", False):  # a LoRA adapter: added beside the one in use,
            await weights.load_into(self.engine, version)  # type: ignore[union-attr]
            self.counters.weight_updates += 1  # requests keep theirs: no pause under any policy
            self._changed.set()  # a group held for these weights may start
            return
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"update policy={policy!r}: must be one of {UPDATE_POLICIES}")
        if policy == "rolling" and self.swap_tokens is None:
            raise ValueError(f"{self.name}: update policy 'rolling' needs the fleet's swap "
                             "tokens (Replica(swap_tokens=...))")
        # Before any await: a replica still on the old weights (waiting for its turn) must not
        # start a group the learner could take with tokens older than the bound allows.
        self._updating += 1
        try:
            await self._update(weights, version, policy)
        finally:
            self._updating -= 1
            self._changed.set()  # a group held for these weights may start

    @property
    def swapping(self) -> bool:
        """In a weight update (waiting for its turn, draining or swapping): the router sends
        it no new work while another replica can take it."""
        return self._updating > 0

    async def _update(self, weights: Iterable[tuple[str, torch.Tensor]] | Staged, version: int,
                      policy: str) -> None:
        async with self._update_lock:
            start = time.perf_counter()
            if policy == "drain":
                self._may_start.clear()
                try:
                    while self._groups:
                        await asyncio.wait(set(self._groups))
                    await self._swap(weights, version)
                finally:
                    self._may_start.set()
                    self._changed.set()
            elif policy == "pause":
                await self._paused_swap(weights, version)
            elif policy == "rolling":
                async with self._swap_turn(version):
                    self.counters.swap_wait_s = time.perf_counter() - start
                    await self._paused_swap(weights, version)
            else:
                self._gate.clear()
                try:
                    await self._abort_requests()
                    await self._swap(weights, version)
                finally:
                    self._gate.set()
            self.counters.weight_updates += 1
            self.counters.weight_pause_s = time.perf_counter() - start
            self._span(f"weights v{version} ({policy})", start)

    async def _paused_swap(self, weights: Iterable[tuple[str, torch.Tensor]] | Staged,
                           version: int) -> None:
        await self.engine.pause()
        try:
            await self._swap(weights, version)
        finally:
            await self.engine.resume()

    @contextlib.asynccontextmanager
    async def _swap_turn(self, version: int) -> AsyncIterator[None]:
        """Hold one of the fleet's swap tokens (at most ``k`` replicas swap at once)."""
        assert self.swap_tokens is not None
        holders = await self.swap_tokens.take(self.name)
        if holders is not None:
            raise TimeoutError(f"{self.name}: no turn to load weight version {version} within "
                               f"weight_bus.timeout_s: the swap tokens are held by {holders}")
        try:
            yield
        finally:
            try:
                await self.swap_tokens.give_back(self.name)
            except Exception:  # the loaded version stands; the next swap by this name frees it
                logger.exception("%s: giving back the swap token failed", self.name)

    async def _swap(self, weights: Iterable[tuple[str, torch.Tensor]] | Staged, version: int
                    ) -> None:
        if isinstance(weights, Staged):
            await weights.load_into(self.engine, version)
        else:
            await self.engine.load_weights(weights, version)

    async def _abort_requests(self) -> None:
        for request_id in list(self._requests):
            self.counters.aborted_requests += 1
            await self.engine.abort(request_id)

    # -- metrics ------------------------------------------------------------------------------

    def stalled_s(self) -> float:
        """Seconds this replica has held requests in flight without finishing one (0 when it
        has none in flight): what its supervisor's heartbeat checks."""
        if not self._requests:
            return 0.0
        return time.monotonic() - self._progressed_at

    def _span(self, name: str, start: float) -> None:
        """Record a span from ``start`` (perf_counter) to now, in wall-clock seconds."""
        if self._spans is not None and len(self._spans) < MAX_SPANS:
            now = time.perf_counter()
            self._spans.append((name, time.time() - (now - start), now - start))

    def drain_spans(self) -> list[tuple[str, float, float]]:
        """(name, wall start, seconds) recorded since the last call (tracing on; else [])."""
        if self._spans is None:
            return []
        spans, self._spans = self._spans, []
        return spans

    def metrics(self) -> dict[str, float]:
        c = self.counters
        elapsed = max(time.monotonic() - self._started_at, 1e-9)
        busy = c.busy_s + (time.perf_counter() - self._busy_since if self._requests else 0.0)
        return {
            "groups": float(c.groups),
            "trajectories": float(c.trajectories),
            "tokens": float(c.tokens),
            "tokens_per_s": c.tokens / elapsed,
            "request_failures": float(c.request_failures),
            "groups_failed": float(c.groups_failed),
            "groups_cancelled": float(c.groups_cancelled),
            "groups_filtered": float(c.groups_filtered),
            "reward_failures": float(c.reward_failures),
            "groups_bad_reward": float(c.groups_bad_reward),
            "reward_mean": c.reward_sum / c.trajectories if c.trajectories else 0.0,
            "overlong_filtered": float(c.overlong_filtered),
            "resumed_requests": float(c.resumed_requests),
            "aborted_requests": float(c.aborted_requests),
            "admission_refused": float(c.admission_refused),
            "loop_errors": float(c.loop_errors),
            "episodes": float(c.episodes),
            "turns": float(c.turns),
            "tool_calls": float(c.tool_calls),
            "tool_errors": float(c.tool_errors),
            "episodes_truncated": float(c.episodes_truncated),
            "inflight_groups": float(len(self._groups)),
            "weight_updates": float(c.weight_updates),
            "held_for_weights": float(c.held_for_weights),
            "partials_resumed": float(c.partials_resumed),
            "partials_dropped": float(c.partials_dropped),
            "partials_saved": float(c.partials_saved),
            "weight_pause_s": c.weight_pause_s,
            "swap_wait_s": c.swap_wait_s,
            "busy_s": busy,
            "uptime_s": elapsed,
            "version": float(self.engine.version),
        }


# -- rolling updates: the fleet's turns at swapping --------------------------------------------


class SwapGate(Protocol):
    """The fleet's turns at swapping: ``SwapTokens``, or a handle to it in a Ray actor."""

    async def take(self, holder: str) -> str | None: ...

    async def give_back(self, holder: str) -> None: ...


class SwapTokens:
    """``k`` tokens, one per replica allowed to swap at a time (``update_policy=rolling``).

    One object serves the whole fleet: shared by in-process replicas, or hosted in a named Ray
    actor that the driver makes and replica actors call (``runtime.actors.start_swap_tokens``,
    ``RaySwapTokens``), so it outlives any replica. ``take`` waits at most ``timeout_s``
    (weight_bus.timeout_s), then names the holders instead, so a stuck swap becomes an error
    naming it, never a silent wait. A token is never taken back from a live holder (that would
    let k + 1 replicas swap at once); the supervisor gives back a dead one's. A holder asking
    again keeps its token: should that give-back fail, the replica re-created under the same
    name takes the token over with its first load (the weight bus's catch-up) and gives it back.
    """

    def __init__(self, k: int, timeout_s: float) -> None:
        if k <= 0:
            raise ValueError(f"weight_bus.rolling_k={k}: must be > 0")
        self.k = k
        self.timeout_s = timeout_s
        self._held: dict[str, float] = {}  # holder -> monotonic time it took its token
        self._freed = asyncio.Condition()

    async def take(self, holder: str) -> str | None:
        """Wait for a token for ``holder``: None once it holds one, else (after ``timeout_s``)
        who held the tokens and for how long."""
        deadline = time.monotonic() + self.timeout_s
        async with self._freed:
            while holder not in self._held and len(self._held) >= self.k:
                now = time.monotonic()
                if now >= deadline:
                    return ", ".join(f"{h} (for {now - t:.1f} s)" for h, t in self._held.items())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), deadline - now)
            self._held[holder] = time.monotonic()
        return None

    async def give_back(self, holder: str) -> None:
        async with self._freed:
            self._held.pop(holder, None)
            self._freed.notify_all()
