"""HFEngine: the slow, simple reference RolloutEngine on plain transformers.

It exists for unit tests and machines without vLLM, and as the yardstick the fast engines are
checked against, so it favours obviously-correct over fast:

- Decoding is a hand-written loop over ``model(..., past_key_values=...)`` rather than
  ``generate()``, because the loop must stamp each token with the policy version that sampled
  it, honour abort / pause between steps, and return the log-prob of each sampled token under
  the *processed* distribution it was drawn from (temperature, then top-k, then top-p: vLLM's
  ``processed_logprobs``). ``processed_logprobs`` is public so tests can recompute it
  teacher-forced. Temperature 0 is greedy, with the log-probs of the unscaled distribution.
- The n samples of one request decode as one batch (same prompt: no padding). Concurrent
  requests run in their own threads (a dedicated pool, so the event loop and
  ``asyncio.to_thread`` users stay free) and interleave step by step under ``_model_lock``.
- ``load_weights`` copies the new tensors in while holding the same lock, so a step never sees
  half-loaded weights; tokens sampled after the swap carry the new version. In-flight requests
  keep their KV cache across a swap (vLLM's behaviour under the ``pause`` update policy).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from streamrl import algos
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams

_PAUSE_POLL_S = 0.02


def processed_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs (last dim) of the distribution sampling draws from; -inf outside top-k/top-p."""
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    z = (logits / temperature).reshape(-1, logits.shape[-1])
    return torch.log_softmax(algos.truncate_logits_(z, top_k, top_p), dim=-1).reshape(logits.shape)


class HFEngine(RolloutEngine):
    """transformers-backed engine; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_model_len: int = 512,
        max_concurrency: int = 8,
        version: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from streamrl.models import resolve_model_path

        path = resolve_model_path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self._eos_ids = self._find_eos_ids()
        self._version = version
        self._model_lock = threading.Lock()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._running = threading.Event()
        self._running.set()
        self._state_lock = threading.Lock()
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="hf-engine")

    @classmethod
    def from_config(cls, cfg: Any) -> HFEngine:
        """Build from a streamrl ``Config`` (model.path, rollout.dtype/seed/max_model_len)."""
        device = "cuda" if torch.cuda.is_available() and cfg.learner.device != "cpu" else "cpu"
        return cls(cfg.model.path, dtype=cfg.rollout.dtype, device=device, seed=cfg.rollout.seed,
                   max_model_len=cfg.rollout.max_model_len,
                   max_concurrency=cfg.rollout.max_inflight_groups)

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    @property
    def version(self) -> int:
        return self._version

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        if self._closed:
            raise RuntimeError("HFEngine is closed")
        self._check_request(prompt_ids, params)
        with self._state_lock:
            if request_id in self._active:
                raise ValueError(f"request_id={request_id!r} is already running")
            self._active.add(request_id)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._executor, self._generate_sync, list(prompt_ids), params, request_id)
        finally:
            with self._state_lock:
                self._active.discard(request_id)
                self._aborted.discard(request_id)

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit "
                             f"max_model_len={self.max_model_len}")
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n}, max_tokens={params.max_tokens}: "
                             "must be >= 1")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"SamplingParams top_p={params.top_p}: must be in (0, 1]")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids hold a token outside the vocabulary [0, {vocab})")

    def _wait_running(self, request_id: str) -> bool:
        """Block while paused; False if the request was aborted meanwhile."""
        while not self._running.wait(_PAUSE_POLL_S):
            if request_id in self._aborted or self._closed:
                return False
        return request_id not in self._aborted and not self._closed

    def _generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        n = params.n
        completions = [Completion() for _ in range(n)]
        finished = [False] * n
        stop_ids = self._eos_ids | frozenset(params.stop_token_ids)
        budget = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        inputs = torch.tensor([prompt_ids] * n, device=self.device)
        cache = None
        for _ in range(budget):
            if not self._wait_running(request_id):
                break
            with self._model_lock, torch.inference_mode():
                version = self._version
                out = self.model(input_ids=inputs, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logprobs = processed_logprobs(out.logits[:, -1, :], params.temperature,
                                              params.top_k, params.top_p)
                if params.temperature <= 0:
                    tokens = logprobs.argmax(dim=-1)
                else:
                    tokens = torch.multinomial(logprobs.exp(), 1, generator=self._generator)
                    tokens = tokens.squeeze(-1)
                picked = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
            for i, (token, logprob) in enumerate(zip(tokens.tolist(), picked.tolist())):
                if finished[i]:
                    continue
                c = completions[i]
                c.token_ids.append(token)
                c.logprobs.append(logprob)
                c.versions.append(version)
                if token in stop_ids or self._hits_stop_string(c.token_ids, params.stop):
                    c.finish_reason, finished[i] = "stop", True
            if all(finished):
                break
            inputs = tokens[:, None]
        aborted = request_id in self._aborted or self._closed
        for c, done in zip(completions, finished):
            if not done:
                c.finish_reason = "abort" if aborted else "length"
        return completions

    def _hits_stop_string(self, token_ids: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    # -- control -------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        with self._state_lock:
            if request_id in self._active:
                self._aborted.add(request_id)

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        # a thread of its own: the generation pool may be full of requests waiting on a pause
        await asyncio.to_thread(self._load_weights_sync, weights, version)

    def _load_weights_sync(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        params = self.model.state_dict()
        staged: dict[str, torch.Tensor] = {}
        # receive and convert everything first: the swap itself is then a short critical section
        for name, tensor in weights:
            target = params.get(name)
            if target is None:
                raise ValueError(f"load_weights: unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            staged[name] = tensor.detach().to(device=target.device, dtype=target.dtype)
        with self._model_lock, torch.no_grad():
            for name, tensor in staged.items():
                params[name].copy_(tensor)
            self._version = version

    async def health(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        self._closed = True
        self._running.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
