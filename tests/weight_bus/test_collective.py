"""The collective weight bus for real: gloo groups, ZMQ control, spawned receiver processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time
from typing import Any

import pytest
import torch

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import Config, WeightBusConfig, replace
from streamrl.rollout_fleet.replica import Replica
from streamrl.runtime.actors import ReplicaActor
from streamrl.weight_bus import (
    ReceiverDied,
    WeightBusError,
    make_publisher,
    make_receiver,
)
from streamrl.weight_bus.collective import CollectivePublisher, CollectiveReceiver
from tests.support.rollout import IdTokenizer, ListedRewards, ScriptedEngine, scripted_prompts
from tests.support.weights import digest, killing, make_state, receiver_main

TIMEOUT_S = 10.0


class Fleet:
    """Spawned receiver processes reporting what they loaded."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.endpoint = endpoint
        self.reports = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.loaded: dict[str, dict[int, dict[str, str]]] = {}

    def spawn(self, *ids: str, unstuck: Any = None, receive: str = "staged") -> None:
        for rid in ids:
            proc = self.ctx.Process(target=receiver_main, daemon=True,
                                    args=(self.endpoint, rid, TIMEOUT_S, self.reports, unstuck,
                                          receive))
            proc.start()
            self.procs[rid] = proc
        ready = set()
        while ready != set(ids):
            rid, _pid, what, _ = self.reports.get(timeout=60)
            assert what == "ready"
            ready.add(rid)

    def wait_loaded(self, rid: str, version: int, timeout: float = 30) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while version not in self.loaded.get(rid, {}):
            try:
                got, _pid, v, dig = self.reports.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{rid} did not load version {version}") from None
            self.loaded.setdefault(got, {})[v] = dig
        return self.loaded[rid][version]

    def close(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
            proc.join(timeout=10)


@pytest.fixture
def publisher():
    pub = CollectivePublisher(bucket_mb=0.01, timeout_s=TIMEOUT_S)
    yield pub
    pub.close()


@pytest.fixture
def fleet(publisher: CollectivePublisher):
    f = Fleet(publisher.endpoint)
    yield f
    f.close()


def test_publish_reaches_every_receiver_and_late_joiner(publisher, fleet) -> None:
    fleet.spawn("r0", "r1")
    publisher.wait_for_receivers(2)
    v1 = make_state(1)
    stats = publisher.publish(1, v1.items())
    assert stats.receivers == ("r0", "r1") and stats.num_tensors == len(v1)
    assert stats.num_buckets > 3  # 10 KB buckets: the version really is split
    for rid in ("r0", "r1"):
        assert fleet.wait_loaded(rid, 1) == digest(v1.items())

    v2 = make_state(2)
    stats2 = publisher.publish(2, v2.items())
    assert stats2.generation == stats.generation  # same members: the group is reused
    for rid in ("r0", "r1"):
        assert fleet.wait_loaded(rid, 2) == digest(v2.items())
    assert publisher.wait_loaded(2) == {"r0": 2, "r1": 2}

    with pytest.raises(ValueError, match="version=2: must be greater"):
        publisher.publish(2, v2.items())

    # A replica joining late is behind (no copy is kept for it) and not waited for; the
    # learner's weights of version 2, gathered again, reach it alone.
    fleet.spawn("late")
    assert publisher.control.wait_for(lambda: publisher.behind() == ["late"], TIMEOUT_S)
    assert publisher.wait_loaded(2, timeout=1) == {"late": -1, "r0": 2, "r1": 2}
    with pytest.raises(ValueError, match="re-sends the latest published version"):
        publisher.catch_up(1, v1.items())
    caught = publisher.catch_up(2, v2.items())
    assert caught.receivers == ("late",) and caught.generation > stats2.generation
    assert fleet.wait_loaded("late", 2) == digest(v2.items())
    assert 1 not in fleet.loaded["late"] and publisher.behind() == []

    # The next publish re-forms the group with all three.
    v3 = make_state(3)
    stats3 = publisher.publish(3, v3.items())
    assert stats3.receivers == ("late", "r0", "r1") and stats3.generation > stats2.generation
    for rid in ("late", "r0", "r1"):
        assert fleet.wait_loaded(rid, 3) == digest(v3.items())


def test_sigkill_mid_broadcast_names_the_dead_and_survivors_rejoin(publisher, fleet) -> None:
    """A survivor that did not get the whole version is behind it (no copy is kept) until a
    catch-up re-sends it; whether its own broadcast completed before the death is timing."""
    fleet.spawn("alive", "victim")
    publisher.wait_for_receivers(2)
    v1 = make_state(1)
    publisher.publish(1, v1.items())
    fleet.wait_loaded("victim", 1)

    v2 = make_state(2)
    weights = killing(v2, after=3, pid=fleet.procs["victim"].pid)
    start = time.monotonic()
    with pytest.raises(ReceiverDied) as info:
        publisher.publish(2, weights)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S, f"the dead receiver took {elapsed:.1f} s to be named"
    err = info.value
    assert list(err.dead) == ["victim"] and "victim" in str(err)
    assert err.survivors == ["alive"] and publisher.behind() in ([], ["alive"])
    # Version 2 again (the learner's weights gathered again) on a re-formed group, intact.
    publisher.catch_up(2, v2.items())
    assert fleet.wait_loaded("alive", 2) == digest(v2.items()) and publisher.behind() == []

    v3 = make_state(3)
    stats = publisher.publish(3, v3.items())
    assert stats.receivers == ("alive",)
    assert fleet.wait_loaded("alive", 3) == digest(v3.items())


def test_a_resumed_publishers_lower_version_is_loaded_and_views_are_handed_over() -> None:
    """Versions are compared within one publisher: an engine that loaded 12 from a trainer
    joins the restarted trainer's bus (resumed from step 10, version 10 published before the
    replica reconnected) and gets 10 by catch-up, then 11."""
    cfg = WeightBusConfig(bucket_mb=1, timeout_s=TIMEOUT_S)
    got: list[tuple[int, dict[str, torch.Tensor]]] = []

    def sink(weights, version: int) -> None:
        got.append((version, dict(weights)))

    state = make_state(4)
    with make_publisher(cfg) as old, make_receiver(cfg, endpoint=old.endpoint, sink=sink,
                                                   receiver_id="kept") as rx:
        old.wait_for_receivers(1)
        old.publish(12, state.items())
        assert rx.wait_version(12, 10)
    with make_publisher(cfg) as pub:
        assert isinstance(pub, CollectivePublisher)
        pub.publish(10, state.items())  # the resume's publish, before the replica is back
        with make_receiver(cfg, endpoint=pub.endpoint, sink=sink, receiver_id="kept") as rx:
            assert isinstance(rx, CollectiveReceiver)
            pub.wait_for_receivers(1)
            pub.catch_up(10, state.items())
            assert rx.wait_version(10, 10)
            pub.publish(11, state.items())
            assert rx.wait_version(11, 10)
    assert [version for version, _ in got] == [12, 10, 11]
    assert digest(got[1][1].items()) == digest(state.items())
    # Same-dtype tensors are views into one received bucket, not copies.
    a, b = got[2][1]["layers.0.weight"], got[2][1]["layers.1.weight"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class SlowLoads(ScriptedEngine):
    """The scripted engine, at ``version``, whose weight swaps take ``load_s`` as a real
    engine's do."""

    def __init__(self, version: int, load_s: float) -> None:
        super().__init__()
        self._version = version
        self.load_s = load_s

    async def load_weights(self, weights, version: int) -> None:
        await asyncio.sleep(self.load_s)
        await super().load_weights(weights, version)


def test_a_kept_replica_adopts_the_resumed_learners_lower_version() -> None:
    """The learner resumed from step 10's checkpoint while this replica kept version 12 (a
    ``streamrl serve`` replica joining the restarted trainer's bus, ``connect_bus``): it loads
    10 and starts no group until it has, so the versions it stamps stay exact and the buffer
    has nothing to refuse."""
    cfg = replace(Config(), **{"weight_bus.bucket_mb": 1, "weight_bus.timeout_s": TIMEOUT_S,
                               "weight_bus.update_policy": "pause", "rollout.n": 2})
    buffer = MemoryBuffer(groups_per_step=2, max_staleness=0)
    buffer.rebase(learner_version=10, consumed=20)  # admission open for 2 groups at version 10
    actor = ReplicaActor(cfg, 0, buffer, None)
    actor.engine = engine = SlowLoads(version=12, load_s=0.5)
    actor.replica = Replica(engine, actor.buffer, scripted_prompts([[0.0, 1.0]] * 4),
                            ListedRewards(), IdTokenizer(), cfg.rollout, admit_backoff_s=0.001,
                            weights_pending=actor._weights_pending)

    async def resume() -> list:
        with make_publisher(cfg.weight_bus) as pub:
            await actor.connect_bus(pub.endpoint)
            await asyncio.to_thread(pub.wait_for_receivers, 1)
            await asyncio.to_thread(pub.publish, 10, make_state(2).items())
            actor.replica.start()  # version 10 is received and loading
            try:
                return await asyncio.to_thread(buffer.take, 2, 10, 30)
            finally:
                await actor.replica.stop()
                await actor.receiver.aclose()

    batch = asyncio.run(resume())
    assert engine.version == 10 and actor.receiver.version == 10
    assert [t.versions for g in batch for t in g.trajectories] == [[10] * 4] * 4
    # No group was sampled with the kept version 12. Whether the loop waited as "held for
    # weights" (received, load not begun) or as "swapping" (load under way) is timing.
    assert buffer.stats().refused == 0


def test_publish_returns_with_the_version_pending_until_the_sink_loads_it() -> None:
    """The replica's guarantee rests on this order: once ``publish`` returns (the learner may
    open admission), every receiver reports the version pending until its sink has loaded it."""
    cfg = WeightBusConfig(bucket_mb=1, timeout_s=TIMEOUT_S)
    release = threading.Event()

    def sink(weights, version: int) -> None:
        release.wait(TIMEOUT_S)

    with make_publisher(cfg) as pub, make_receiver(cfg, endpoint=pub.endpoint, sink=sink,
                                                   receiver_id="slow") as rx:
        pub.wait_for_receivers(1)
        assert rx.pending_version == -1
        pub.publish(1, make_state(1).items())
        assert rx.pending_version == 1 and rx.version == -1  # received, still loading
        with pytest.raises(WeightBusError, match="did not load version 1"):
            pub.wait_loaded(1, timeout=0.3)
        release.set()
        assert rx.wait_version(1, TIMEOUT_S)
        assert pub.wait_loaded(1) == {"slow": 1}
    assert rx.pending_version == -1


def test_aclose_on_the_loop_lets_the_version_being_loaded_finish() -> None:
    """A replica closes its receiver from the event loop its sink loads on (at the end of a
    run the last version may still be loading): a blocking close there would wait for a load
    that can never run."""
    cfg = WeightBusConfig(bucket_mb=1, timeout_s=TIMEOUT_S)
    loaded: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started, release = asyncio.Event(), asyncio.Event()

        async def sink(weights, version: int) -> None:
            started.set()
            await release.wait()
            loaded.append(version)

        with make_publisher(cfg) as pub:
            rx = make_receiver(cfg, endpoint=pub.endpoint, sink=sink, receiver_id="on-loop")
            await loop.run_in_executor(None, pub.wait_for_receivers, 1)
            await loop.run_in_executor(None, pub.publish, 1, make_state(1).items())
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            with pytest.raises(RuntimeError, match="await aclose"):
                rx.close()
            loop.call_later(0.1, release.set)
            await asyncio.wait_for(rx.aclose(), TIMEOUT_S)
            assert rx.version == 1

    asyncio.run(main())
    assert loaded == [1]


def test_later_versions_follow_the_plan_zero_copy_and_a_layout_change_makes_a_new_one() -> None:
    pub = CollectivePublisher(bucket_mb=0.01, timeout_s=TIMEOUT_S)
    fleet = Fleet(pub.endpoint)
    try:
        fleet.spawn("solo")
        pub.wait_for_receivers(1)
        for version in (1, 2, 3):  # streamed (makes the plan), announces the plan, follows it
            state = make_state(version)
            stats = pub.publish(version, state.items())
            assert fleet.wait_loaded("solo", version) == digest(state.items())
        assert stats.generation == 1 and stats.num_buckets > 3
        grown = make_state(4, scale=2)
        with pytest.raises(WeightBusError, match="do not follow the bucket plan"):
            pub.publish(4, grown.items())
        assert pub.version == 3
        pub.publish(4, grown.items())  # not published yet: the same version, on a new plan
        assert fleet.wait_loaded("solo", 4) == digest(grown.items())
    finally:
        fleet.close()
        pub.close()


def test_a_silent_receiver_is_named_within_one_timeout_and_readmitted_once_it_works(
    publisher, fleet
) -> None:
    """A receiver whose engine hangs while loading keeps heartbeating but takes no announcement:
    the publish names it within ``timeout_s`` (it was 2.4x), the others get the version, its
    heartbeats alone do not bring it back to stall the next publish, and once it works again
    a catch-up brings it to the latest version."""
    unstuck = fleet.ctx.Event()
    fleet.spawn("alive")
    fleet.spawn("stuck", unstuck=unstuck)
    publisher.wait_for_receivers(2)
    v1 = make_state(1)
    publisher.publish(1, v1.items())  # both receive it; "stuck" hangs loading it
    assert fleet.wait_loaded("alive", 1) == digest(v1.items())

    v2 = make_state(2)
    start = time.monotonic()
    with pytest.raises(ReceiverDied) as info:
        publisher.publish(2, v2.items())
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S, f"the silent receiver took {elapsed:.1f} s to be named"
    err = info.value
    assert list(err.dead) == ["stuck"] and "silent" in err.dead["stuck"]
    assert err.survivors == ["alive"]
    publisher.catch_up(2, v2.items())
    assert fleet.wait_loaded("alive", 2) == digest(v2.items())

    v3 = make_state(3)
    start = time.monotonic()
    stats = publisher.publish(3, v3.items())  # heartbeats alone: still out
    assert stats.receivers == ("alive",) and time.monotonic() - start < TIMEOUT_S / 2

    unstuck.set()  # the engine recovers: its next ack readmits it, behind v3
    assert publisher.control.wait_for(lambda: publisher.behind() == ["stuck"], 2 * TIMEOUT_S)
    assert publisher.catch_up(3, v3.items()).receivers == ("stuck",)
    assert fleet.wait_loaded("stuck", 3, timeout=3 * TIMEOUT_S) == digest(v3.items())
    assert fleet.wait_loaded("stuck", 1) == digest(v1.items()) and 2 not in fleet.loaded["stuck"]


def test_control_channel_admits_only_the_run_token(publisher: CollectivePublisher) -> None:
    """A process that reaches the control port without this run's token is dropped unheard:
    never in the roster. The token rides in the endpoint the runtime hands out."""
    from streamrl.weight_bus.control import TOKEN_QUERY, ControlClient, split_endpoint

    address, token = split_endpoint(publisher.endpoint)
    assert address.startswith("tcp://127.0.0.1:") and len(token) == 32
    clients = [ControlClient(address, "no-token", timeout_s=TIMEOUT_S),
               ControlClient(f"{address}{TOKEN_QUERY}{'0' * 32}", "wrong-token",
                             timeout_s=TIMEOUT_S),
               ControlClient(publisher.endpoint, "member", timeout_s=TIMEOUT_S)]
    try:
        assert publisher.control.wait_for(lambda: publisher.control.live() == ["member"],
                                          TIMEOUT_S)
        # two hellos and a heartbeat from each stranger: heard and dropped
        assert publisher.control.wait_for(lambda: publisher.control._strangers >= 4, TIMEOUT_S)
        assert publisher.control.live() == ["member"]
    finally:
        for client in clients:
            client.close()


def test_a_streamed_receiver_loads_as_it_receives_and_adopts_only_whole_versions(
        publisher, fleet) -> None:
    """``receive="streamed"``: the sink gets each version before it is received, and its load
    receives it bucket by bucket (tests/weight_bus/test_wire.py: through one buffer). A
    transfer that breaks off midway (the learner's weights stop following the plan after most
    segments were sent) raises inside the load and the version is not adopted; the next
    publish is. In a process of its own: a receiver left mid-version keeps posted receives,
    which gloo aborts on at exit."""
    fleet.spawn("streamed", receive="streamed")
    publisher.wait_for_receivers(1)
    for version in (1, 2, 3):  # streamed (makes the plan), announces it, follows it
        state = make_state(version)
        publisher.publish(version, state.items())
        assert fleet.wait_loaded("streamed", version) == digest(state.items())
    broken = make_state(4)
    broken["step"] = torch.tensor([1, 2])  # late in the order: after most segments
    with pytest.raises(WeightBusError, match="do not follow the bucket plan"):
        publisher.publish(4, broken.items())
    state = make_state(5)
    publisher.publish(5, state.items())  # a new plan, on a new generation
    assert fleet.wait_loaded("streamed", 5) == digest(state.items())
    assert sorted(fleet.loaded["streamed"]) == [1, 2, 3, 5]  # 4 was not adopted
