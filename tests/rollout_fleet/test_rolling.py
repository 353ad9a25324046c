"""``weight_bus.update_policy=rolling``: replicas swap in turns while the rest keep sampling.

Two replicas on paced scripted engines (a token every few milliseconds, nothing sampled while
paused, a load that takes a while) share one real ``MemoryBuffer`` and one ``SwapTokens``. The
learner's side is the controller's loop without training, in the order the weight bus keeps:
wait for the previous version's loads, hand every replica the new version (the receivers'
``received``), then open admission for it (``set_version``) while they load in turns.

Checked: the swaps never overlap and the other replica samples tokens during each one; no
group starts on weights older than the version admission was opened for, and every group is
taken within the staleness bound (none dropped); a replica waiting for its turn claims no
slot; the router sends a new call to a replica that is not swapping, and waits while all are;
a wait for a turn runs out with an error naming the replica and the holder; replica actors
share the driver's Ray actor's tokens, which outlive a replica that dies holding one; the
config accepts rolling only where it can work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import pytest
import torch

from streamrl.buffer.base import HeldBuffer
from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import ConfigError, RolloutConfig, load_config
from streamrl.rollout_fleet.engine import Completion, SamplingParams
from streamrl.rollout_fleet.replica import Replica, SwapTokens
from streamrl.serve.router import LocalBackend, Router
from streamrl.types import Group
from tests.support.rollout import IdTokenizer, ListedRewards, ScriptedEngine, scripted_prompts

ETA = 2
B = 8  # groups per step: as many as the fleet samples at once, so it never idles
STEPS = 8
UPDATE_S = 0.04  # the learner's update: replicas sample meanwhile, up to the bound


class PacedEngine(ScriptedEngine):
    """Samples one token of each of the n samples per ``tick`` seconds, none while paused,
    each stamped with the version loaded at that moment; prompt i gets ``tokens + ragged *
    (i % 6)`` tokens (so groups finish at different times); a load takes ``load_s``. Logs
    (perf_counter, event) for every pause, resume and token, and at each new request the
    (engine version, learner version) pair (``starts``)."""

    def __init__(self, buffer: MemoryBuffer, tokens: int, ragged: int, tick: float = 0.002,
                 load_s: float = 0.05) -> None:
        super().__init__()
        self.buffer, self.tokens, self.ragged = buffer, tokens, ragged
        self.tick, self.load_s = tick, load_s
        self.log: list[tuple[float, str]] = []
        self.starts: list[tuple[int, int]] = []
        self._running = asyncio.Event()
        self._running.set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                       ) -> list[Completion]:
        self.starts.append((self._version, self.buffer.stats().learner_version))
        length = self.tokens + self.ragged * (prompt_ids[0] % 6)
        versions = []
        for _ in range(length):
            await asyncio.sleep(self.tick)
            await self._running.wait()  # paused meanwhile: the token comes after the resume
            versions.append(self._version)
            self.log.append((time.perf_counter(), "token"))
        return [Completion([j] * length, [-0.5] * length, list(versions), "stop")
                for j in range(params.n)]

    async def pause(self) -> None:
        self._running.clear()
        self.log.append((time.perf_counter(), "pause"))

    async def resume(self) -> None:
        self.log.append((time.perf_counter(), "resume"))
        self._running.set()

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int
                           ) -> None:
        assert not self._running.is_set(), "loaded while sampling"
        await asyncio.sleep(self.load_s)
        self._version = version

    def pauses(self) -> list[tuple[float, float]]:
        marks = [t for t, event in self.log if event in ("pause", "resume")]
        return list(zip(marks[::2], marks[1::2]))

    def token_times(self) -> list[float]:
        return [t for t, event in self.log if event == "token"]


def make_replica(engine: ScriptedEngine, buffer: MemoryBuffer | None, tokens: SwapTokens,
                 name: str) -> Replica:
    rollout = RolloutConfig(n=2, max_new_tokens=64, max_inflight_groups=4, num_replicas=2)
    return Replica(engine, HeldBuffer(buffer, name) if buffer is not None else None,
                   scripted_prompts([[0.0, 1.0]] * 16), ListedRewards(), IdTokenizer(), rollout,
                   name=name, admit_backoff_s=0.005, swap_tokens=tokens)


async def take(buffer: MemoryBuffer, version: int, timeout: float = 20.0) -> list[Group]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return buffer.take(B, version, timeout=0)
        except TimeoutError:
            assert time.monotonic() < deadline, f"learner starved at {version}: {buffer.stats()}"
            await asyncio.sleep(0.002)


async def learn(buffer: MemoryBuffer, replicas: list[Replica], policy: str
                ) -> list[tuple[int, list[Group]]]:
    """The controller's loop without training; every publish under ``policy``."""
    taken = []
    loads: list[asyncio.Future[None]] = []
    for version in range(STEPS):
        batch = await take(buffer, version)
        await asyncio.sleep(UPDATE_S)
        buffer.ack([g.group_id for g in batch])
        taken.append((version, batch))
        await asyncio.gather(*loads)  # the publisher first waits for the previous loads
        loads = [asyncio.ensure_future(r.update_weights([], version + 1, policy))
                 for r in replicas]
        await asyncio.sleep(0)  # each replica has the version (its receiver's `received`)
        buffer.set_version(version + 1)  # admission opens while they load in turns
    await asyncio.gather(*loads)
    return taken


def run_fleet(policy: str = "rolling", ragged: int = 8
              ) -> tuple[list[PacedEngine], MemoryBuffer, list[tuple[int, list[Group]]]]:
    async def scenario():
        buffer = MemoryBuffer(groups_per_step=B, max_staleness=ETA)
        tokens = SwapTokens(k=1, timeout_s=30.0)
        engines = [PacedEngine(buffer, tokens=48 - 3 * ragged, ragged=ragged)
                   for _ in range(2)]
        replicas = [make_replica(e, buffer, tokens, f"replica-{i}")
                    for i, e in enumerate(engines)]
        for r in replicas:
            r.start()
        try:
            taken = await learn(buffer, replicas, policy)
        finally:
            for r in replicas:
                await r.stop(cancel=True)
        return engines, buffer, taken

    return asyncio.run(scenario())


def test_rolling_swaps_one_replica_at_a_time_while_the_other_samples():
    engines, _, _ = run_fleet()
    a, b = (e.pauses() for e in engines)
    assert len(a) == len(b) == STEPS  # one swap per publish each
    for (start, end) in a:  # never both paused: the fleet never stops generating
        assert all(end <= s or e <= start for s, e in b), (start, end, b)
    for mine, other in ((engines[0], engines[1]), (engines[1], engines[0])):
        sampled = other.token_times()
        for start, end in mine.pauses():
            assert any(start < t < end for t in sampled), "the other replica sampled nothing"


def test_pause_stops_the_whole_fleet():
    """The baseline the rolling test is measured against: with pause, both swap at once."""
    engines, _, _ = run_fleet("pause")
    a, b = (e.pauses() for e in engines)
    assert any(not (end <= s or e <= start) for start, end in a for s, e in b)


def test_rolling_keeps_the_staleness_bound_exact():
    """A replica waiting for its turn is still on version V-1 while admission is open for V:
    it must start nothing until it loaded V, so every group is fresh when taken."""
    engines, buffer, taken = run_fleet()
    for engine in engines:
        stale_starts = [(mine, learner) for mine, learner in engine.starts if mine < learner]
        assert not stale_starts, f"requests started on older weights: {stale_starts[:5]}"
    for version, batch in taken:
        for group in batch:
            assert group.min_version is not None and group.min_version >= version - ETA
    stats = buffer.stats()
    assert stats.dropped == 0 and stats.staleness_max <= ETA, stats
    assert any(g.max_version != g.min_version for _, batch in taken for g in batch), \
        "no group spanned a swap: the test did not exercise in-flight updates"


def test_an_update_begun_before_the_groups_first_step_holds_the_group():
    """The loop checks for an update, then makes the group's task; an update can begin before
    that task's first step (the learner publishes in between). The group must wait for the new
    weights all the same: here the update is scheduled from inside the prompt draw, so it runs
    first every time."""
    async def scenario():
        buffer = MemoryBuffer(groups_per_step=B, max_staleness=ETA)
        tokens = SwapTokens(k=1, timeout_s=30.0)
        engine = PacedEngine(buffer, tokens=4, ragged=0)
        replica = make_replica(engine, buffer, tokens, "replica-0")
        stream, updates = replica.prompts, []
        draw = stream.next

        def next_and_publish():
            prompt = draw()
            if not updates:
                updates.append(asyncio.ensure_future(replica.update_weights([], 1, "rolling")))
            return prompt

        stream.next = next_and_publish  # type: ignore[method-assign]
        replica.start()
        try:
            while not updates:
                await asyncio.sleep(0.001)
            await asyncio.wait_for(updates[0], 5)
            while not engine.starts:
                await asyncio.sleep(0.001)
        finally:
            await replica.stop(cancel=True)
        return engine.starts[0][0]

    assert asyncio.run(scenario()) == 1, "the group's request started on the old weights"


def test_a_replica_waiting_for_its_turn_claims_no_slot():
    """Its groups in flight finish and are put, but it claims no slot for a next one (the
    swapped replicas get them) until its own swap is done."""
    async def scenario():
        buffer = MemoryBuffer(groups_per_step=B, max_staleness=ETA)
        tokens = SwapTokens(k=1, timeout_s=30.0)
        replica = make_replica(PacedEngine(buffer, tokens=24, ragged=0), buffer, tokens,
                               "replica-0")
        replica.start()
        try:
            await asyncio.sleep(0.02)  # its first groups are sampling
            await tokens.take("replica-1")
            update = asyncio.ensure_future(replica.update_weights([], 1, "rolling"))
            await asyncio.sleep(0.3)  # long enough for the groups in flight to finish
            waiting = buffer.stats()
            assert waiting.produced > 0 and waiting.in_flight == 0, waiting
            await asyncio.sleep(0.05)
            assert buffer.stats().started == waiting.started
            await tokens.give_back("replica-1")
            await update
            await asyncio.sleep(0.05)
            assert buffer.stats().started > waiting.started
        finally:
            await replica.stop(cancel=True)

    asyncio.run(scenario())


def test_router_skips_a_replica_waiting_for_its_turn():
    async def scenario():
        tokens = SwapTokens(k=1, timeout_s=30.0)
        engines = [ScriptedEngine(), ScriptedEngine()]
        replicas = [make_replica(e, None, tokens, f"replica-{i}") for i, e in enumerate(engines)]
        router = Router([LocalBackend(r, r.name) for r in replicas], rolling=True)
        assert router.pick("episode") == 0
        await tokens.take("someone-else")  # replica-0 must wait for its turn
        update = asyncio.ensure_future(replicas[0].update_weights([], 1, "rolling"))
        await asyncio.sleep(0.01)
        assert replicas[0].swapping and not replicas[1].swapping
        await router.sample("episode", [0], SamplingParams(n=1), "call-1")
        assert engines[0].answered == [] and engines[1].answered == [0]
        assert router.pick("episode") == 0  # still pinned for its later calls
        await tokens.give_back("someone-else")
        await update
        assert engines[0].version == 1 and not replicas[0].swapping
        await router.sample("episode", [0], SamplingParams(n=1), "call-2")
        assert engines[0].answered == [0]

    asyncio.run(scenario())


def test_router_asks_no_replica_about_swaps_unless_rolling():
    """Under pause/abort/drain every replica swaps at once: a swap check per call would be one
    more round trip to the replica for nothing, so the call goes straight to its replica."""
    async def scenario():
        tokens = SwapTokens(k=1, timeout_s=30.0)
        engines = [ScriptedEngine(), ScriptedEngine()]
        replicas = [make_replica(e, None, tokens, f"replica-{i}") for i, e in enumerate(engines)]
        asked: list[str] = []

        class Counting(LocalBackend):
            async def swapping(self) -> bool:
                asked.append(self.name)
                return await super().swapping()

        router = Router([Counting(r, r.name) for r in replicas])
        await router.sample("episode", [0], SamplingParams(n=1), "call-1")
        assert asked == [] and engines[0].answered == [0]
        router.rolling = True
        await router.sample("episode", [0], SamplingParams(n=1), "call-2")
        assert asked == ["replica-0"]

    asyncio.run(scenario())


def test_router_waits_while_every_replica_swaps():
    """No replica free: the call waits for the first to end its swap (then samples on the new
    weights), or gives up after ``swap_wait_s`` naming the replicas."""
    async def scenario():
        tokens = SwapTokens(k=1, timeout_s=30.0)
        engines = [ScriptedEngine(), ScriptedEngine()]
        replicas = [make_replica(e, None, tokens, f"replica-{i}") for i, e in enumerate(engines)]
        router = Router([LocalBackend(r, r.name) for r in replicas], rolling=True,
                        swap_wait_s=0.1)
        await tokens.take("someone-else")  # both wait for their turn
        updates = [asyncio.ensure_future(r.update_weights([], 1, "rolling")) for r in replicas]
        await asyncio.sleep(0.01)
        assert all(r.swapping for r in replicas)
        with pytest.raises(TimeoutError, match=r"every replica \(replica-0, replica-1\) was still "
                                               r"swapping weights after 0\.1 s"):
            await router.sample("episode", [0], SamplingParams(n=1), "call-1")
        router.swap_wait_s = 30.0
        call = asyncio.ensure_future(router.sample("episode", [0], SamplingParams(n=1), "call-2"))
        await asyncio.sleep(0.05)
        assert not call.done() and engines[0].answered == engines[1].answered == []
        await tokens.give_back("someone-else")
        completion = await call
        assert completion.versions == [1] * 4  # sampled by a replica that had swapped
        await asyncio.gather(*updates)

    asyncio.run(scenario())


def test_ray_swap_tokens_are_the_drivers_actor_and_outlive_a_holder(ray_local):
    """The driver makes the tokens' actor (``start_swap_tokens``, as ``build_runtime`` does);
    each replica actor finds it by name, so the second waits for the first's token and names
    it. The first dies holding it: the token stays held (it lives in the driver's actor, not
    the dead replica's), until the supervisor replacing the dead replica gives it back."""
    import threading

    from streamrl.runtime.actors import RaySwapTokens, start_swap_tokens
    from streamrl.runtime.supervisor import Member, Supervisor

    @ray_local.remote(num_cpus=0)
    class ReplicaStandIn:
        def __init__(self) -> None:
            self.tokens = RaySwapTokens()

        async def take(self, holder: str) -> str | None:
            return await self.tokens.take(holder)

    with pytest.raises(RuntimeError, match="no swap tokens actor 'streamrl-swap-tokens'"):
        RaySwapTokens()
    actor = start_swap_tokens(1, 0.3)
    first = ReplicaStandIn.remote()
    assert ray_local.get(first.take.remote("replica-0"), timeout=60) is None
    ray_local.kill(first)
    second = RaySwapTokens()
    assert "replica-0 (for" in (asyncio.run(second.take("replica-1")) or "")
    supervisor = Supervisor(load_config([]), [], MemoryBuffer(B, ETA), spawn=None,
                            loops=True, lock=threading.RLock(), swap_tokens=actor)
    supervisor.replace(Member(0, first), "its actor died")  # spawn None: not re-created
    assert asyncio.run(second.take("replica-1")) is None
    ray_local.kill(actor)


def test_a_turn_that_never_comes_names_the_replica_and_the_holder():
    async def scenario():
        tokens = SwapTokens(k=1, timeout_s=0.2)
        replica = make_replica(ScriptedEngine(), None, tokens, "replica-1")
        await tokens.take("replica-0")
        with pytest.raises(TimeoutError, match=r"replica-1: no turn to load weight version 3 "
                                               r".*held by replica-0 \(for 0\.\d s\)"):
            await replica.update_weights([], 3, "rolling")
        assert not replica.swapping and replica.engine.version == 0

    asyncio.run(scenario())


def test_k_tokens_let_k_replicas_swap_at_once():
    async def scenario():
        tokens = SwapTokens(k=2, timeout_s=0.2)
        assert await tokens.take("a") is None and await tokens.take("b") is None
        assert await tokens.take("a") is None  # a holder asking again keeps its token
        assert "a (for" in (await tokens.take("c") or "")
        await tokens.give_back("a")
        assert await tokens.take("c") is None

    asyncio.run(scenario())


def test_rolling_config():
    cfg = load_config(["weight_bus.update_policy=rolling", "weight_bus.rolling_k=2"])
    assert (cfg.weight_bus.update_policy, cfg.weight_bus.rolling_k) == ("rolling", 2)
    with pytest.raises(ConfigError, match=r"^weight_bus\.rolling_k=0: must be > 0$"):
        load_config(["weight_bus.update_policy=rolling", "weight_bus.rolling_k=0"])
    with pytest.raises(ConfigError, match=r"weight_bus\.update_policy='rolling': contradicts "
                                          r"trainer\.mode='sync'"):
        load_config(["trainer.mode=sync", "weight_bus.update_policy=rolling"])
    with pytest.raises(ConfigError, match=r"weight_bus\.update_policy='rolling': needs "
                                          r"weight_bus\.backend=collective"):
        load_config(["weight_bus.update_policy=rolling", "weight_bus.backend=colocated"])
