"""Weights handed over to the bus are kept by reference; any other iterable is copied.

The kept version serves late joiners: each must get exactly the latest version's bytes, whether
it was kept by reference or copied, and whatever the caller wrote to its tensors afterwards.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from streamrl.learner.fsdp import iter_full_parameters
from streamrl.learner.worker import LearnerWorker
from streamrl.weight_bus import HandedOver
from streamrl.weight_bus.collective import CollectivePublisher, CollectiveReceiver
from tests.support.learner import free_port, make_config, run_ranks
from tests.support.weights import digest, make_state

TIMEOUT_S = 10.0


def late_joiner(pub: CollectivePublisher, rid: str) -> tuple[int, dict[str, str]]:
    """The version a receiver joining now loads, and its digest (taken inside the sink, while
    the views into the receive buffers are valid)."""
    got: list[tuple[int, dict[str, str]]] = []
    loaded = threading.Event()

    def sink(weights, version: int) -> None:
        got.append((version, digest(weights)))
        loaded.set()

    with CollectiveReceiver(pub.endpoint, sink, receiver_id=rid, timeout_s=TIMEOUT_S):
        assert loaded.wait(2 * TIMEOUT_S), f"late joiner {rid} got no version"
    # Gone (bye) before the next publish, which then has no members.
    assert pub.control.wait_for(lambda: not pub.control.live(), TIMEOUT_S)
    return got[0]


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_late_joiners_get_the_latest_version_kept_by_reference_or_copied() -> None:
    # 10 KB buckets: the float32 layers (12 KB) and the embedding go out as views of their own
    # memory, the small weights are staged.
    with CollectivePublisher(bucket_mb=0.01, timeout_s=TIMEOUT_S) as pub:
        assert pub.keep_latest
        for version, handed in [(1, False), (2, True), (3, True), (4, False), (5, True)]:
            state = make_state(version)
            published = digest(state.items())
            pub.publish(version, HandedOver(state.items()) if handed else state.items())
            assert pub._kept is not None
            kept = storages(pub._kept.segments)
            if handed:  # kept by reference: the big weights' own memory
                assert storages(state.values()) & kept
            else:  # copied: the caller may write to its tensors now, and does
                assert not storages(state.values()) & kept
                for tensor in state.values():
                    tensor.add_(1)
            assert late_joiner(pub, f"late-{version}") == (version, published)


def test_a_cast_is_handed_over_and_live_parameters_are_not() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    live = storages(model.parameters())
    # World size 1, no cast: the live parameters themselves, which the optimizer writes.
    same = iter_full_parameters(model)
    assert not isinstance(same, HandedOver)
    assert storages(t for _, t in same) == live
    cast = iter_full_parameters(model, torch.bfloat16)
    assert isinstance(cast, HandedOver)
    tensors = dict(cast)
    assert not storages(tensors.values()) & live
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def _learner_hands_over(rank: int, world: int, port: int, model_dir: str,
                        out: str) -> dict[str, Any]:
    cfg = make_config(model_dir, out, **{"learner.world_size": world})
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    live = storages(p.to_local() if isinstance(p, DTensor) else p
                    for p in worker.actor.model.parameters())
    weights = worker.named_full_parameters()
    tensors = [t for _, t in weights]
    if world > 1:
        worker.shutdown()
    return {"handed": isinstance(weights, HandedOver), "count": len(tensors),
            "aliased": bool(storages(tensors) & live)}


def test_the_learner_hands_over_its_gathered_weights(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """Two FSDP2 ranks gather every parameter into new memory: handed over. One rank yields its
    live parameters: not."""
    two = run_ranks(2, _learner_hands_over, str(tiny_model_dir), str(tmp_path / "two"),
                    tmp=tmp_path)
    assert two[0]["handed"] and two[0]["count"] > 0 and not two[0]["aliased"]
    one = _learner_hands_over(0, 1, free_port(), str(tiny_model_dir), str(tmp_path / "one"))
    assert not one["handed"] and one["aliased"]
