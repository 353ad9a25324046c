"""streamrl serve vs vLLM's own OpenAI server: completion tokens/s and the latency it adds.

Both servers run the offline tiny model with the engine settings streamrl uses (``engine_args``
in rollout_fleet/vllm_engine.py: dtype, max_model_len, enforce_eager, seed, processed log-probs)
and in the environment its replica actors get (``WORKER_ENV``). Both are started first, then
driven in turns, one at a time (the other idles): on a machine whose load from elsewhere
drifts, measuring one server for minutes and then the other compared two different machines
(vLLM's own tokens/s at 32 clients moved 28 % between two runs minutes apart); in turns, a
drift hits both alike. The variants:

- ``streamrl``: ``streamrl serve serve.train=false``: FastAPI in the driver, the vLLM engine in
  a replica Ray actor. Every call names a new episode (``X-Episode-Id``), so the measured path is
  the recorded one training uses (admission, episode store, exact token records); the batch size
  is set so the staleness bound is never reached. Each run closes its episodes (reward 0) once
  its clock has stopped: the episodes stay under ``serve.max_episodes_per_client`` whatever
  ``--requests``, and the figure stays the same requests as vLLM's;
- ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` on the same model and settings;
- ``vllm+lp``: the same vLLM server, each call asking for the sampled tokens' log-probs
  (``logprobs: true``): the engine work a recorded call always does, since training needs the
  behaviour log-probs. The goal is against ``vllm+lp`` (what the service itself costs); the
  ratio against plain ``vllm`` is printed too.

Each variant is warmed up, then, ``--rounds`` times in turn, driven by C concurrent asyncio
clients (C = 8, then 32), each sending ``--requests`` non-streaming ``/v1/chat/completions``
calls one after another (the same prompts for both servers, temperature 1.0, ``--max-tokens``
tokens at most). Tokens/s is the sum of ``usage.completion_tokens`` over a variant's calls / the
sum of its rounds' wall seconds from the first call to the last answer; start-up and warm-up
are excluded. The random model sometimes samples EOS
early, so each server's own token count is used. Latency is per call, as its client sees it; the
difference of the two servers' p50 / p99 is what the service adds per request.

    .venv/bin/python benchmarks/serve.py [--requests 16 --rounds 3 --max-tokens 64]

Ends with one ``RESULT <name> value=<x> goal=<op><y> met=yes|no`` line per goal
(serve_vs_vllm_lp_c8 and serve_vs_vllm_lp_c32; ``streamrl.testing.result_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from streamrl.config import RolloutConfig
from streamrl.models import resolve_model_path
from streamrl.net import free_port
from streamrl.runtime.placement import WORKER_ENV
from streamrl.testing import result_line

GOAL = 0.9
CONCURRENCY = (8, 32)
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


@dataclass
class Run:
    clients: int
    calls: int
    tokens: int
    wall_s: float
    latencies_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def percentile(self, q: int) -> float:
        return statistics.quantiles(self.latencies_s, n=100, method="inclusive")[q - 1]


def streamrl_command(model: str, port: int) -> list[str]:
    return [str(Path(sys.executable).with_name("streamrl")), "serve", f"model.path={model}",
            "serve.train=false", f"serve.host={HOST}", f"serve.port={port}",
            "runtime.num_cpus=2", "serve.max_tokens=256",
            # Nothing consumes with serve.train=false: a batch this large keeps every call under
            # the staleness bound (the mini batch must divide it).
            "task.train_batch_size=4096", "actor.ppo_mini_batch_size=4096"]


def vllm_command(model: str, port: int) -> list[str]:
    r = RolloutConfig()
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", HOST, "--port", str(port), "--dtype", r.dtype,
            "--max-model-len", str(r.max_model_len), "--seed", str(r.seed),
            "--gpu-memory-utilization", str(r.gpu_memory_utilization),
            *(["--enforce-eager"] if r.enforce_eager else []),
            "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
            # streamrl's uvicorn logs at warning: no per-request access line on either side.
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]


@contextlib.contextmanager
def server(name: str, command: list[str], health: str, log_dir: Path) -> Iterator[float]:
    """Start ``command`` in its own session, yield its start-up seconds once ``health`` answers
    200, then stop it."""
    log_path = log_dir / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        # Both servers get the environment streamrl's replica actors run their engines in. On
        # CPU, VLLM_ENABLE_V1_MULTIPROCESSING=0 makes vLLM run the model in the engine-core
        # process; without it vLLM's server adds a busy-polling worker process (the "mp"
        # executor) and would not be the same engine.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **WORKER_ENV}, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up; "
                                   f"log:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=5).status_code == 200:
                    break
            if time.perf_counter() - start > START_TIMEOUT_S:
                raise RuntimeError(f"{name} not healthy after {START_TIMEOUT_S:.0f} s; log:\n"
                                   f"{log_tail(log_path)}")
            time.sleep(0.5)
        yield time.perf_counter() - start
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server (graceful shutdown), then SIGKILL to whatever it left behind: its
    process group (Ray head, vLLM's engine core) and its descendants that Ray moved into groups
    of their own (the actors)."""
    family: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for child in family:  # psutil checks each is still the process it listed, not a reused pid
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def drive(base_url: str, prompts: list[str], clients: int, per_client: int,
                max_tokens: int, episodes: bool, logprobs: bool = False) -> Run:
    """``clients`` concurrent clients, each sending ``per_client`` calls one after another."""
    latencies: list[float] = []
    opened: list[str] = []
    tokens = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def client(k: int) -> None:
            nonlocal tokens
            for j in range(per_client):
                body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0,
                        "logprobs": logprobs, "messages": [{"role": "user",
                                      "content": prompts[(k * per_client + j) % len(prompts)]}]}
                episode_id = f"bench-{uuid.uuid4().hex}"
                headers = {"X-Episode-Id": episode_id} if episodes else {}
                t0 = time.perf_counter()
                response = await http.post("/v1/chat/completions", json=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200:
                    raise RuntimeError(f"{base_url}: {response.status_code} {response.text}")
                answer = response.json()
                if episodes:
                    if "episode_id" not in answer:
                        raise RuntimeError(f"{base_url}: the call was not recorded: {answer}")
                    opened.append(episode_id)
                tokens += answer["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(clients)))
        wall_s = time.perf_counter() - start

        async def close(ids: list[str]) -> None:
            for episode_id in ids:
                closed = await http.post(f"/v1/episodes/{episode_id}/reward",
                                         json={"reward": 0.0})
                if closed.status_code != 200:
                    raise RuntimeError(f"{base_url}: closing {episode_id}: {closed.status_code} "
                                       f"{closed.text}")

        await asyncio.gather(*(close(opened[k::clients]) for k in range(clients)))
    return Run(clients, clients * per_client, tokens, wall_s, latencies)


@dataclass(frozen=True)
class Variant:
    name: str
    url: str
    episodes: bool
    logprobs: bool


async def measure(variants: list[Variant], prompts: list[str], args: argparse.Namespace
                  ) -> dict[str, list[Run]]:
    """Per variant, one Run per concurrency: its ``--rounds`` runs, taken in turns, summed."""
    async def run(v: Variant, clients: int, per_client: int) -> Run:
        return await drive(v.url, prompts, clients, per_client, args.max_tokens, v.episodes,
                           v.logprobs)

    for v in variants:  # first-call costs (engine paths, connection set-up) stay out
        await run(v, CONCURRENCY[0], 2)
    runs: dict[str, list[Run]] = {v.name: [] for v in variants}
    for clients in CONCURRENCY:
        rounds: dict[str, list[Run]] = {v.name: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                rounds[v.name].append(await run(v, clients, args.requests))
        for name, taken in rounds.items():
            runs[name].append(Run(clients, sum(r.calls for r in taken),
                                  sum(r.tokens for r in taken), sum(r.wall_s for r in taken),
                                  [t for r in taken for t in r.latencies_s]))
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="calls per client per round")
    p.add_argument("--rounds", type=int, default=3, help="turns per variant and concurrency")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every call")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts, cycled")
    p.add_argument("--model-dir", default=None,
                   help="HF model directory (default: the offline tiny model, built once)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model_dir or resolve_model_path("tiny")
    prompts = [f"Task {i}: count upward from {i}, one number per line." for i in
               range(args.prompts)]
    print(f"model {model}: clients {' and '.join(map(str, CONCURRENCY))} x {args.requests} "
          f"calls each, {args.rounds} rounds in turn, max_tokens {args.max_tokens}, "
          f"temperature 1.0, {args.prompts} prompts")
    urls: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-serve-") as tmp, \
            contextlib.ExitStack() as servers:
        for name, command, health in (("streamrl", streamrl_command, "/healthz"),
                                      ("vllm", vllm_command, "/health")):
            port = free_port(HOST)
            urls[name] = f"http://{HOST}:{port}"
            start_s = servers.enter_context(server(name, command(model, port),
                                                   urls[name] + health, Path(tmp)))
            print(f"{name:>8}: ready in {start_s:.1f} s")
        runs = asyncio.run(measure([Variant("streamrl", urls["streamrl"], True, False),
                                    Variant("vllm", urls["vllm"], False, False),
                                    Variant("vllm+lp", urls["vllm"], False, True)],
                                   prompts, args))
    print(f"{'clients':>7} {'server':>8} {'tok/s':>8} {'tokens':>7} {'calls':>6} {'wall s':>7} "
          f"{'p50 ms':>8} {'p99 ms':>8}")
    for i in range(len(CONCURRENCY)):
        for name, server_runs in runs.items():
            r = server_runs[i]
            print(f"{r.clients:>7} {name:>8} {r.tokens_per_s:8.0f} {r.tokens:7d} {r.calls:6d} "
                  f"{r.wall_s:7.2f} {1e3 * r.percentile(50):8.1f} {1e3 * r.percentile(99):8.1f}")
    ratios = {}
    for ours, theirs, with_lp in zip(runs["streamrl"], runs["vllm"], runs["vllm+lp"]):
        ratios[ours.clients] = ours.tokens_per_s / with_lp.tokens_per_s
        plain = ours.tokens_per_s / theirs.tokens_per_s
        print(f"c={ours.clients}: streamrl serve / vLLM = {plain:.2f}; latency added per call: p50 "
              f"{1e3 * (ours.percentile(50) - with_lp.percentile(50)):+.1f} ms, p99 "
              f"{1e3 * (ours.percentile(99) - with_lp.percentile(99)):+.1f} ms (vs vLLM with "
              f"log-probs); / vLLM returning log-probs = {ratios[ours.clients]:.2f}; "
              f"vLLM's own log-probs cost it {1 - with_lp.tokens_per_s / theirs.tokens_per_s:.0%}")
    for clients, ratio in ratios.items():
        print(result_line(f"serve_vs_vllm_lp_c{clients}", ratio, ">=", GOAL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
