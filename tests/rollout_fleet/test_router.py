"""Router: least-loaded spreading, unhealthy engines skipped and retried after a cool-down,
clear errors. Routing logic runs against minimal engines with fixed completions; one test
routes real groups over two HFEngines on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
import torch

from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams
from streamrl.rollout_fleet.router import NoHealthyEngineError, RequestFailedError, Router


class FixedEngine(RolloutEngine):
    """Returns n copies of a fixed completion; can be made slow, failing or unhealthy."""

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.healthy = True
        self.fail = False
        self.gate: asyncio.Event | None = None
        self.calls = 0
        self.aborted: list[str] = []

    @property
    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, params, request_id):
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError(f"engine {self.tag} broke")
        return [Completion(token_ids=[self.tag], logprobs=[0.0], versions=[0])] * params.n

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int):
        ...

    async def health(self) -> bool:
        return self.healthy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


PARAMS = SamplingParams(n=2, max_tokens=4)


def test_least_loaded_first_and_even_spread():
    engines = [FixedEngine(i) for i in range(3)]
    router = Router(engines)

    async def scenario():
        engines[0].gate = asyncio.Event()  # engine 0 holds its calls
        slow = asyncio.create_task(router.generate([1], PARAMS, "slow"))
        await asyncio.sleep(0)
        assert [s.in_flight for s in router.states] == [1, 0, 0]
        # 4 quick groups: none goes to the busy engine 0 while 1 and 2 are idle
        quick = await asyncio.gather(*(router.generate([1], PARAMS, f"q{i}") for i in range(4)))
        engines[0].gate.set()
        await slow
        return quick

    quick = asyncio.run(scenario())
    assert sorted(out[0].token_ids[0] for out in quick) == [1, 1, 2, 2]
    assert [e.calls for e in engines] == [1, 2, 2]
    assert all(len(out) == 2 for out in quick)
    assert [s["in_flight"] for s in router.stats()] == [0, 0, 0]


def test_failing_engine_is_retried_elsewhere_marked_down_and_back_after_cooldown():
    engines = [FixedEngine(0), FixedEngine(1)]
    clock = Clock()
    router = Router(engines, max_errors=2, cooldown_s=10.0, max_retries=1, clock=clock)
    engines[0].fail = True

    async def run(n: int):
        return [await router.generate([1], PARAMS, f"r{i}") for i in range(n)]

    outs = asyncio.run(run(4))
    assert all(o[0].token_ids == [1] for o in outs)  # every failure was retried on engine 1
    assert not router.stats()[0]["healthy"]
    assert "2 consecutive errors" in router.stats()[0]["down_reason"]
    calls_while_down = engines[0].calls
    asyncio.run(run(3))
    assert engines[0].calls == calls_while_down  # skipped while down

    engines[0].fail = False
    clock.now = 5.0
    asyncio.run(run(2))
    assert engines[0].calls == calls_while_down  # cool-down not over yet
    clock.now = 11.0
    asyncio.run(run(4))
    assert router.stats()[0]["healthy"] and engines[0].calls > calls_while_down


def test_unhealthy_engines_and_no_healthy_engine_error():
    engines = [FixedEngine(0), FixedEngine(1)]
    clock = Clock()
    router = Router(engines, cooldown_s=30.0, clock=clock)
    engines[1].healthy = False
    assert asyncio.run(router.check_health()) == [True, False]
    out = asyncio.run(router.generate([1], PARAMS, "a"))
    assert out[0].token_ids == [0]

    engines[0].healthy = False
    asyncio.run(router.check_health())
    with pytest.raises(NoHealthyEngineError, match=r"#0 down .*retried in 30\.0s.*#1 down"):
        asyncio.run(router.generate([1], PARAMS, "b"))
    # a probe after the cool-down that still fails keeps it down; one that passes revives it
    clock.now = 31.0
    with pytest.raises(NoHealthyEngineError):
        asyncio.run(router.generate([1], PARAMS, "c"))
    engines[1].healthy = True
    clock.now = 62.0
    assert asyncio.run(router.generate([1], PARAMS, "d"))[0].token_ids == [1]


def test_request_failing_everywhere_and_abort_routing():
    engines = [FixedEngine(0), FixedEngine(1)]
    router = Router(engines, max_errors=5, max_retries=3)
    engines[0].fail = engines[1].fail = True
    with pytest.raises(RequestFailedError, match=r"failed on engines \[0, 1\].*broke"):
        asyncio.run(router.generate([1], PARAMS, "x"))

    engines[0].fail = engines[1].fail = False

    async def scenario():
        for e in engines:
            e.gate = asyncio.Event()
        task = asyncio.create_task(router.generate([1], PARAMS, "job"))
        await asyncio.sleep(0)
        await router.abort("job")
        await router.abort("unknown")  # not running anywhere: ignored
        for e in engines:
            e.gate.set()
        await task

    asyncio.run(scenario())
    assert [e.aborted for e in engines].count(["job"]) == 1
    assert sum(len(e.aborted) for e in engines) == 1


def test_routes_real_groups_over_two_hf_engines(tiny_model_dir):
    from streamrl.rollout_fleet.hf_engine import HFEngine

    engines = [HFEngine(str(tiny_model_dir), seed=i) for i in range(2)]
    router = Router(engines)

    async def scenario():
        try:
            return await asyncio.gather(*(
                router.generate([25, 31], SamplingParams(n=2, max_tokens=6), f"g{i}")
                for i in range(6)))
        finally:
            for e in engines:
                await e.close()

    groups = asyncio.run(scenario())
    assert len(groups) == 6 and all(len(g) == 2 and g[0].token_ids for g in groups)
    served = [s["served"] for s in router.stats()]
    assert served == [3, 3]
