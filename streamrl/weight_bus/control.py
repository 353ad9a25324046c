"""The weight bus control plane: ZMQ ROUTER (learner) <-> DEALER (each receiver), msgspec messages.

Parts:
- Messages (MessagePack, tagged): receivers send ``Hello``, ``Heartbeat``, ``Ack`` (stages
  ``announced`` when the receiver takes the announcement, ``received`` with the
  ``WeightManifest`` it assembled, ``loaded``, ``skipped``, ``failed``) and
  ``Bye``; the learner sends ``Announce`` (version + the ``GroupSpec`` of the generation to
  join) to each receiver it addresses.
- ``ControlServer`` (learner): roster of receivers with liveness from heartbeats, ack bookkeeping,
  bounded waits. ``ControlClient`` (receiver): hello, heartbeats, acks, a queue of announcements.
- ``heartbeat_interval`` / ``dead_after``: both sides derive liveness timing from
  ``weight_bus.timeout_s`` so a dead receiver is named well within one timeout.
- The run token: the server draws one per run and hands it out inside its endpoint
  (``tcp://host:port?token=...``, see ``split_endpoint``); every message a receiver sends
  carries it as its first frame, and the server drops any message without it, so only members
  of the run join the roster, ack or learn a generation's store namespace.

One ROUTER rather than PUB/SUB: announcements are addressed (each receiver gets its own rank) and
never lost to the slow-joiner effect. Each side runs one IO thread that alone touches its socket;
other threads hand it messages through a queue and wake it over an inproc pair.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import msgspec
import zmq

from streamrl.net import LOOPBACK
from streamrl.types import WeightManifest
from streamrl.weight_bus.groups import GroupSpec, WeightBusTimeout

log = logging.getLogger(__name__)
_wake_ids = itertools.count()
TOKEN_QUERY = "?token="


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``tcp://host:port?token=T`` -> (``tcp://host:port``, ``T``); no token -> ``""``."""
    address, _, token = endpoint.partition(TOKEN_QUERY)
    return address, token


def heartbeat_interval(timeout_s: float) -> float:
    return min(0.5, timeout_s / 20)


def dead_after(timeout_s: float) -> float:
    """Silence after which a receiver counts as dead (a few missed heartbeats, < timeout_s)."""
    return min(timeout_s / 2, max(3.0, 6 * heartbeat_interval(timeout_s)))


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    receiver_id: str
    loaded_version: int


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    receiver_id: str
    loaded_version: int


class Bye(msgspec.Struct, tag="bye", kw_only=True):
    receiver_id: str


ACK_STAGES = ("announced", "received", "loaded", "skipped", "failed")


class Ack(msgspec.Struct, tag="ack", kw_only=True):
    receiver_id: str
    publish_id: str
    version: int
    stage: str
    manifest: WeightManifest | None = None
    error: str = ""


class Announce(msgspec.Struct, tag="announce", kw_only=True):
    version: int
    publish_id: str
    group: GroupSpec


ToLearner = Union[Hello, Heartbeat, Bye, Ack]  # noqa: UP007 - msgspec needs a runtime Union
_to_learner = msgspec.msgpack.Decoder(ToLearner)
_to_receiver = msgspec.msgpack.Decoder(Announce)
_encoder = msgspec.msgpack.Encoder()


class _IOThread:
    """Owns one socket: receives into ``handle``, sends what other threads queue, ticks."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, handle: Callable[[list[bytes]], None],
                 tick: Callable[[], None], tick_s: float, name: str) -> None:
        self.sock, self.handle, self.tick, self.tick_s = sock, handle, tick, tick_s
        address = f"inproc://streamrl-weight-bus-wake-{next(_wake_ids)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self._outbox: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, frames: list[bytes]) -> None:
        self._outbox.put(frames)
        with self._wake_lock:  # the lock makes this socket's use by many threads sequential
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self.sock.poll(0):
                try:
                    self.handle(self.sock.recv_multipart())
                except Exception:  # one bad message must not stop the control plane
                    log.exception("weight bus: dropped a control message")
            self._flush()
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick = time.monotonic() + self.tick_s
        self._flush()  # a last message (a receiver's bye) still goes out

    def _flush(self) -> None:
        while True:
            try:
                frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            if frames:
                try:
                    self.sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:  # peer unreachable and queue full: liveness will tell
                    log.warning("weight bus: control message dropped (peer queue full)")

    def close(self) -> None:
        self._stop.set()
        self.send([])  # wakes the loop; the empty message is never sent
        self._thread.join(timeout=5)
        for sock in (self.sock, self._wake_rx, self._wake_tx):
            sock.close(linger=0)


@dataclass
class Peer:
    """What the learner knows about one receiver."""

    receiver_id: str
    last_seen: float
    loaded_version: int = -1
    received_version: int = -1
    gone: str = ""
    """Why it left (``bye`` or the reason it was declared dead); empty while it is a member."""
    silenced: bool = False
    """Declared lost while still heartbeating: only an ack (a sign of work) or a hello readmits
    it, else its heartbeats would re-admit it to stall every publish again."""


class ControlServer:
    """Learner side: binds a ROUTER, tracks receivers and their acks."""

    def __init__(self, host: str = LOOPBACK, port: int = 0, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        self.dead_after_s = dead_after(timeout_s)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted receiver reclaims its identity
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.endpoint = f"{self.address}{TOKEN_QUERY}{self.token}"
        """What receivers connect to: the address and the run token."""
        self._strangers = 0
        self.cond = threading.Condition()
        self.peers: dict[str, Peer] = {}
        self._acks: dict[str, dict[str, dict[str, Ack]]] = {}
        """publish id -> receiver id -> stage -> ack."""
        self._io = _IOThread(self._ctx, sock, self._handle, self._tick, 0.25,
                             "weight-bus-control-server")
        self._io.start()

    # -- incoming -------------------------------------------------------------------------
    def _handle(self, frames: list[bytes]) -> None:
        # [routing id (= receiver id), run token, message]
        if len(frames) != 3 or not hmac.compare_digest(frames[1], self.token.encode()):
            self._strangers += 1
            if self._strangers in (1, 10, 100) or self._strangers % 1000 == 0:
                log.warning("weight bus: dropped %d control message(s) without this run's "
                            "token (a process that is not a member of the run)", self._strangers)
            return
        msg = _to_learner.decode(frames[2])
        now = time.monotonic()
        with self.cond:
            peer = self.peers.get(msg.receiver_id)
            if isinstance(msg, Bye):
                if peer is not None:
                    peer.gone = "said bye"
                self.cond.notify_all()
                return
            if (isinstance(msg, Hello) or peer is None
                    or (peer.gone and (isinstance(msg, Ack) or not peer.silenced))):
                # Unknown or declared-dead receivers (re)join, behind until a version reaches
                # them (``CollectivePublisher.behind``).
                self.peers[msg.receiver_id] = peer = Peer(msg.receiver_id, now)
                log.info("weight bus: receiver %r joined", msg.receiver_id)
            peer.last_seen = now
            if isinstance(msg, (Hello, Heartbeat)):
                peer.loaded_version = max(peer.loaded_version, msg.loaded_version)
                peer.received_version = max(peer.received_version, msg.loaded_version)
            elif isinstance(msg, Ack):
                by_stage = self._acks.setdefault(msg.publish_id, {}).setdefault(msg.receiver_id, {})
                by_stage[msg.stage] = msg
                if msg.stage in ("received", "loaded", "skipped"):
                    peer.received_version = max(peer.received_version, msg.version)
                if msg.stage == "loaded":
                    peer.loaded_version = max(peer.loaded_version, msg.version)
            self.cond.notify_all()

    def _tick(self) -> None:
        with self.cond:
            self.cond.notify_all()  # lets waiters re-evaluate liveness

    # -- outgoing -------------------------------------------------------------------------
    def announce(self, receiver_id: str, announce: Announce) -> None:
        self._io.send([receiver_id.encode(), _encoder.encode(announce)])

    # -- queries and waits ----------------------------------------------------------------
    def live(self) -> list[str]:
        """Members that are neither gone nor silent for longer than ``dead_after_s``."""
        now = time.monotonic()
        with self.cond:
            return sorted(p.receiver_id for p in self.peers.values()
                          if not p.gone and now - p.last_seen <= self.dead_after_s)

    def dead_among(self, ids: list[str] | tuple[str, ...]) -> dict[str, str]:
        """Of ``ids``, those gone or silent too long, with the reason."""
        now = time.monotonic()
        out = {}
        with self.cond:
            for rid in ids:
                peer = self.peers.get(rid)
                if peer is None:
                    out[rid] = "unknown receiver"
                elif peer.gone:
                    out[rid] = peer.gone
                elif now - peer.last_seen > self.dead_after_s:
                    out[rid] = f"no heartbeat for {now - peer.last_seen:.1f} s"
        return out

    def silent_among(self, publish_id: str, ids: list[str] | tuple[str, ...]) -> list[str]:
        """Of ``ids``, those that sent no ack at all for ``publish_id`` (not even ``announced``)."""
        with self.cond:
            acked = self._acks.get(publish_id, {})
            return sorted(rid for rid in ids if rid not in acked)

    def forget(self, dead: dict[str, str], *, silenced: bool = False) -> None:
        """Drop ``dead`` from the roster; ``silenced`` ones are still heartbeating (see Peer)."""
        with self.cond:
            for rid, why in dead.items():
                if rid in self.peers:
                    self.peers[rid].gone = why or "declared dead"
                    self.peers[rid].silenced = silenced

    def loaded_versions(self) -> dict[str, int]:
        with self.cond:
            return {p.receiver_id: p.loaded_version for p in self.peers.values() if not p.gone}

    def received_versions(self) -> dict[str, int]:
        """The latest version each member received (acked ``received``, or said it loaded)."""
        with self.cond:
            return {p.receiver_id: p.received_version for p in self.peers.values() if not p.gone}

    def failed_acks(self, publish_id: str) -> dict[str, str]:
        """Receivers that acked ``failed`` for ``publish_id``, with their error."""
        with self.cond:
            return {rid: by_stage["failed"].error
                    for rid, by_stage in self._acks.get(publish_id, {}).items()
                    if "failed" in by_stage}

    def wait_acks(self, publish_id: str, ids: list[str] | tuple[str, ...], stages: tuple[str, ...],
                  deadline: float, check: Callable[[], None]) -> dict[str, Ack]:
        """Block until each of ``ids`` acked ``publish_id`` with one of ``stages`` or ``failed``."""
        with self.cond:
            while True:
                got = {}
                for rid, by_stage in self._acks.get(publish_id, {}).items():
                    found = [by_stage[s] for s in (*stages, "failed") if s in by_stage]
                    if rid in ids and found:
                        got[rid] = found[0]
                if len(got) == len(ids):
                    return got
                self.cond.release()
                try:
                    check()
                finally:
                    self.cond.acquire()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(ids) - set(got))
                    raise WeightBusTimeout(f"weight bus: receivers {missing} did not ack "
                                           f"{'/'.join(stages)} for publish {publish_id}")
                self.cond.wait(min(left, 0.1))

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def drop_acks(self, publish_id: str) -> None:
        with self.cond:
            self._acks.pop(publish_id, None)

    def close(self) -> None:
        self._io.close()
        self._ctx.term()


class ControlClient:
    """Receiver side: a DEALER whose routing id is the receiver id."""

    def __init__(self, endpoint: str, receiver_id: str, *, timeout_s: float = 60.0) -> None:
        self.receiver_id = receiver_id
        self.loaded_version = -1  # of this server's versions: the receiver sets it as it loads
        address, token = split_endpoint(endpoint)
        self._token = token.encode()
        self.announcements: queue.Queue[Announce] = queue.Queue()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, receiver_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._io = _IOThread(self._ctx, sock, self._handle, self._tick,
                             heartbeat_interval(timeout_s),
                             f"weight-bus-control-{receiver_id}")
        self._send(Hello(receiver_id=receiver_id, loaded_version=-1))  # goes first
        self._io.start()

    def _handle(self, frames: list[bytes]) -> None:
        self.announcements.put(_to_receiver.decode(frames[-1]))

    def _tick(self) -> None:
        self._send(Heartbeat(receiver_id=self.receiver_id, loaded_version=self.loaded_version))

    def _send(self, msg: msgspec.Struct) -> None:
        self._io.send([self._token, _encoder.encode(msg)])

    def ack(self, announce: Announce, stage: str, *, manifest: WeightManifest | None = None,
            error: str = "") -> None:
        if stage not in ACK_STAGES:
            raise ValueError(f"ack stage={stage!r}: must be one of {ACK_STAGES}")
        self._send(Ack(receiver_id=self.receiver_id, publish_id=announce.publish_id,
                       version=announce.version, stage=stage, manifest=manifest, error=error))

    def next_announce(self, timeout: float) -> Announce | None:
        try:
            return self.announcements.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._send(Bye(receiver_id=self.receiver_id))
        self._io.close()
        self._ctx.term()
