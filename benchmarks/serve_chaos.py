"""Serve chaos: 32 openai-client agents against `streamrl serve` + `streamrl train` on Redis
while parts of the system fail; nothing a client closed may be lost or changed.

The system: a redis-server this benchmark starts (append-only, in the work dir), ``streamrl
serve serve.train=false buffer=redis`` (the tiny model in a vLLM replica) and ``streamrl train
buffer=redis rollout.num_replicas=0 trainer.resume=auto trainer.save_freq=2`` on the same run,
as tests/test_e2e_serve.py starts them. The clients: 8 workers, each running one task at a time
as a group of 4 concurrent episodes (32 agents): the relay game of examples/openai_agent.py
(3 turns; every other worker offers its ``double`` tool), the official ``openai`` client, every
call with its own ``Idempotency-Key`` and ``return_token_ids`` (so the client records the token
ids it was shown), each episode closed with ``examples/openai_agent.close`` (retries 503, 409
and lost connections). Client faults, per call or episode: a duplicate call (the same request and
key sent again: must answer the same id and tokens), a retried call (the first try cut off
after 50 ms, then sent again with the same key), an abandoned episode (never closed). System
faults, at fixed shares of the run (``--minutes``): Redis paused (SIGSTOP, ``REDIS_PAUSE_S``,
SIGCONT), the trainer killed (-9) and restarted, the service killed (-9) and restarted, Redis
shut down (append-only file flushed) and restarted ``REDIS_DOWN_S`` later.

What the trainer trained is read from the trainer itself: it runs through this file
(``_trainer DUMP <streamrl args>``), which wraps ``Controller._take`` / ``Controller._consume``
and ``RedisBuffer._discard_entry`` to append every group it trained (after its update) or
discarded (with the reason) to a JSON-lines dump, token ids included; nothing else changes.

Counted at the end, after the clients stop, abandoned episodes expire (``serve.episode_ttl_s``),
late groups are put (``serve.group_timeout_s``) and filler episodes (not counted) fill the
trainer's last batch:

- closed: episodes whose close answered 200; each is trained (in the dump), failed with a
  reason (discarded by the trainer, e.g. too stale; or closed in the service killed later while
  its group still waited for members: a service keeps open groups in memory only), or lost;
- corrupted: trained trajectories whose sampled runs (loss_mask 1) are not exactly the token
  ids and versions some call of that episode showed its client, after exactly the prompt ids
  that call showed; plus duplicate calls answered differently;
- slots leaked: ``in_flight`` of ``streamrl buffer stats`` once nothing is open (the killed
  service's slots come back when its lease expires, ``buffer.lease_ttl_s``);
- longest stall: the longest HTTP exchange (any route, as the client's transport saw it) that
  did not overlap a Redis outage or the service's restart (plus ``GRACE_S``).

    .venv/bin/python benchmarks/serve_chaos.py [--minutes 5] [--work-dir DIR]

Ends with ``RESULT`` lines: serve_chaos_lost, serve_chaos_corrupted, serve_chaos_slots_leaked,
serve_chaos_accounted (closed - trained - failed), serve_chaos_stall_s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
RUN = "chaos"
WORKERS, GROUP = 8, 4  # 32 agents
TURNS = 3
P_DUPLICATE, P_RETRY, P_ABANDON = 0.05, 0.05, 0.05
RETRY_CUT_S = 0.05
REDIS_PAUSE_S, REDIS_DOWN_S = 6.0, 6.0
GRACE_S = 3.0  # after an outage ends, clients reconnect and back off: not counted as stalls
START_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 60.0
EPISODE_TTL_S, GROUP_TIMEOUT_S, LEASE_TTL_S = 20.0, 10.0, 10.0
BATCH = 8  # groups per training step
STALL_GOAL_S = 2.0
SERVE_ARGS = ["serve.train=false", "runtime.num_cpus=1", f"serve.episode_ttl_s={EPISODE_TTL_S}",
              f"serve.group_timeout_s={GROUP_TIMEOUT_S}"]
TRAIN_ARGS = ["runtime.num_cpus=1", "rollout.num_replicas=0", "trainer.total_steps=100000",
              "trainer.save_freq=2", "trainer.resume=auto", "trainer.logger=[jsonl]",
              "actor.optim.lr=3e-3", "actor.ppo_mini_batch_size=4"]


def _load_agent() -> Any:
    """examples/openai_agent.py (not a package): its tool, its tool runner and its close."""
    spec = importlib.util.spec_from_file_location("openai_agent", ROOT / "examples" /
                                                  "openai_agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the trainer, with a dump of what it trained ----------------------------------------------

def trainer_main(dump: str, argv: list[str]) -> int:
    """``streamrl train`` with every trained or discarded group appended to ``dump``."""
    from streamrl import controller
    from streamrl.buffer.redis import backend
    from streamrl.buffer.redis.wire import MalformedEntry, decode_entry
    from streamrl.cli import main
    from streamrl.types import Group

    sink = open(dump, "ab", buffering=0)  # noqa: SIM115 (open for the process's life)
    taken: dict[str, Group] = {}

    def write(kind: str, group: Group, reason: str = "") -> None:
        row = {"kind": kind, "reason": reason, "group_id": group.group_id, "trajectories": [
            {"episode": t.extra.get("episode", {}).get("id"), "prompt_ids": list(t.prompt_ids),
             "response_ids": list(t.response_ids), "loss_mask": list(t.loss_mask),
             "versions": list(t.versions)}
            for t in group.trajectories]}
        sink.write(json.dumps(row).encode() + b"\n")  # one write: a kill leaves whole lines

    take, consume = controller.Controller._take, controller.Controller._consume
    discard = backend.RedisBuffer._discard_entry

    def _take(self: Any, n: int, version: int) -> list[Group] | None:
        groups = take(self, n, version)
        taken.update((g.group_id, g) for g in groups or ())
        return groups

    def _consume(self: Any, group_ids: list[str]) -> None:  # called after the update
        for gid in group_ids:
            write("trained", taken.pop(gid))
        consume(self, group_ids)

    def _discard_entry(self: Any, eid: bytes, kind: str, reason: str) -> None:
        if kind != "skipped":  # skipped: trained before a restart, dumped then
            entries = self._r.xrange(self.keys.groups, eid, eid)
            with contextlib.suppress(MalformedEntry, IndexError):
                write("discarded", decode_entry(eid, entries[0][1], False).group,
                      f"{kind}: {reason}")
        discard(self, eid, kind, reason)

    controller.Controller._take = _take  # type: ignore[method-assign]
    controller.Controller._consume = _consume  # type: ignore[method-assign]
    backend.RedisBuffer._discard_entry = _discard_entry  # type: ignore[method-assign]
    return main(argv)


# -- processes -------------------------------------------------------------------------------------

class Proc:
    """A command in its own session, its output appended to a log; ``kill`` is kill -9 of it
    and every process it started (Ray moves actors into sessions of their own)."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.args, self.log = name, args, log
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            return subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def kill(self) -> None:
        family: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for child in family:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def restart(self) -> None:
        self.kill()
        self.proc = self._start()


class Redis:
    """redis-server, append-only in ``workdir``: paused, or shut down and started again."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"redis://{HOST}:{port}/0"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "",
             "--appendonly", "yes", "--dir", str(self.workdir), "--logfile",
             str(self.workdir / "redis.log")], start_new_session=True)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start; see {self.workdir}/redis.log")
            time.sleep(0.05)
        return proc

    def pause(self, seconds: float) -> None:
        self.proc.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.proc.send_signal(signal.SIGCONT)

    def restart(self, down_s: float) -> None:
        self.proc.terminate()  # SIGTERM: redis flushes the append-only file, then exits
        self.proc.wait(timeout=30)
        time.sleep(down_s)
        self.proc = self._start()

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


# -- clients ---------------------------------------------------------------------------------------

@dataclass
class Seen:
    """One answered call as its client saw it."""

    prompt_ids: list[int]
    token_ids: list[int]
    versions: list[int]


@dataclass
class EpisodeLog:
    episode_id: str
    group_id: str
    calls: list[Seen] = field(default_factory=list)
    outcome: str = "open"
    """closed | abandoned | failed"""
    reason: str = ""
    summary: dict[str, Any] | None = None
    closed_in: int = -1
    """The service incarnation that answered the close (0, then 1 after its restart)."""


@dataclass
class Exchange:
    start: float
    end: float
    what: str


@dataclass
class Ctx:
    url: str
    agent: Any
    rng: random.Random
    episodes: list[EpisodeLog] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    outages: list[tuple[float, float, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    incarnation: int = 0
    stopping: bool = False
    started: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)

    def http_client(self) -> httpx.AsyncClient:
        """An httpx client that records each exchange's duration (request sent -> answer
        headers), for the stall figure."""
        sent: dict[int, float] = {}

        async def on_request(request: httpx.Request) -> None:
            sent[id(request)] = time.monotonic()

        async def on_response(response: httpx.Response) -> None:
            start = sent.pop(id(response.request), None)
            if start is not None:
                self.exchanges.append(Exchange(start, time.monotonic(),
                                               f"{response.request.method} "
                                               f"{response.request.url.path} "
                                               f"{response.status_code}"))

        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=self.url, timeout=CALL_TIMEOUT_S, limits=limits,
                                 event_hooks={"request": [on_request],
                                              "response": [on_response]})


async def wait_healthy(ctx: Ctx, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{ctx.url}/healthz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ctx.url}/healthz not 200 within {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def call(ctx: Ctx, client: Any, http: httpx.AsyncClient, log: EpisodeLog,
               body: dict[str, Any]) -> Any:
    """One chat call with its own Idempotency-Key; maybe cut off once first (a retried call)
    or sent twice (a duplicate, which must get the same answer)."""
    headers = {"X-Episode-Id": log.episode_id, "X-Group-Id": log.group_id,
               "Idempotency-Key": uuid.uuid4().hex}
    if ctx.rng.random() < P_RETRY:
        ctx.counts["calls_cut_and_retried"] += 1
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: retries
            await http.post("/v1/chat/completions", headers=headers, timeout=RETRY_CUT_S,
                            json={**body, "return_token_ids": True})
    kwargs = {**body, "extra_headers": headers, "extra_body": {"return_token_ids": True}}
    answer = await client.chat.completions.create(**kwargs)
    if ctx.rng.random() < P_DUPLICATE:
        again = await client.chat.completions.create(**kwargs)
        ctx.counts["duplicate_calls"] += 1
        if (again.id != answer.id or again.choices[0].model_extra.get("token_ids")
                != answer.choices[0].model_extra.get("token_ids")):
            ctx.counts["duplicate_answered_differently"] += 1
    extra = answer.choices[0].model_extra or {}
    log.calls.append(Seen(list((answer.model_extra or {})["prompt_token_ids"]),
                          list(extra["token_ids"]), list(extra["versions"])))
    return answer


async def episode(ctx: Ctx, client: Any, http: httpx.AsyncClient, log: EpisodeLog,
                  digit: int, index: int, tools: bool) -> None:
    from streamrl.data import Prompt
    from streamrl.rollout_fleet.agent import AssistantTurn
    from streamrl.rollout_fleet.agent.envs.relay import RelayEnv

    agent = ctx.agent
    env = RelayEnv()
    env.turns = TURNS
    messages: list[Any] = list(env.reset(Prompt(index=index, prompt_ids=[], data_source="relay",
                                                ground_truth=str(digit), extra={})))
    abandon = ctx.rng.random() < P_ABANDON
    reward, turn = 0.0, 0
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    if tools:
        body["tools"] = agent.TOOLS
    while True:
        answer = await call(ctx, client, http, log, {**body, "messages": list(messages)})
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if abandon:
            log.outcome, log.reason = "abandoned", "the client walked away"
            return
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": agent.run_tool(c)}
                         for c in message.tool_calls]
            continue
        text = message.content or ""
        step = env.step(AssistantTurn(index=turn, text=text, content=text, token_ids=[],
                                      finish_reason=answer.choices[0].finish_reason,
                                      last=turn + 1 >= env.turns))
        reward += step.reward
        turn += 1
        if step.done or not step.observation:
            break
        messages += step.observation
    summary = await agent.close(http, log.episode_id, {"reward": reward, "group_id": log.group_id,
                                                       "group_size": GROUP})
    if summary is None:
        log.outcome, log.reason = "failed", "close: 404 (the restarted service forgot it)"
    else:
        log.outcome, log.summary, log.closed_in = "closed", summary, ctx.incarnation


async def run_episode(ctx: Ctx, client: Any, http: httpx.AsyncClient, log: EpisodeLog,
                      digit: int, index: int, tools: bool) -> None:
    import openai

    try:
        await episode(ctx, client, http, log, digit, index, tools)
    except (openai.APIError, httpx.HTTPError, ctx.agent.CloseFailed) as exc:
        log.outcome = "failed"
        log.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


async def worker(ctx: Ctx, k: int, client: Any, http: httpx.AsyncClient) -> None:
    """One task at a time, as a group of GROUP concurrent episodes."""
    index = 0
    while not ctx.stopping:
        group_id = uuid.uuid4().hex
        logs = [EpisodeLog(uuid.uuid4().hex, group_id) for _ in range(GROUP)]
        ctx.episodes += logs
        digit = ctx.rng.randrange(10)
        await asyncio.gather(*(run_episode(ctx, client, http, log, digit, index, k % 2 == 0)
                               for log in logs))
        index += 1
        if any(log.outcome == "failed" for log in logs):  # the service may be down: wait
            with contextlib.suppress(TimeoutError):
                await wait_healthy(ctx, START_TIMEOUT_S)


async def filler(ctx: Ctx, http: httpx.AsyncClient) -> None:
    """One single-turn episode in a group of its own, closed (fills the trainer's batch)."""
    episode_id = f"filler-{uuid.uuid4().hex}"
    with contextlib.suppress(httpx.HTTPError, ctx.agent.CloseFailed):
        answer = await http.post("/v1/chat/completions", headers={"X-Episode-Id": episode_id},
                                 json={"model": "tiny", "max_tokens": 2, "messages": [
                                     {"role": "user", "content": "1"}]})
        if answer.status_code == 200:
            await ctx.agent.close(http, episode_id, {"reward": 0.0})


# -- faults ----------------------------------------------------------------------------------------

async def faults(ctx: Ctx, duration: float, redis: Redis, serve: Proc, trainer: Proc,
                 checkpoints: Path) -> None:
    async def at(share: float) -> None:
        await asyncio.sleep(max(0.0, ctx.started + share * duration - time.monotonic()))

    def note(what: str) -> None:
        ctx.events.append(f"{time.monotonic() - ctx.started:6.1f} s  {what}")
        print(ctx.events[-1], flush=True)

    await at(0.15)
    note(f"Redis paused (SIGSTOP) for {REDIS_PAUSE_S:.0f} s")
    t0 = time.monotonic()
    await asyncio.to_thread(redis.pause, REDIS_PAUSE_S)
    ctx.outages.append((t0, time.monotonic(), "redis paused"))
    note("Redis resumed (SIGCONT)")

    await at(0.35)
    # After a checkpoint: a trainer killed before its first one cannot restart on the run
    # (set_version(0) refused: Redis has its version; see docs/serve.md).
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any(checkpoints.glob("global_step_*")) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    note("trainer killed (-9) and restarted (trainer.resume=auto)")
    await asyncio.to_thread(trainer.restart)

    await at(0.55)
    note("service killed (-9)")
    t0 = time.monotonic()
    await asyncio.to_thread(serve.kill)
    ctx.incarnation += 1
    await asyncio.to_thread(serve.restart)
    await wait_healthy(ctx, START_TIMEOUT_S)
    ctx.outages.append((t0, time.monotonic(), "service restarting"))
    note(f"service back after {time.monotonic() - t0:.1f} s")

    await at(0.75)
    note(f"Redis shut down (append-only file flushed), restarted {REDIS_DOWN_S:.0f} s later")
    t0 = time.monotonic()
    await asyncio.to_thread(redis.restart, REDIS_DOWN_S)
    ctx.outages.append((t0, time.monotonic(), "redis restarting"))
    note("Redis back")


# -- the count -------------------------------------------------------------------------------------

def read_dump(path: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Trained trajectories by episode and discard reasons by episode. The last row of a group
    is its fate: a group trained by a trainer killed before its next checkpoint is delivered
    again, and trained again (counted once) or dropped by the restarted one."""
    last: dict[str, dict[str, Any]] = {}
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        last[row["group_id"]] = row
    trained: dict[str, list[dict[str, Any]]] = {}
    discarded: dict[str, str] = {}
    for row in last.values():
        for t in row["trajectories"]:
            if row["kind"] == "discarded":
                discarded[t["episode"]] = row["reason"]
            else:
                trained.setdefault(t["episode"], []).append(t)
    return trained, discarded


def corrupted(trajectory: dict[str, Any], calls: list[Seen]) -> bool:
    """Whether some sampled run of ``trajectory`` is not what one of ``calls`` showed."""
    prompt, response = trajectory["prompt_ids"], trajectory["response_ids"]
    full, mask = prompt + response, trajectory["loss_mask"]
    versions = trajectory["versions"]
    if not (len(response) == len(mask) == len(versions)):
        return True
    i = 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j]:
            j += 1
        start = len(prompt) + i
        if not any(len(c.prompt_ids) == start and c.prompt_ids == full[:start]
                   and c.token_ids == response[i:j] and c.versions == versions[i:j]
                   for c in calls):
            return True
        i = j
    return False


def buffer_stats(url: str) -> dict[str, str]:
    """``streamrl buffer stats``, its rows as name -> value."""
    out = subprocess.run([str(Path(sys.executable).with_name("streamrl")), "buffer", "stats",
                          "--redis-url", url, "--run", RUN], capture_output=True, text=True,
                         timeout=60).stdout
    rows = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if line.startswith("  ") and len(parts) == 2:
            rows[parts[0]] = parts[1]
    return rows


def classify(ctx: Ctx, trained: dict[str, Any], discarded: dict[str, str]
             ) -> dict[str, str]:
    """Each closed episode -> "trained", "failed: <reason>" or "lost"."""
    # A group whose last close answered in an incarnation was put before that answer.
    complete = {(e.group_id, e.closed_in) for e in ctx.episodes
                if e.summary is not None and e.summary["group_complete"]}
    verdicts = {}
    for e in ctx.episodes:
        if e.outcome != "closed":
            continue
        if e.episode_id in trained:
            verdicts[e.episode_id] = "trained"
        elif e.episode_id in discarded:
            verdicts[e.episode_id] = f"failed: the trainer discarded it: {discarded[e.episode_id]}"
        elif e.closed_in < ctx.incarnation and (e.group_id, e.closed_in) not in complete:
            verdicts[e.episode_id] = ("failed: closed in the service killed later, its group "
                                      "still open (kept in memory only)")
        else:
            verdicts[e.episode_id] = "lost"
    return verdicts


def settled(ctx: Ctx, dump: Path) -> bool:
    return "lost" not in classify(ctx, *read_dump(dump)).values()


async def drive(ctx: Ctx, args: argparse.Namespace, redis: Redis, serve: Proc, trainer: Proc,
                dump: Path) -> None:
    import openai

    await wait_healthy(ctx, START_TIMEOUT_S)
    async with ctx.http_client() as http, ctx.http_client() as for_openai:
        client = openai.AsyncOpenAI(base_url=f"{ctx.url}/v1", api_key="none", max_retries=30,
                                    timeout=CALL_TIMEOUT_S, http_client=for_openai)
        ctx.started = time.monotonic()
        duration = 60 * args.minutes
        print(f"clients running for {duration:.0f} s", flush=True)
        chaos = asyncio.ensure_future(faults(ctx, duration, redis, serve, trainer,
                                             dump.parent / "out"))
        workers = [asyncio.ensure_future(worker(ctx, k, client, http)) for k in range(WORKERS)]

        async def probe() -> None:  # the event loop's responsiveness, between the calls
            while not ctx.stopping:
                with contextlib.suppress(httpx.HTTPError):
                    await http.get("/healthz", timeout=10)
                await asyncio.sleep(0.25)

        prober = asyncio.ensure_future(probe())
        await asyncio.sleep(duration)
        ctx.stopping = True
        await asyncio.wait_for(chaos, START_TIMEOUT_S)
        await asyncio.wait_for(asyncio.gather(*workers, prober), START_TIMEOUT_S)
        print(f"{time.monotonic() - ctx.started:6.1f} s  clients stopped; waiting for "
              "abandoned episodes to expire and the trainer to train every closed group",
              flush=True)
        await asyncio.sleep(EPISODE_TTL_S + GROUP_TIMEOUT_S + 2)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not settled(ctx, dump) and time.monotonic() < deadline:
            await asyncio.gather(*(filler(ctx, http) for _ in range(BATCH)))
            await asyncio.sleep(2.0)
        await asyncio.sleep(LEASE_TTL_S + 2)  # the killed service's lease expires


def report(ctx: Ctx, dump: Path, stats: dict[str, str]) -> int:
    trained, discarded = read_dump(dump)
    closed = [e for e in ctx.episodes if e.outcome == "closed"]
    outcomes = Counter(e.outcome for e in ctx.episodes)
    verdicts = classify(ctx, trained, discarded)
    failed_reasons = Counter(v.removeprefix("failed: ") for v in verdicts.values()
                             if v.startswith("failed"))
    lost = [k for k, v in verdicts.items() if v == "lost"]
    n_trained, n_failed = sum(v == "trained" for v in verdicts.values()), failed_reasons.total()
    bad = trajectories = 0
    for e in closed:
        for t in trained.get(e.episode_id, []):
            trajectories += 1
            bad += corrupted(t, e.calls)
    bad += ctx.counts["duplicate_answered_differently"]
    outside = [x for x in ctx.exchanges if not any(
        x.start < end + GRACE_S and x.end > start for start, end, _ in ctx.outages)]
    worst = max(outside, key=lambda x: x.end - x.start, default=None)
    stall = worst.end - worst.start if worst is not None else 0.0
    in_flight = int(stats.get("in_flight", "-1"))

    print("\nevents:\n  " + "\n  ".join(ctx.events))
    print(f"episodes: {len(ctx.episodes)} ({dict(outcomes)}); client faults: "
          f"{dict(ctx.counts)}")
    print(f"closed {len(closed)} = trained {n_trained} + failed with a reason {n_failed} + "
          f"lost {len(lost)}")
    for reason, n in failed_reasons.most_common():
        print(f"  failed: {n} x {reason}")
    for reason, n in Counter(e.reason for e in ctx.episodes if e.outcome == "failed"
                             ).most_common(8):
        print(f"  not closed (the client was told): {n} x {reason}")
    if lost:
        print(f"  lost, e.g. {lost[:5]}")
    print(f"trained trajectories checked against what their clients saw: {trajectories}, "
          f"corrupted {bad}")
    print(f"buffer stats at the end: {stats}")
    windows = [(round(a - ctx.started, 1), round(b - ctx.started, 1), w)
               for a, b, w in ctx.outages]
    print(f"HTTP exchanges: {len(ctx.exchanges)}, {len(outside)} outside the outages {windows}; "
          f"longest: {stall:.2f} s" + (f" ({worst.what} at {worst.start - ctx.started:.1f} s)"
                                       if worst else ""))
    from streamrl.testing import result_line

    print(result_line("serve_chaos_lost", len(lost), "<=", 0, digits=0))
    print(result_line("serve_chaos_corrupted", bad, "<=", 0, digits=0))
    print(result_line("serve_chaos_slots_leaked", in_flight, "<=", 0,
                      met=in_flight == 0, digits=0))
    print(result_line("serve_chaos_accounted", len(closed) - n_trained - n_failed, "<=", 0,
                      met=len(closed) == n_trained + n_failed and n_trained > 0, digits=0))
    print(result_line("serve_chaos_stall_s", stall, "<=", STALL_GOAL_S))
    return 0


def main(argv: list[str] | None = None) -> int:
    from streamrl.models import resolve_model_path
    from streamrl.net import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long the clients run")
    p.add_argument("--work-dir", default=None, help="logs and dumps (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="streamrl-serve-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}", flush=True)
    model = resolve_model_path("tiny")
    port = free_port(HOST)
    redis = Redis(work, free_port(HOST))
    dump = work / "trained.jsonl"
    common = [f"model.path={model}", "buffer=redis", f"buffer.redis_url={redis.url}",
              f"buffer.run={RUN}", f"buffer.lease_ttl_s={LEASE_TTL_S}", "trainer.mode=one_step_off",
              f"task.train_batch_size={BATCH}"]
    cli = [str(Path(sys.executable).with_name("streamrl"))]
    serve = Proc("serve", [*cli, "serve", *common, *SERVE_ARGS, f"serve.port={port}"],
                 work / "serve.log")
    trainer = Proc("trainer", [sys.executable, __file__, "_trainer", str(dump), "train", *common,
                               *TRAIN_ARGS, f"trainer.output_dir={work / 'out'}"],
                   work / "trainer.log")
    ctx = Ctx(f"http://{HOST}:{port}", _load_agent(), random.Random(args.seed))
    try:
        asyncio.run(drive(ctx, args, redis, serve, trainer, dump))
        stats = buffer_stats(redis.url)
    finally:
        serve.kill()
        trainer.kill()
        redis.stop()
    return report(ctx, dump, stats)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_trainer"]:
        sys.exit(trainer_main(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
