"""SGLangEngine: a RolloutEngine over SGLang's native HTTP server API (GPU only).

Endpoints used (sglang/srt/entrypoints/http_server.py):

- ``POST /generate`` with ``input_ids`` (a batch of n copies of the prompt, one ``rid`` each, so
  each sample can be aborted), ``sampling_params`` and ``return_logprob``; each result carries
  ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]`` and
  ``meta_info.finish_reason.type`` in stop | length | abort.
- ``POST /abort_request`` ``{"rid"}``; ``POST /pause_generation`` ``{"mode": "in_place"}``
  (requests keep their KV cache) and ``POST /continue_generation``.
- ``POST /update_weights_from_disk`` (``load_weights``: the tensors are written as safetensors
  next to the model's config, then loaded by the server), and for the weight bus
  ``POST /init_weights_update_group`` + ``POST /update_weights_from_distributed`` (the server
  joins a process group and receives broadcasts; the sender broadcasts concurrently).
  Every update passes ``weight_version`` so the server reports the version it serves.
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` (sleep / wake_up; the
  server needs ``--enable-memory-saver``), ``GET /health``.

Two semantics differ from vLLM and are stated, not hidden:
- SGLang's returned log-probs are taken after temperature scaling but before top-k / top-p
  renormalisation (``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` makes them pre-temperature). They are
  exactly the processed log-probs when top_k and top_p are off, the usual RL setting.
- SGLang does not report which weights produced which token, so every token of a request is
  stamped with the version the request *started* under. Across an in-flight swap this
  overstates the age of later tokens, never understates it: the staleness bound stays safe.

``SGLangEngine.launch`` starts ``python -m sglang.launch_server`` and waits for ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """An SGLang server call failed; the message names the endpoint, status and body."""


class SGLangEngine(RolloutEngine):
    def __init__(
        self,
        base_url: str,
        *,
        model_path: str | None = None,
        version: int = 0,
        request_timeout_s: float = 3600.0,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_path = model_path
        self.request_timeout_s = request_timeout_s
        self._version = version
        self._process = process
        self._rids: dict[str, list[str]] = {}
        self._session: Any = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._weights_dir: tempfile.TemporaryDirectory[str] | None = None

    # -- server lifetime -----------------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        model_path: str,
        *,
        port: int,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 600.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
    ) -> SGLangEngine:
        """Start an SGLang server on ``model_path`` and wait until ``/health`` answers 200.

        ``host``: loopback by default, also on a cluster: only the replica that launched the
        server, on the same node, talks to it (the weight relay binds where it reaches it)."""
        import requests

        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", host, "--port", str(port), *extra_args]
        log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, **(env or {})})
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise SGLangError(f"sglang server exited with code {process.returncode} during "
                                  f"start-up (command: {' '.join(cmd)}; log: {log_path})")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                _stop_process(process)
                raise SGLangError(f"sglang server at {url} not healthy after "
                                  f"{startup_timeout_s}s (log: {log_path})")
            time.sleep(1.0)
        return cls(url, model_path=model_path, process=process)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._process is not None:
            _stop_process(self._process)
            self._process = None
        if self._weights_dir is not None:
            self._weights_dir.cleanup()
            self._weights_dir = None

    # -- HTTP ----------------------------------------------------------------------------------

    async def _client(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
            self._session_loop = loop
        return self._session

    async def _post(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        session = await self._client()
        async with session.post(self.base_url + endpoint, json=payload or {}) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise SGLangError(f"POST {endpoint} -> HTTP {resp.status}: {body[:500]}")
        if not body:
            return None
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return body
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangError(f"POST {endpoint} failed: {data.get('message')}")
        return data

    # -- RolloutEngine -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @staticmethod
    def sampling_payload(params: SamplingParams) -> dict[str, Any]:
        """SamplingParams as SGLang ``sampling_params`` (n is expressed as a batch)."""
        payload: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "no_stop_trim": True,  # token-out: keep the stop tokens we were given
        }
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.stop_token_ids:
            payload["stop_token_ids"] = list(params.stop_token_ids)
        return payload

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        if request_id in self._rids:
            raise ValueError(f"request_id={request_id!r} is already running")
        rids = [f"{request_id}-{i}" for i in range(params.n)]
        version = self._version
        self._rids[request_id] = rids
        try:
            result = await self._post("/generate", {
                "input_ids": [list(prompt_ids)] * params.n,
                "rid": rids,
                "sampling_params": self.sampling_payload(params),
                "return_logprob": True,
            })
        finally:
            self._rids.pop(request_id, None)
        outputs = result if isinstance(result, list) else [result]
        if len(outputs) != params.n:
            raise SGLangError(f"/generate returned {len(outputs)} outputs for n={params.n}")
        return [self.parse_output(out, version) for out in outputs]

    @staticmethod
    def parse_output(out: dict[str, Any], version: int) -> Completion:
        meta = out.get("meta_info") or {}
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise SGLangError("/generate result has no meta_info.output_token_logprobs")
        token_ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        return Completion(token_ids=token_ids, logprobs=logprobs,
                          versions=[version] * len(token_ids),
                          finish_reason=_FINISH.get(str(kind), "length"))

    async def abort(self, request_id: str) -> None:
        for rid in self._rids.get(request_id, []):
            await self._post("/abort_request", {"rid": rid})

    async def pause(self) -> None:
        await self._post("/pause_generation", {"mode": "in_place"})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Write the weights as a checkpoint beside the model's config; the server loads it."""
        if self.model_path is None:
            raise ValueError("SGLangEngine.load_weights needs model_path (the served model's "
                             "directory, for its config and tokenizer files)")
        directory = await asyncio.to_thread(self._write_checkpoint, weights)
        await self._post("/update_weights_from_disk", {
            "model_path": directory, "weight_version": str(version)})
        self._version = version

    def _write_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        from safetensors.torch import save_file

        if self._weights_dir is None:
            self._weights_dir = tempfile.TemporaryDirectory(prefix="streamrl-sglang-")
        out = Path(self._weights_dir.name)
        assert self.model_path is not None
        for item in Path(self.model_path).iterdir():
            if item.is_file() and item.suffix not in (".safetensors", ".bin", ".pt"):
                shutil.copy2(item, out / item.name)
        for old in out.glob("*.safetensors*"):
            old.unlink()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights}
        save_file(tensors, str(out / "model.safetensors"))
        return str(out)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> None:
        """Have the server join a process group for broadcasts (the sender joins as rank 0)."""
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": backend,
        })

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """Receive the named tensors by broadcast; the caller broadcasts them concurrently."""
        await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": True, "weight_version": str(version),
        })
        self._version = version

    async def sleep(self) -> None:
        await self._post("/release_memory_occupation", {})

    async def wake_up(self) -> None:
        await self._post("/resume_memory_occupation", {})

    async def health(self) -> bool:
        try:
            session = await self._client()
            async with session.get(self.base_url + "/health") as resp:
                return resp.status == 200
        except Exception:
            return False


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    """Stop a server we launched, with its children (it runs in its own session)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
