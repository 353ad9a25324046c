"""GPU-only paths of the weight bus: the NCCL weight group and the SGLang relay.

Skipped without CUDA (and sglang for the relay); ``scripts/gpu_check.sh`` runs them on a GPU."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
import torch

from streamrl.weight_bus.collective import CollectivePublisher
from tests.support.weights import digest, make_state


def nccl_receiver_main(endpoint: str, reports) -> None:  # pragma: no cover - GPU only
    from streamrl.weight_bus.collective import CollectiveReceiver

    torch.cuda.set_device(0)

    def sink(weights, version):
        reports.put((version, digest(weights)))

    receiver = CollectiveReceiver(endpoint, sink, receiver_id="gpu-rx", timeout_s=60)
    reports.put(("ready", {}))
    receiver.wait_version(1, 120)
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
        assert reports.get(timeout=120)[0] == "ready"
        publisher.wait_for_receivers(1)
        state = {k: v.cuda() for k, v in make_state(1).items()}
        publisher.publish(1, state.items())
        version, got = reports.get(timeout=120)
        assert version == 1 and got == digest(state.items())
    except queue.Empty:
        pytest.fail("the NCCL receiver did not report")
    finally:
        proc.join(timeout=30)
        publisher.close()


@pytest.mark.gpu
def test_sglang_receiver_is_importable_and_needs_sglang() -> None:  # pragma: no cover
    pytest.importorskip("sglang")
    from streamrl.weight_bus.sglang_receiver import SGLangReceiver, SGLangRelay

    assert SGLangReceiver and SGLangRelay


def test_sglang_receiver_refuses_cpu_only_machines() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    from streamrl.weight_bus.sglang_receiver import SGLangReceiver

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        SGLangReceiver("tcp://127.0.0.1:1", engine=object())
