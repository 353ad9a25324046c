"""Co-located mode for real: the learner's tensors and an InprocVLLMEngine share this process;
the publisher hands full tensors straight to the engine's reload path (sleep before training,
wake before sampling)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamrl.config import RolloutConfig, WeightBusConfig
from streamrl.rollout_fleet.engine import SamplingParams
from streamrl.weight_bus import make_publisher
from streamrl.weight_bus.colocated import ColocatedPublisher
from tests.support.weights import PROMPT, second_model

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def engine_loop(tiny_model_dir):
    """One engine on an event loop running in a background thread (as beside a learner)."""
    from streamrl.rollout_fleet.vllm_inproc_engine import InprocVLLMEngine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def build():
        return InprocVLLMEngine(str(tiny_model_dir), RolloutConfig(max_model_len=256))

    engine = asyncio.run_coroutine_threadsafe(build(), loop).result(timeout=300)
    yield engine, loop
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def greedy(engine, loop) -> tuple[list[int], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    [done] = asyncio.run_coroutine_threadsafe(engine.generate(PROMPT, params, "g"), loop).result(60)
    return done.token_ids, done.versions


def test_colocated_swap_in_place(engine_loop, tiny_model_dir):
    engine, loop = engine_loop
    cfg = WeightBusConfig(backend="colocated")
    with pytest.raises(ValueError, match="needs the in-process engine"):
        make_publisher(cfg)
    publisher = make_publisher(cfg, engine=engine, loop=loop)
    assert isinstance(publisher, ColocatedPublisher)

    before, _ = greedy(engine, loop)
    state, expected = second_model(str(tiny_model_dir), seed=123)
    assert before != expected

    publisher.sleep()  # before training (a no-op for vLLM on CPU, must not break anything)
    stats = publisher.publish(1, state.items())  # wakes the engine, then swaps in place
    assert stats.num_tensors == len(state) and engine.version == 1
    tokens, versions = greedy(engine, loop)
    assert tokens == expected and versions == [1] * len(tokens)

    with pytest.raises(ValueError, match="must be greater"):
        publisher.publish(1, state.items())
