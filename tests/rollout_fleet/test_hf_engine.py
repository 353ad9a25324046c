"""HFEngine on the real tiny model: sampling, behaviour log-probs against a teacher-forced
recompute, stops, abort / pause, weight loads and per-token version stamps."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from streamrl.rollout_fleet.engine import SamplingParams
from streamrl.rollout_fleet.hf_engine import HFEngine, processed_logprobs

PROMPT = [25, 31, 25, 31]  # "7=7=" in the tiny tokenizer


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(str(tiny_model_dir), seed=0)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def original_weights(engine):
    """Restore the engine's weights and version after a test that changes them."""
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    version = engine.version
    yield saved
    asyncio.run(engine.load_weights(saved.items(), version))


def _gen(engine, params, prompt=PROMPT, rid="r"):
    return asyncio.run(engine.generate(prompt, params, rid))


def test_samples_are_distinct_and_well_formed(engine):
    outs = _gen(engine, SamplingParams(n=8, temperature=1.0, max_tokens=8))
    assert len(outs) == 8
    assert len({tuple(c.token_ids) for c in outs}) > 1
    for c in outs:
        assert 1 <= len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert c.versions == [engine.version] * len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert (c.finish_reason == "length") == (len(c.token_ids) == 8
                                                  and c.token_ids[-1] not in engine._eos_ids)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_logprobs_equal_teacher_forced_recompute(engine, temperature, top_k, top_p):
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=12)
    for c in _gen(engine, params):
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
        logprobs = processed_logprobs(logits, temperature, top_k, top_p)
        expected = logprobs.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.isfinite(expected).all()  # every sampled token was inside top-k / top-p
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)
        if top_k > 0:
            assert (torch.isfinite(logprobs).sum(-1) <= top_k).all()


def test_greedy_and_stops(engine):
    greedy = _gen(engine, SamplingParams(n=2, temperature=0.0, max_tokens=10))
    assert greedy[0].token_ids == greedy[1].token_ids
    tokens = greedy[0].token_ids
    stop_at = tokens[3]
    cut = _gen(engine, SamplingParams(temperature=0.0, max_tokens=10,
                                      stop_token_ids=(stop_at,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == tokens[:tokens.index(stop_at) + 1]
    text = engine.tokenizer.decode(tokens[:4], skip_special_tokens=True)
    assert text.strip()
    by_text = _gen(engine, SamplingParams(temperature=0.0, max_tokens=10, stop=(text[-1],)))[0]
    assert by_text.finish_reason == "stop"
    assert text[-1] in engine.tokenizer.decode(by_text.token_ids)
    assert by_text.token_ids == tokens[:len(by_text.token_ids)] and len(by_text.token_ids) <= 4
    with pytest.raises(ValueError, match="max_model_len"):
        _gen(engine, SamplingParams(), prompt=[25] * 600)


def test_weight_load_changes_output_and_version_stamps(engine, original_weights):
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    before = _gen(engine, greedy)[0]
    gen = torch.Generator().manual_seed(1)
    perturbed = [(k, v + 0.5 * torch.randn(v.shape, generator=gen))
                 for k, v in original_weights.items()]
    asyncio.run(engine.load_weights(iter(perturbed), version=7))
    assert engine.version == 7
    after = _gen(engine, greedy)[0]
    assert after.token_ids != before.token_ids
    assert after.versions == [7] * len(after.token_ids)
    asyncio.run(engine.load_weights(original_weights.items(), version=8))
    restored = _gen(engine, greedy)[0]
    assert restored.token_ids == before.token_ids
    assert restored.versions == [8] * len(restored.token_ids)
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        asyncio.run(engine.load_weights([("nope", torch.zeros(1))], version=9))
    assert engine.version == 8


def test_swap_mid_request_stamps_tokens_with_both_versions(engine, original_weights):
    """A swap between steps of one request: tokens before carry v, tokens after carry v+1."""
    reached, go = threading.Event(), threading.Event()
    calls = []

    def hook(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:  # inside step 3 (holding the model lock)
            reached.set()
            go.wait(10)

    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    start = engine.version

    async def scenario():
        params = SamplingParams(n=2, temperature=1.0, max_tokens=6, stop_token_ids=())
        task = asyncio.create_task(engine.generate(PROMPT, params, "swap"))
        await asyncio.to_thread(reached.wait, 10)
        await engine.pause()
        go.set()  # step 3 finishes with the old weights; step 4 waits for resume
        await engine.load_weights(original_weights.items(), version=start + 1)
        await engine.resume()
        return await task

    try:
        outs = asyncio.run(scenario())
    finally:
        handle.remove()
    for c in outs:
        n_old = min(3, len(c.token_ids))
        assert c.versions == [start] * n_old + [start + 1] * (len(c.token_ids) - n_old)


def test_abort_while_paused_and_concurrent_requests(engine):
    async def scenario():
        await engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=8), "a"))
        await asyncio.sleep(0.1)
        assert not task.done()  # paused: nothing sampled
        await engine.abort("a")
        aborted = await asyncio.wait_for(task, 5)
        await engine.resume()

        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        results = await asyncio.gather(*(
            engine.generate(PROMPT, SamplingParams(n=2, max_tokens=16), f"c{i}")
            for i in range(3)))
        tick_task.cancel()
        return aborted, results, ticks

    aborted, results, ticks = asyncio.run(scenario())
    assert [c.finish_reason for c in aborted] == ["abort"]
    assert aborted[0].token_ids == []
    assert len(results) == 3 and all(len(r) == 2 for r in results)
    assert ticks > 5  # the event loop kept running while the model worked in threads
