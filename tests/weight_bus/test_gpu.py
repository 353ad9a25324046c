"""GPU-only paths of the weight bus: the NCCL weight group and the SGLang relay's staging.

Skipped without CUDA; ``scripts/gpu_check.sh`` runs them on a GPU (the relay into a live SGLang
server is tests/rollout_fleet/test_sglang_engine.py's)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue

import pytest
import torch

from streamrl.net import LOOPBACK
from streamrl.weight_bus.collective import CollectivePublisher
from tests.support.weights import digest, make_state

UNUSED_URL = "http://127.0.0.1:9"  # never contacted: no request is made


def nccl_receiver_main(endpoint: str, reports) -> None:  # pragma: no cover - GPU only
    from streamrl.weight_bus.collective import CollectiveReceiver

    torch.cuda.set_device(0)

    def sink(weights, version):
        reports.put((version, digest(weights)))

    receiver = CollectiveReceiver(endpoint, sink, receiver_id="gpu-rx", timeout_s=60)
    reports.put(("ready", {}))
    receiver.wait_version(2, 120)
    receiver.close()


@pytest.mark.gpu
def test_nccl_publish_roundtrip() -> None:  # pragma: no cover - GPU only
    # One GPU: both ranks share device 0 (NCCL allows it across processes).
    publisher = CollectivePublisher(backend="nccl", bucket_mb=1, timeout_s=60)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    proc = ctx.Process(target=nccl_receiver_main, args=(publisher.endpoint, reports))
    proc.start()
    try:
        assert reports.get(timeout=120) == ("ready", {})
        assert publisher.wait_for_receivers(1) == ["gpu-rx"]
        # Version 1 goes out streamed and makes the bucket plan; version 2 follows the plan,
        # zero-copy from the GPU tensors. Each arrives bit-exact.
        for version in (1, 2):
            state = {k: v.cuda() for k, v in make_state(version).items()}
            stats = publisher.publish(version, state.items())
            assert stats.receivers == ("gpu-rx",) and stats.num_tensors == len(state)
            assert reports.get(timeout=120) == (version, digest(state.items()))
    except queue.Empty:
        pytest.fail("the NCCL receiver did not report")
    finally:
        proc.join(timeout=30)
        publisher.close()


@pytest.mark.gpu
def test_sglang_relay_stages_the_received_tensors() -> None:  # pragma: no cover - GPU only
    from streamrl.rollout_fleet.sglang_engine import SGLangEngine
    from streamrl.weight_bus.sglang_receiver import RelayedWeights, SGLangRelay

    engine = SGLangEngine(UNUSED_URL)
    relay = SGLangRelay(engine, tp_size=2)
    state = {k: v.cuda() for k, v in make_state(3).items()}
    staged = RelayedWeights(list(state.items()), relay)
    assert relay.host == LOOPBACK  # the server runs here: its ranks reach the relay on loopback
    assert relay.group is None  # the relay group opens on the first load, not before
    assert digest(staged) == digest(state.items())  # sinks iterating it get the tensors as sent
    with pytest.raises(ValueError, match="not the one this relay feeds"):
        asyncio.run(staged.load_into(SGLangEngine(UNUSED_URL), 1))
    assert relay.group is None


def test_sglang_receiver_refuses_cpu_only_machines() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    from streamrl.weight_bus.sglang_receiver import SGLangReceiver

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        SGLangReceiver("tcp://127.0.0.1:1", engine=object())
