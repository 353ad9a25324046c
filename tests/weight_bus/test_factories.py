"""The weight-bus factories pick the receiver that fits the engine.

Engines are real instances: an ``SGLangEngine`` is built by its own constructor (it talks to a
server only when called); a ``VLLMEngine`` and an ``HFEngine`` are allocated without ``__init__``
(which would start vLLM or load a model), which is enough because the choice reads methods the
class defines. The in-process path with no engine is exercised end to end in test_collective.py.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.config import Config, ConfigError, WeightBusConfig, replace, validate
from streamrl.rollout_fleet.hf_engine import HFEngine
from streamrl.rollout_fleet.sglang_engine import SGLangEngine
from streamrl.rollout_fleet.vllm_engine import VLLMEngine
from streamrl.weight_bus import make_receiver, receiver_class
from streamrl.weight_bus.collective import CollectiveReceiver
from streamrl.weight_bus.sglang_receiver import SGLangReceiver
from streamrl.weight_bus.vllm_receiver import VLLMReceiver

UNUSED_URL = "http://127.0.0.1:9"  # never contacted: no request is made


def test_receiver_class_follows_the_engine() -> None:
    assert receiver_class(SGLangEngine(UNUSED_URL)) is SGLangReceiver
    assert receiver_class(VLLMEngine.__new__(VLLMEngine)) is VLLMReceiver
    assert receiver_class(HFEngine.__new__(HFEngine)) is CollectiveReceiver
    assert receiver_class(None) is CollectiveReceiver


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_make_receiver_builds_the_sglang_receiver_for_an_sglang_engine() -> None:
    # SGLangReceiver's own CPU refusal shows that make_receiver constructed it for this engine.
    with pytest.raises(RuntimeError, match="SGLangReceiver needs a CUDA GPU"):
        make_receiver(WeightBusConfig(), endpoint="tcp://127.0.0.1:9", sink=_unused_sink,
                      engine=SGLangEngine(UNUSED_URL), receiver_id="sglang")


def test_make_receiver_refuses_the_colocated_backend() -> None:
    with pytest.raises(ValueError, match="colocated' has no receiver"):
        make_receiver(WeightBusConfig(backend="colocated"), endpoint="tcp://127.0.0.1:9",
                      sink=_unused_sink, engine=SGLangEngine(UNUSED_URL))


async def _unused_sink(weights: object, version: int) -> None:
    raise AssertionError("no version is ever published in these tests")


def test_a_streamed_receive_needs_an_engine_that_loads_weights_as_they_arrive() -> None:
    # HFEngine stages what it is given before swapping: views of a reused buffer would change.
    with pytest.raises(ValueError, match=r"weight_bus.receive='streamed': needs a vLLM engine"):
        make_receiver(WeightBusConfig(receive="streamed"), endpoint="tcp://127.0.0.1:9",
                      sink=_unused_sink, engine=HFEngine.__new__(HFEngine))


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"weight_bus.receive": "lazy"}, r"weight_bus.receive='lazy': must be one of"),
    ({"weight_bus.receive": "streamed", "weight_bus.update_policy": "rolling"},
     r"weight_bus.update_policy='rolling': contradicts weight_bus.receive=streamed"),
    ({"weight_bus.receive": "streamed", "rollout.backend": "hf"},
     r"weight_bus.receive='streamed': needs rollout.backend=vllm"),
    ({"weight_bus.receive": "streamed", "actor.lora.rank": 8},
     r"weight_bus.receive='streamed': needs full-weight publishes"),
])
def test_config_refuses_a_streamed_receive_where_it_cannot_work(changes: dict,
                                                                 pattern: str) -> None:
    cfg = replace(Config(), **changes)
    with pytest.raises(ConfigError, match=pattern):
        validate(cfg)
    assert validate(replace(Config(), **{"weight_bus.receive": "streamed"}))
