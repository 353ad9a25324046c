"""RedisBuffer against a real redis-server: round trip, what a user sees with redis-cli and
`streamrl buffer stats`, crash re-delivery, skip_ids, malformed entries, rebase, trimming, and
how many round trips each call costs."""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import redis.asyncio

from streamrl.buffer.redis import CONSUMER_GROUP, RedisBuffer
from streamrl.testing import make_group
from streamrl.types import Trajectory, encode
from tests.support import free_port

STREAMRL = Path(sys.executable).with_name("streamrl")


@pytest.fixture
def run() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def new_buffer(redis_url: str, run: str, **kw) -> RedisBuffer:
    kw.setdefault("groups_per_step", 2)
    kw.setdefault("max_staleness", 1)
    return RedisBuffer(redis_url, run, **kw)


def fill(buf: RedisBuffer, n: int, version: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        assert buf.try_admit()
        group = make_group(version, f"g{i}")
        buf.put(group)
        ids.append(group.group_id)
    return ids


def group_info(client: redis.Redis, run: str) -> dict:
    (info,) = client.xinfo_groups(f"streamrl:{run}:groups")
    return info


def command_names(packed: bytes) -> list[str]:
    """The name of each command in a packed RESP request (a pipeline packs several)."""
    names, at = [], 0
    while at < len(packed):
        end = packed.index(b"\r\n", at)
        count, at = int(packed[at + 1:end]), end + 2  # *<count>, then <count> bulk strings
        for i in range(count):
            end = packed.index(b"\r\n", at)
            size, at = int(packed[at + 1:end]), end + 2  # $<size>
            if i == 0:
                names.append(packed[at:at + size].decode().upper())
            at += size + 2
    return names


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], object]], list[list[str]]]:
    """``sent(call)``: the round trips ``call`` made, each the command names it carried (a
    pipeline's commands travel in one; a script is one EVALSHA, whatever it runs inside)."""
    trips: list[list[str]] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counting(self: redis.connection.AbstractConnection, command: object,
                 *args: object, **kwargs: object) -> None:
        chunks = [command] if isinstance(command, (bytes, str)) else command
        trips.append(command_names(b"".join(
            c.encode() if isinstance(c, str) else bytes(c) for c in chunks)))
        send(self, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)

    def record(call: Callable[[], object]) -> list[list[str]]:
        trips.clear()
        call()
        return list(trips)
    return record


def test_round_trips_per_group_and_per_step(
        redis_url: str, run: str, sent: Callable[[Callable[[], object]], list[list[str]]]) -> None:
    buf = new_buffer(redis_url, run, groups_per_step=2, max_staleness=3)
    fill(buf, 2)
    buf.ack([g.group_id for g in buf.take(2, 0)])  # scripts loaded, own pending entries read
    assert buf.try_admit()
    # per group: admission, then (after sampling) the put: one script each
    assert sent(buf.try_admit) == [["EVALSHA"]]
    # a replica refilling its free slots: one script for all of them
    claimed: list[int] = []
    assert sent(lambda: claimed.append(buf.admit_up_to(3, "r"))) == [["EVALSHA"]]
    assert claimed == [3] and buf.release("r") == 3
    assert sent(lambda: buf.put(make_group(0, "p0"))) == [["EVALSHA"]]
    buf.put(make_group(0, "p1"))
    # per step: XREADGROUP for the batch and the script counting it in one round trip, one
    # script acking and trimming (XAUTOCLAIM polls for a vanished learner's entries at most once
    # a second, not per step)
    taken: list = []
    trips = [t for t in sent(lambda: taken.extend(buf.take(2, 0))) if t != ["XAUTOCLAIM"]]
    assert trips == [["XREADGROUP", "EVALSHA"]]
    assert sent(lambda: buf.ack([g.group_id for g in taken])) == [["EVALSHA"]]
    assert buf._r.xlen(buf.keys.groups) == 0  # trimmed in the same script
    # a new learner version is published before take waits: it opens admission
    with pytest.raises(TimeoutError):
        buf.take(1, 2, timeout=0)
    assert buf.stats().learner_version == 2
    buf.set_version(2)  # (loads the script)
    assert sent(lambda: buf.set_version(3)) == [["EVALSHA"]]
    buf.purge()


def test_round_trip_and_blocking_take(redis_url: str, run: str) -> None:
    buf = new_buffer(redis_url, run)
    sent = make_group([0, 1], "a", n=3)
    assert buf.try_admit()

    def replica() -> None:
        time.sleep(0.2)
        buf.put(sent)

    thread = threading.Thread(target=replica)
    thread.start()
    (got,) = buf.take(1, learner_version=1, timeout=10)  # blocks in XREADGROUP until the put
    thread.join()
    assert got == sent
    buf.ack(["a"])
    with pytest.raises(ValueError, match="not taken or already acked"):
        buf.ack(["a"])
    with pytest.raises(TimeoutError, match="1 groups wanted, 0 ready"):
        buf.take(1, 1, timeout=0.1)
    buf.purge()


def test_stats_hash_and_xinfo_tell_the_lag(redis_url: str, run: str, client: redis.Redis) -> None:
    buf = new_buffer(redis_url, run)  # B=2, eta=1: 4 slots at V=0
    fill(buf, 3)
    assert buf.try_admit() and not buf.try_admit()
    taken = buf.take(2, learner_version=0)
    port = urlparse(redis_url).port
    out = subprocess.run(["redis-cli", "-p", str(port), "HGETALL", f"streamrl:{run}:stats"],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    stats = dict(zip(out[0::2], out[1::2]))
    assert {k: stats[k] for k in ("learner_version", "produced", "consumed", "queued",
                                  "started", "in_flight", "dropped", "malformed",
                                  "groups_per_step", "max_staleness", "staleness_max")} == {
        "learner_version": "0", "produced": "3", "consumed": "2", "queued": "1", "started": "4",
        "in_flight": "1", "dropped": "0", "malformed": "0", "groups_per_step": "2",
        "max_staleness": "1", "staleness_max": "0"}
    assert abs(float(stats["last_update_ts"]) - time.time()) < 60
    info = group_info(client, run)
    assert (info["name"], info["lag"], info["pending"], info["consumers"]) == (
        CONSUMER_GROUP.encode(), 1, 2, 1)
    buf.ack([g.group_id for g in taken])
    buf.set_version(1)
    info = group_info(client, run)
    assert (info["lag"], info["pending"]) == (1, 0)
    assert client.xlen(f"streamrl:{run}:groups") == 1  # acked entries trimmed, backlog kept
    assert buf.stats().learner_version == 1 and buf.try_admit()
    buf.purge()


def test_crashed_learner_gets_its_groups_again(redis_url: str, run: str) -> None:
    first = new_buffer(redis_url, run, consumer="learner-0")
    fill(first, 4)
    lost = [g.group_id for g in first.take(2, 0)]
    first.close()  # killed after take, before ack
    # Restart under the same consumer name: its own pending entries come first.
    second = new_buffer(redis_url, run, consumer="learner-0")
    assert [g.group_id for g in second.take(2, 0)] == lost
    assert second.stats().consumed == 2  # delivered twice, counted once
    second.close()
    # Restart under a new name: the vanished consumer's entries are claimed once idle.
    third = new_buffer(redis_url, run, consumer="learner-1", claim_idle_s=0.2)
    time.sleep(0.3)
    assert [g.group_id for g in third.take(2, 0)] == lost
    third.ack(lost)
    assert [g.group_id for g in third.take(2, 0)] == ["g2", "g3"]
    s = third.stats()
    assert (s.consumed, s.queued, s.started) == (4, 0, 4)
    third.purge()


def test_skip_ids_are_not_trained_twice(redis_url: str, run: str, client: redis.Redis) -> None:
    first = new_buffer(redis_url, run)
    fill(first, 4)
    trained = [g.group_id for g in first.take(2, 0)]
    first.close()  # checkpoint recorded `trained`, crash before ack
    second = new_buffer(redis_url, run, skip_ids=trained)
    assert [g.group_id for g in second.take(2, 1)] == ["g2", "g3"]
    assert group_info(client, run)["pending"] == 2  # the skipped ones were acked
    assert second.stats().consumed == 4
    second.purge()


def test_rebase_claims_requeues_and_keeps_the_bound(redis_url: str, run: str) -> None:
    first = new_buffer(redis_url, run, consumer="old")
    fill(first, 4)
    step0 = [g.group_id for g in first.take(2, 0)]
    first.ack(step0)
    first.set_version(1)
    assert first.try_admit()
    first.put(make_group(1, "h0"))
    assert first.try_admit()  # one replica still sampling when everything dies
    assert not first.try_admit()  # (V + eta + 1) * B = 6 slots in use
    step1 = [g.group_id for g in first.take(2, 1)]  # g2 trained + checkpointed; g3 not
    first.close()
    resumed = new_buffer(redis_url, run, consumer="new")  # another host: no own pending
    resumed.rebase(learner_version=1, consumed=3, skip_ids=[step1[0]])
    s = resumed.stats()
    assert (s.learner_version, s.consumed, s.queued, s.in_flight) == (1, 3, 2, 0)
    assert s.started == 5  # consumed + queued: the dead replica's slot is free again
    assert resumed.try_admit()
    assert [g.group_id for g in resumed.take(2, 1)] == [step1[1], "h0"]
    resumed.purge()


def test_malformed_entries_are_skipped_counted_and_dead_lettered(
    redis_url: str, run: str, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    buf = new_buffer(redis_url, run)
    stream = f"streamrl:{run}:groups"
    wrong_type = Trajectory(uid="u", group_id="w", prompt_ids=[1], response_ids=[],
                            loss_mask=[], logprobs=[], versions=[])
    bad = [
        client.xadd(stream, {"group_id": "x", "data": b"\xc1\xff garbage"}),
        client.xadd(stream, {"group_id": "w", "data": encode(wrong_type)}),
        client.xadd(stream, {"something": "else"}),
    ]
    fill(buf, 2)
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.redis"):
        got = buf.take(2, 0, timeout=5)
    assert [g.group_id for g in got] == ["g0", "g1"]
    assert buf.stats().malformed == 3
    for eid in bad:
        assert eid.decode() in caplog.text
    dead = client.xrange(f"streamrl:{run}:dead")
    assert [e[1][b"source_id"] for e in dead] == bad
    assert dead[0][1][b"field:data"] == b"\xc1\xff garbage"
    assert group_info(client, run)["pending"] == 2  # only the real groups await an ack
    buf.purge()


def test_a_group_newer_than_the_learner_is_refused_naming_it(
    redis_url: str, run: str, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """After a resume from step 10's checkpoint, a group carrying any token of version 12
    (negative staleness) is never trained: refused with one line naming it, its holder and the
    versions, dead-lettered, its slot given back; the others are delivered and counted once.
    The first read (mixed, ok) is counted by TAKE and then uncounted; the second (future) is
    not counted at all."""
    buf = new_buffer(redis_url, run, groups_per_step=2, max_staleness=1)
    buf.rebase(learner_version=10, consumed=20)
    puts = [("mixed", [10, 12], "replica-1.0"), ("ok", [10], "replica-0.0"),
            ("future", [12], "replica-2.0"), ("ok2", [9, 10], "replica-0.0")]
    for gid, versions, holder in puts:
        assert buf.try_admit(holder)
        buf.put(make_group(versions, gid), holder)
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.redis"):
        assert [g.group_id for g in buf.take(2, 10, timeout=5)] == ["ok2", "ok"]
    s = buf.stats()
    assert (s.refused, s.consumed, s.queued, s.in_flight, s.dropped) == (2, 22, 0, 0, 0)
    assert s.started == s.consumed + s.queued + s.in_flight
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "group mixed (prompt -1, put by replica-1.0) has policy versions 10..12, newer " \
           "than learner version 10" in lines[0]
    assert "group future (prompt -1, put by replica-2.0)" in lines[1] and "12..12" in lines[1]
    dead = client.xrange(f"streamrl:{run}:dead")
    assert [e[1][b"field:group_id"] for e in dead] == [b"mixed", b"future"]
    assert dead[0][1][b"field:holder"] == b"replica-1.0"
    assert buf.try_admit() and buf.try_admit()  # the refused groups' slots are free again
    buf.purge()


def test_config_mismatch_and_version_regress_are_refused(redis_url: str, run: str) -> None:
    buf = new_buffer(redis_url, run, groups_per_step=2, max_staleness=1)
    with pytest.raises(ValueError, match=r"groups_per_step=2, max_staleness=1.*another buffer"):
        new_buffer(redis_url, run, groups_per_step=4, max_staleness=1)
    with pytest.raises(ValueError, match=r"buffer\.run='bad run'"):
        new_buffer(redis_url, "bad run")
    buf.set_version(2)
    with pytest.raises(ValueError, match=r"learner_version=1 < current 2.*use rebase"):
        buf.set_version(1)
    buf.purge()


def test_streamrl_buffer_stats_cli(redis_url: str, run: str) -> None:
    buf = new_buffer(redis_url, run)
    fill(buf, 3)
    buf.take(2, 0)
    buf.set_version(1)
    for holder, version in (("replica-0.0", 0), ("replica-1.3", 1)):
        assert buf.try_admit(holder)
        buf.put(make_group(version, holder), holder)
    # per replica (across its restarts): groups produced and the version of its last one
    stats = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(f"streamrl:{run}:stats")
    assert (stats["produced:replica-1"], stats["version:replica-1"]) == ("1", "1")
    done = subprocess.run([str(STREAMRL), "buffer", "stats", "--redis-url", redis_url,
                           "--run", run], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"streamrl buffer  run={run}  {redis_url}"
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[1:] if ln.strip()}
    assert rows["learner_version"] == ["1"] and rows["queued"] == ["3"]
    assert rows["consumed"] == ["2"] and rows["started"] == ["5"]
    assert rows["admission"][0] == "5/6"
    # which replica is behind: produced, version of its last group, lag behind the learner
    assert rows["replica-0"] == ["1", "0", "1"] and rows["replica-1"] == ["1", "1", "0"]
    assert rows["consumer_group"] == ["lag", "pending", "consumers", "last_delivered_id"]
    assert rows["learners"][:3] == ["3", "2", "1"]
    missing = subprocess.run([str(STREAMRL), "buffer", "stats", "--redis-url", redis_url,
                              "--run", "no-such-run"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no buffer for run 'no-such-run'" in missing.stderr
    dead_url = f"redis://127.0.0.1:{free_port()}/0"
    down = subprocess.run([str(STREAMRL), "buffer", "stats", "--redis-url", dead_url,
                           "--run", run], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and f"cannot read {dead_url}" in down.stderr
    watch = subprocess.Popen([str(STREAMRL), "buffer", "stats", "--redis-url", redis_url,
                              "--run", run, "--watch", "--interval", "0.2"],
                             stdout=subprocess.PIPE, text=True)
    time.sleep(5)  # the CLI's start-up, then several refreshes
    watch.send_signal(signal.SIGINT)
    frames, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0
    assert frames.count(f"streamrl buffer  run={run}") >= 2
    buf.purge()


def test_pickled_buffer_reconnects_to_the_same_run(redis_url: str) -> None:
    """The runtime hands the driver's buffer to every replica: a copy shares the run."""

    buf = new_buffer(redis_url, f"pickle-{uuid.uuid4().hex[:6]}")
    try:
        copy = pickle.loads(pickle.dumps(buf))
        assert copy.try_admit()
        copy.put(make_group(0, group_id="from-copy"))
        assert [g.group_id for g in buf.take(1, 0, timeout=5)] == ["from-copy"]
        assert buf.stats().produced == 1
        copy.close()
    finally:
        buf.purge()
        buf.close()


def _redis_server(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """redis-server in the foreground (append-only, data in ``workdir``), answering PING."""
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return server
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


def test_a_restarted_redis_is_reconnected_and_a_lasting_outage_stops_the_run(
        tmp_path: Path) -> None:
    from streamrl.errors import RunStopped

    port = free_port()
    servers = [_redis_server(port, tmp_path)]
    try:
        buf = RedisBuffer(f"redis://127.0.0.1:{port}/0", "outage", 1, 1, outage_s=5)
        assert buf.try_admit("replica-0.0")
        buf.put(make_group(0, "g1"), "replica-0.0")
        servers[0].terminate()  # a clean restart: the append-only file keeps the run
        servers[0].wait()
        restart = threading.Timer(1.0, lambda: servers.append(_redis_server(port, tmp_path)))
        restart.start()
        groups = buf.take(1, 0, timeout=10)  # retried through the restart
        restart.join()
        assert [g.group_id for g in groups] == ["g1"]
        buf.ack(["g1"])
        s = buf.stats()
        assert (s.produced, s.consumed, s.queued, s.in_flight, s.started) == (1, 1, 0, 0, 1)

        servers[-1].kill()  # gone for good: one error naming the URL after outage_s
        start = time.monotonic()
        with pytest.raises(RunStopped, match=rf"redis://127.0.0.1:{port}/0.*unreachable for "
                                             r"buffer.redis_outage_s=5"):
            buf.stats()
        assert 4 < time.monotonic() - start < 15
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_a_redis_that_stops_answering_stops_the_run_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that still accepts connections but answers nothing (stopped, or wedged): the
    learner's and a replica's calls give up after outage_s with the URL, instead of hanging."""
    from streamrl.buffer.redis import connection
    from streamrl.errors import RunStopped

    monkeypatch.setattr(connection, "READ_TIMEOUT_S", 1.0)
    port = free_port()
    server = _redis_server(port, tmp_path)
    try:
        buf = RedisBuffer(f"redis://127.0.0.1:{port}/0", "stopped", 1, 1, outage_s=2)
        holder = "replica-0.0"

        async def replica_put(group_id: str) -> bool:
            return await buf.aput_and_admit(make_group(0, group_id), holder)

        loop = asyncio.new_event_loop()
        assert buf.try_admit(holder)
        assert loop.run_until_complete(replica_put("g1"))  # 2 slots at V=0: claims the next
        server.send_signal(signal.SIGSTOP)
        stopped = rf"redis://127.0.0.1:{port}/0.*buffer.redis_outage_s=2 .*Timeout"
        for call in (lambda: buf.take(1, 0, timeout=30),
                     lambda: loop.run_until_complete(replica_put("g2"))):
            start = time.monotonic()
            with pytest.raises(RunStopped, match=stopped):
                call()
            assert 2 <= time.monotonic() - start < 8  # outage_s, plus at most one read timeout
        server.send_signal(signal.SIGCONT)
        assert [g.group_id for g in buf.take(1, 0, timeout=10)] == ["g1"]  # nothing was lost
        loop.run_until_complete(buf.aclose())
        loop.close()
        buf.close()
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


def test_a_redis_restarted_empty_is_refilled_from_what_the_learner_knows(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Redis comes back without the run's keys (no persistence): the learner's next call sees
    them gone, makes them again at its version and consumed count, warns once with the groups
    lost (those queued there), and the run goes on: groups put since are delivered, admission
    reopens within the bound, trained entries ack."""
    port = free_port()
    for data in ("before", "after"):
        (tmp_path / data).mkdir()
    servers = [_redis_server(port, tmp_path / "before")]
    try:
        learner = RedisBuffer(f"redis://127.0.0.1:{port}/0", "wiped", 2, 1, outage_s=10)
        replica = pickle.loads(pickle.dumps(learner))
        learner.set_version(0)
        assert replica.admit_up_to(10, "r") == 4  # (0 + 1 + 1) * 2
        for gid in "abc":
            replica.put(make_group(0, gid), "r")
        taken = learner.take(2, 0, timeout=5)
        learner.set_version(1)
        s = learner.stats()
        assert (s.consumed, s.queued, s.in_flight, s.started) == (2, 1, 1, 4)
        servers[0].terminate()
        servers[0].wait()
        servers.append(_redis_server(port, tmp_path / "after"))  # empty: a new data dir

        replica.put(make_group(1, "d"), "r")  # its slot died with the keys: takes a fresh one
        with caplog.at_level(logging.WARNING, logger="streamrl.buffer.redis.backend"):
            learner.ack([g.group_id for g in taken])  # the first learner call to see it
            assert [g.group_id for g in learner.take(1, 1, timeout=5)] == ["d"]
        [warning] = [r.getMessage() for r in caplog.records if "keys are gone" in r.getMessage()]
        assert "learner version 1 with 2 group(s) consumed: lost the 1 group(s) queued" in warning
        s = learner.stats()
        assert (s.learner_version, s.consumed, s.queued, s.in_flight, s.started) == (1, 3, 0, 0, 3)
        assert replica.admit_up_to(10, "r") == 3  # capacity(1) = 6
        stats = redis.Redis(port=port).hgetall("streamrl:wiped:stats")
        assert (stats[b"lost"], stats[b"produced"]) == (b"1", b"3")
        replica.close()
        learner.close()
    finally:
        for server in servers:
            server.kill()
            server.wait()


@pytest.fixture
def async_sent(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The round trips the buffer's event-loop writer makes, each the command names it carried
    (the asyncio twin of ``sent``; a new connection's handshake is left out)."""
    trips: list[list[str]] = []
    conn = redis.asyncio.connection.AbstractConnection
    send = conn.send_packed_command

    async def counting(self: redis.asyncio.connection.AbstractConnection, command: object,
                       *args: object, **kwargs: object) -> None:
        chunks = [command] if isinstance(command, (bytes, str)) else command
        names = command_names(b"".join(
            c.encode() if isinstance(c, str) else bytes(c) for c in chunks))
        if not set(names) <= {"HELLO", "CLIENT", "AUTH", "SELECT"}:
            trips.append(names)
        await send(self, command, *args, **kwargs)

    monkeypatch.setattr(conn, "send_packed_command", counting)
    return trips


def test_replica_calls_from_an_event_loop_share_round_trips(
        redis_url: str, run: str, async_sent: list[list[str]]) -> None:
    """What a replica's loop does: the calls its tasks make together travel together, a put
    claims the next group's slot exactly while the bound allows, errors reach the caller."""
    from streamrl.buffer.redis.writer import WRITER_PIPELINES

    buf = new_buffer(redis_url, run, groups_per_step=4, max_staleness=1)  # 8 slots at V=0
    holder = "replica-0.0"

    async def replica() -> None:
        assert await buf.atry_admit(holder)  # starts the writer (and loads the scripts)
        async_sent.clear()
        assert await asyncio.gather(*(buf.atry_admit(holder) for _ in range(3))) == [True] * 3
        assert 1 <= len(async_sent) <= WRITER_PIPELINES
        assert sum(map(len, async_sent)) == 3  # three ADMIT scripts
        async_sent.clear()
        puts = [buf.aput_and_admit(make_group(0, f"g{i}"), holder) for i in range(4)]
        assert await asyncio.gather(*puts) == [True] * 4  # started 4 -> 8: each claim fits
        # consecutive puts go as one PUT script per pipeline, however many groups it carries
        assert 1 <= len(async_sent) <= WRITER_PIPELINES
        assert all(trip == ["EVALSHA"] for trip in async_sent)
        s = buf.stats()
        assert (s.started, s.produced, s.queued, s.in_flight) == (8, 4, 4, 4)
        # at the bound: the put lands, the claim is refused; a retried put is a no-op
        assert await buf.aput_and_admit(make_group(0, "g4"), holder) is False
        assert await buf.aput_and_admit(make_group(0, "g4"), holder) is False
        assert await buf.aput(make_group(0, "g5"), holder) is None
        s = buf.stats()
        assert (s.started, s.produced, s.queued, s.in_flight) == (8, 6, 6, 2)
        await asyncio.gather(buf.acancel_admission(holder), buf.acancel_admission(holder))
        # a script's error reaches its caller, the calls sent with it are not affected, and
        # the writer goes on
        refused, admitted = await asyncio.gather(buf.acancel_admission(holder),
                                                 buf.atry_admit(holder), return_exceptions=True)
        assert isinstance(refused, ValueError) and admitted is True
        assert "no admitted group is in flight for holder replica-0.0" in str(refused)
        with pytest.raises(TypeError, match="put: expected a Group, got dict"):
            buf.aput({"group_id": "x"}, holder)  # type: ignore[arg-type]
        await buf.acancel_admission(holder)
        await buf.aclose()

    asyncio.run(replica())
    s = buf.stats()
    assert (s.started, s.produced, s.queued, s.in_flight) == (6, 6, 6, 0)
    assert s.started == s.consumed + s.queued + s.in_flight
    buf.purge()
    buf.close()


def test_a_cancelled_caller_does_not_withdraw_its_put_and_close_sends_the_queue(
        redis_url: str, run: str) -> None:
    buf = new_buffer(redis_url, run, groups_per_step=4, max_staleness=1)

    async def cancelled_put() -> None:
        task = asyncio.ensure_future(buf.aput(make_group(0, "kept")))
        await asyncio.sleep(0)  # the put is queued
        task.cancel()
        deadline = time.monotonic() + 10
        while buf.stats().produced == 0:
            assert time.monotonic() < deadline, "the cancelled caller's put never landed"
            await asyncio.sleep(0.01)
        await buf.aclose()

    asyncio.run(cancelled_put())
    # a replica loop in another thread: close() from here waits for what it queued
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def queue_puts() -> list[asyncio.Future]:
        return [buf.aput(make_group(0, f"q{i}")) for i in range(5)]

    futures = asyncio.run_coroutine_threadsafe(queue_puts(), loop).result(10)
    buf.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert buf.stats().produced == 6
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    buf.purge()
    buf.close()


def test_a_counted_entry_that_does_not_decode_is_uncounted(
        redis_url: str, run: str, client: redis.Redis) -> None:
    """TAKE counts a complete batch as it reads it (one round trip); an entry in it that then
    fails to decode is dead-lettered and uncounted, so the accounting stays exact."""
    buf = new_buffer(redis_url, run, groups_per_step=2, max_staleness=1)
    k = buf.keys
    bad = client.xadd(k.groups, {"group_id": "m", "min_version": "0", "data": b"\xc1 junk"})
    client.sadd(k.queued, bad)  # as PUT would have recorded it
    client.hset(k.minv, bad, 0)
    client.hincrby(k.stats, "started", 1)
    client.hincrby(k.stats, "produced", 1)
    fill(buf, 2)
    assert [g.group_id for g in buf.take(2, 0, timeout=5)] == ["g0", "g1"]
    s = buf.stats()
    assert (s.malformed, s.consumed, s.queued, s.started, s.produced) == (1, 2, 0, 2, 3)
    assert s.started == s.consumed + s.queued + s.in_flight
    assert client.hlen(k.minv) == 0  # nothing left behind
    assert client.xrange(k.dead)[0][1][b"source_id"] == bad
    buf.purge()


# A streamrl serve sharing the run (its own client, holder ""): it claims slots, then dies.
SERVICE_THAT_DIES = """if True:
    import sys, time
    from streamrl.buffer.redis import RedisBuffer
    url, run, b, eta, n = sys.argv[1:6]
    buf = RedisBuffer(url, run, int(b), int(eta), lease_ttl_s=1.0, session="dead-serve")
    print(buf.admit_up_to(int(n)), flush=True)
    time.sleep(120)
"""


def kill_a_service_holding(redis_url: str, run: str, b: int, eta: int, n: int) -> None:
    """Start a process that claims ``n`` slots as holder "" (session ``dead-serve``, lease 1 s),
    then kill -9 it."""
    proc = subprocess.Popen([sys.executable, "-c", SERVICE_THAT_DIES, redis_url, run, str(b),
                             str(eta), str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == str(n)
    finally:
        proc.kill()
        proc.wait()


def test_a_crashed_service_s_slots_come_back_when_its_lease_expires(
        redis_url: str, run: str, caplog: pytest.LogCaptureFixture) -> None:
    """A serve process killed while it holds every slot: the restarted one is refused (429)
    only until the dead one's lease expires; then its heartbeat reclaims the slots, counted and
    logged once with the holder's name."""
    kill_a_service_holding(redis_url, run, b=2, eta=0, n=2)
    restarted = new_buffer(redis_url, run, groups_per_step=2, max_staleness=0, lease_ttl_s=1.0)
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.redis"):
        assert not restarted.try_admit()  # the bound is reached: by a process that is gone
        deadline = time.monotonic() + 15
        while not restarted.try_admit():
            assert time.monotonic() < deadline, "the dead service's slots never came back"
            time.sleep(0.1)
    s = restarted.stats()
    assert (s.reclaimed, s.in_flight, s.started) == (2, 1, 1)
    lines = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
    assert len(lines) == 1 and "reclaimed 2 admission slot(s) of holder @dead-serve" in lines[0]
    restarted.close()
    restarted.purge()


def test_a_waiting_learner_reclaims_a_dead_holder_s_slots(redis_url: str, run: str) -> None:
    """No other producer is left to beat: the learner's take, waiting for groups the dead
    process will never put, reclaims its slots itself (the next replica or client may start)."""
    kill_a_service_holding(redis_url, run, b=1, eta=0, n=1)
    learner = new_buffer(redis_url, run, groups_per_step=1, max_staleness=0)
    with pytest.raises(TimeoutError):
        learner.take(1, 0, timeout=4)
    s = learner.stats()
    assert (s.reclaimed, s.in_flight, s.started) == (1, 0, 0)
    assert learner.try_admit()
    learner.purge()


def test_a_live_holder_keeps_its_slots_past_the_lease_ttl(redis_url: str, run: str) -> None:
    """The heartbeat renews a live client's leases: nothing is reclaimed from it, a resume keeps
    its slots; once it closes, its leftover slots come back."""
    holder = new_buffer(redis_url, run, lease_ttl_s=0.6)
    assert holder.admit_up_to(2, "replica-0.0") == 2
    time.sleep(2.0)  # three lease lifetimes, renewed every 0.2 s
    learner = new_buffer(redis_url, run)
    with pytest.raises(TimeoutError):
        learner.take(1, 0, timeout=1.5)  # reaps while it waits
    learner.rebase(learner_version=0, consumed=0)
    s = learner.stats()
    assert (s.reclaimed, s.in_flight, s.started) == (0, 2, 2)
    holder.close()
    with pytest.raises(TimeoutError):
        learner.take(1, 0, timeout=2.5)
    s = learner.stats()
    assert (s.reclaimed, s.in_flight, s.started) == (2, 0, 0)
    learner.purge()


def test_a_trainer_resume_keeps_a_live_service_s_admissions(redis_url: str, run: str) -> None:
    """The trainer resumes from a checkpoint while streamrl serve holds open groups: rebase
    keeps the slots of holders with a live lease, so the service's cancel and put settle them
    as before (no error, no lost group), and drops those of a holder that is gone."""
    service = new_buffer(redis_url, run)  # B=2, eta=1: 4 slots
    assert service.admit_up_to(2) == 2
    gone = new_buffer(redis_url, run)
    assert gone.try_admit("replica-0.0")
    gone.close()  # its process ended; it will never put
    trainer = new_buffer(redis_url, run, consumer="resumed")
    trainer.rebase(learner_version=0, consumed=0)
    s = trainer.stats()
    assert (s.in_flight, s.started, s.queued) == (2, 2, 0)
    service.cancel_admission()  # a client's failed episode gives its slot back
    service.put(make_group(0, "served"))  # the other group settles its own slot
    s = trainer.stats()
    assert (s.in_flight, s.started, s.queued) == (0, 1, 1)
    assert [g.group_id for g in trainer.take(1, 0, timeout=5)] == ["served"]
    service.close()
    trainer.purge()


def test_same_named_holders_of_two_clients_are_apart(redis_url: str, run: str) -> None:
    """A restarted trainer names its replicas as the previous one did (replica-0.0): each
    client's holders are its own, so its supervisor releases exactly its replica's slots, and
    the buffer it sends to a replica keeps its session."""

    old_trainer = new_buffer(redis_url, run)
    assert old_trainer.try_admit("replica-0.0")
    trainer = new_buffer(redis_url, run)
    replica = pickle.loads(pickle.dumps(trainer))
    assert replica.admit_up_to(2, "replica-0.0") == 2
    assert trainer.release("replica-0.0") == 2
    assert trainer.stats().in_flight == 1
    replica.close()
    old_trainer.close()
    trainer.purge()


def test_messages_naming_the_redis_url_mask_its_password(
        capsys: pytest.CaptureFixture[str]) -> None:
    """buffer.redis_url may carry a password: the errors that quote it, and `streamrl buffer
    stats`, mask it."""
    from streamrl.buffer.redis import print_stats
    from streamrl.buffer.redis.connection import connect, outage_error
    from streamrl.errors import ConfigError

    url = f"redis://learner:s3cret-pw@127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError) as err:
        connect(url)
    stopped = outage_error(url, 5, redis.ConnectionError(f"lost {url}"))
    assert print_stats(url, "r") == 1
    query = "redis://127.0.0.1:1/0?password=s3cret-pw"
    with pytest.raises(ConfigError) as err2:
        connect(query)
    for message in (str(err.value), str(stopped), capsys.readouterr().err, str(err2.value)):
        assert "s3cret-pw" not in message and "***" in message, message
