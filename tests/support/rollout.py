"""Rollout-fleet test support: a list-backed buffer, the toy scorer, a bounded wait, a
scripted engine / prompt / scorer trio that runs a Replica without a model (test doubles of the
engine seam, for replica logic whose outcome must be chosen exactly: rewards, lengths, finish
reasons), and the controller's loop without training over a real MemoryBuffer
(``serve_learner``, ``train_steps``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import torch

from streamrl.buffer.base import BufferProducer
from streamrl.buffer.memory import MemoryBuffer
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.data.toy import toy_reward
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams
from streamrl.rollout_fleet.replica import Replica
from streamrl.types import Group


class ListBuffer(BufferProducer):
    """At most ``capacity`` admissions; put groups land in a list."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.started = 0
        self.given_back = 0
        self.groups: list[Group] = []

    def try_admit(self, holder: str = "") -> bool:
        if self.started >= self.capacity:
            return False
        self.started += 1
        return True

    def cancel_admission(self, holder: str = "") -> None:
        self.started -= 1
        self.given_back += 1

    def put(self, group: Group, holder: str = "") -> None:
        self.groups.append(group)


class ToyScorer:
    """The toy task's reward as a plain coroutine; ``fail_first`` calls raise."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls = 0
        self.fail_first = fail_first

    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("reward function bug")
        return toy_reward(extra_info["task"], solution_str, str(ground_truth),
                          extra_info["max_new_tokens"])


async def wait_until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- a Replica without a model ----------------------------------------------------------------


class IdTokenizer:
    """Decodes token ids as their numbers, space-separated (all a Replica asks of a tokenizer
    in single-turn groups)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class ScriptedEngine(RolloutEngine):
    """Answers sample j of prompt ``[i]`` with ``length`` copies of token j and ``finish``,
    where ``shapes[i][j] == (length, finish)`` (default: 4 tokens, "stop"); every token has
    log-prob -0.5 and the version last loaded (``load_weights`` only adopts the version).
    ``answered`` lists the prompt indices in the order answered."""

    def __init__(self, shapes: dict[int, list[tuple[int, str]]] | None = None) -> None:
        self.shapes = shapes or {}
        self.answered: list[int] = []
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                       ) -> list[Completion]:
        await asyncio.sleep(0)  # let other groups and the learner run in between
        index = prompt_ids[0]
        shapes = self.shapes.get(index, [(4, "stop")] * params.n)
        assert len(shapes) == params.n, (index, shapes, params.n)
        self.answered.append(index)
        return [Completion([j] * n, [-0.5] * n, [self._version] * n, finish)
                for j, (n, finish) in enumerate(shapes)]

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int
                           ) -> None:
        self._version = version


def scripted_prompts(rewards: list[list[float]]) -> PromptStream:
    """Prompt i is ``[i]``; its sample j scores ``rewards[i][j]`` under ``ListedRewards``.
    The stream cycles through the prompts in order, as an epoch stream does."""
    prompts = [Prompt(index=i, prompt_ids=[i], data_source="scripted", ground_truth=None,
                      extra={"rewards": list(r)}) for i, r in enumerate(rewards)]
    return PromptStream(ListPromptSource(prompts, name="scripted"), shuffle=False, seed=0)


class ListedRewards:
    """Scores a ScriptedEngine response: sample j (its first token) of a ``scripted_prompts``
    prompt gets that prompt's ``rewards[j]``."""

    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return float(extra_info["rewards"][int(solution_str.split()[0])])


# -- the controller's loop without training -----------------------------------------------

async def serve_learner(buffer: MemoryBuffer, replica: Replica, steps: int,
                        timeout: float = 10.0) -> list[list[Group]]:
    """The controller's loop without training: take ``steps`` batches of B groups, publishing
    each new version to the replica (drain with eta 0, else pause) and then to the buffer,
    checking the accounting and the bound at every look."""
    adm = buffer.admission
    policy = "drain" if adm.max_staleness == 0 else "pause"
    batches = []
    for version in range(steps):
        deadline = time.monotonic() + timeout
        while True:
            s = buffer.stats()
            assert s.started == s.consumed + s.queued + s.in_flight, s
            assert s.started <= adm.capacity(version), s
            try:
                batch = buffer.take(adm.groups_per_step, version, timeout=0)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, f"learner starved at version {version}: {s}"
                await asyncio.sleep(0.001)
        buffer.ack([g.group_id for g in batch])
        batches.append(batch)
        await replica.update_weights([], version + 1, policy)
        buffer.set_version(version + 1)
    return batches


def train_steps(buffer: MemoryBuffer, replica: Replica, steps: int) -> list[list[Group]]:
    """Run ``replica`` while ``serve_learner`` takes ``steps`` batches; returns the batches."""

    async def scenario() -> list[list[Group]]:
        replica.start()
        try:
            return await serve_learner(buffer, replica, steps)
        finally:
            await replica.stop()

    return asyncio.run(scenario())
