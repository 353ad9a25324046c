"""SGLangEngine. The request/response mapping is checked everywhere on the documented shapes;
the server tests launch a real SGLang server on a tiny model and run only where CUDA and the
``sglang`` package are present (scripts/gpu_check.sh), skipping cleanly elsewhere."""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest
import torch

from streamrl.rollout_fleet.engine import SamplingParams
from streamrl.rollout_fleet.sglang_engine import SGLangEngine, SGLangError
from tests.support import free_port


def test_sampling_payload_and_output_parsing():
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_tokens=12,
                            stop=("\n\n",), stop_token_ids=(2,))
    assert SGLangEngine.sampling_payload(params) == {
        "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "no_stop_trim": True, "stop": ["\n\n"], "stop_token_ids": [2]}
    out = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 6},
        "output_token_logprobs": [[-0.5, 5, None], [-1.25, 6, None]]}}
    c = SGLangEngine.parse_output(out, version=4)
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason) == (
        [5, 6], [-0.5, -1.25], [4, 4], "stop")
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "x"},
                             "output_token_logprobs": []}}
    assert SGLangEngine.parse_output(aborted, 0).finish_reason == "abort"
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        SGLangEngine.parse_output({"meta_info": {}}, 0)


needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="needs the sglang package")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from streamrl.testing import build_tiny_model

    # head_dim 64: SGLang's GPU attention kernels do not take the CPU default's 32
    model_dir = build_tiny_model(tmp_path_factory.mktemp("sgl-tiny"), hidden_size=128,
                                 num_heads=2)
    log = tmp_path_factory.mktemp("sgl-log") / "server.log"
    engine = SGLangEngine.launch(
        str(model_dir), port=free_port(), log_path=str(log),
        extra_args=["--dtype", "bfloat16", "--mem-fraction-static", "0.2",
                    "--context-length", "512", "--disable-cuda-graph"])
    yield engine, model_dir
    asyncio.run(engine.close())


PROMPT = [25, 31, 25, 31]


@pytest.mark.gpu
@needs_sglang
def test_generate_logprobs_match_hf_recompute(server):
    from transformers import AutoModelForCausalLM

    engine, model_dir = server
    outs = asyncio.run(engine.generate(PROMPT, SamplingParams(n=4, max_tokens=8), "g"))
    assert len(outs) == 4 and len({tuple(c.token_ids) for c in outs}) > 1
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for c in outs:
        assert c.versions == [0] * len(c.token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + c.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1)
        ref = ref.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=0.1, rtol=0.05)


@pytest.mark.gpu
@needs_sglang
def test_load_weights_changes_output_and_versions(server):
    from transformers import AutoModelForCausalLM

    engine, model_dir = server
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = asyncio.run(engine.generate(PROMPT, greedy, "b"))[0]
    state = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    asyncio.run(engine.load_weights(noisy.items(), version=1))
    after = asyncio.run(engine.generate(PROMPT, greedy, "a"))[0]
    assert after.token_ids != before.token_ids and after.versions == [1] * len(after.token_ids)
    asyncio.run(engine.load_weights(state.items(), version=2))
    assert asyncio.run(engine.generate(PROMPT, greedy, "c"))[0].token_ids == before.token_ids


@pytest.mark.gpu
@needs_sglang
def test_update_weights_from_distributed(server):
    from sglang.srt.utils import init_custom_process_group
    from transformers import AutoModelForCausalLM

    engine, model_dir = server
    state = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).state_dict()
    names = list(state)
    port = free_port()
    group = {}

    def join():  # rank 0 (this process) rendezvouses while the server joins as rank 1
        group["pg"] = init_custom_process_group(
            backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
            group_name="streamrl_test")

    async def scenario():
        joiner = threading.Thread(target=join)
        joiner.start()
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "streamrl_test")
        joiner.join(60)
        tensors = [state[n].cuda() * 0 for n in names]  # zero weights: greedy output changes

        def send():
            for t in tensors:
                torch.distributed.broadcast(t, src=0, group=group["pg"])

        sender = asyncio.to_thread(send)
        await asyncio.gather(sender, engine.update_weights_from_distributed(
            names, ["bfloat16"] * len(names), [list(state[n].shape) for n in names],
            version=5, group_name="streamrl_test"))
        return await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4), "d")

    out = asyncio.run(scenario())[0]
    assert engine.version == 5 and out.versions == [5] * len(out.token_ids)
    asyncio.run(engine.load_weights(state.items(), version=6))  # restore


@pytest.mark.gpu
@needs_sglang
def test_pause_abort_resume_and_health(server):
    engine, _ = server

    async def scenario():
        assert await engine.health()
        await engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=64), "p"))
        await asyncio.sleep(1.0)
        await engine.abort("p")
        await engine.resume()
        return await asyncio.wait_for(task, 60)

    outs = asyncio.run(scenario())
    assert outs[0].finish_reason == "abort"
