"""Log-probs computed in the LM head (learner/logprobs.py) equal the full logits', under
FSDP2 too, without saving a [tokens x vocab] tensor; the backend choice and its fallbacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from streamrl import algos
from streamrl.learner import logprobs
from streamrl.learner.forward import MicroBatch
from streamrl.learner.fsdp import load_causal_lm
from streamrl.learner.logprobs import head_log_probs, policy_log_probs, token_log_probs
from streamrl.learner.worker import LearnerWorker
from tests.support.learner import free_port, logits_policy_forward, make_batch, make_config

CPU = torch.device("cpu")
ROWS = [0, 2, 5, 7, 11]


def forward_and_grads(fn, model, mb: MicroBatch, **kw) -> list[torch.Tensor]:
    """log-probs, entropies, then every parameter's full gradient of a loss using both."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = fn(model, mb, CPU, temperature=0.7, with_entropy=True, **kw)
    (log_probs.sum() + 0.3 * entropy.sum()).backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for p in model.parameters()]
    return [log_probs.detach(), entropy.detach(), *grads]


@pytest.mark.parametrize(("packed", "top_k", "top_p"),
                         [(True, -1, 1.0), (False, -1, 1.0), (True, 20, 0.9)])
def test_head_log_probs_equal_the_full_logits_under_fsdp2(tiny_model_dir: Path, tmp_path: Path,
                                                         packed: bool, top_k: int,
                                                         top_p: float) -> None:
    worker = LearnerWorker(make_config(tiny_model_dir, tmp_path), 0, 1, "127.0.0.1", free_port())
    model = worker.actor.model  # fully_shard'ed: lm_head.weight (tied) is a DTensor here
    assert type(model.lm_head.weight).__name__ == "DTensor"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    mb = MicroBatch.of(make_batch(3, 4, seed=3), ROWS, packed)
    cut = {"top_k": top_k, "top_p": top_p}  # the sampler's set (issue 41.1)
    want = forward_and_grads(logits_policy_forward, model, mb, **cut)
    got = forward_and_grads(policy_log_probs, model, mb, entropy_grad=True, **cut)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The entropy is a metric unless asked for with gradients; without it, None.
    log_probs, entropy = policy_log_probs(model, mb, CPU, with_entropy=True)
    assert log_probs.requires_grad and entropy is not None and not entropy.requires_grad
    assert policy_log_probs(model, mb, CPU)[1] is None
    with torch.no_grad():  # prepare's path
        torch.testing.assert_close(policy_log_probs(model, mb, CPU, temperature=0.7, **cut)[0],
                                   want[0],
                                   atol=1e-5, rtol=1e-5)


def test_head_log_probs_save_no_vocab_sized_tensor(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir, CPU)
    vocab = model.config.vocab_size
    mb = MicroBatch.of(make_batch(3, 4, seed=3), ROWS, True)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_shapes(fn) -> list[torch.Size]:
        """Shapes of the activations autograd saves (the weights themselves aside)."""
        shapes: list[torch.Size] = []

        def pack(x: torch.Tensor) -> torch.Tensor:
            if x.untyped_storage().data_ptr() not in params:
                shapes.append(x.shape)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(model, mb, CPU, temperature=0.7, with_entropy=True)
        return shapes

    assert any(vocab in s for s in saved_shapes(logits_policy_forward))  # the logits' path does
    assert not any(vocab in s for s in saved_shapes(policy_log_probs))


def test_models_that_change_logits_after_the_head(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir, CPU)
    mb = MicroBatch.of(make_batch(2, 4, seed=1), [0, 3, 6], True)
    want = logits_policy_forward(model, mb, CPU, temperature=0.7)[0]
    model.config.final_logit_softcapping = 30.0  # as Gemma 2: the logits path is taken
    assert logprobs.fused_head(model) is None
    torch.testing.assert_close(policy_log_probs(model, mb, CPU, temperature=0.7)[0], want)
    model.config.final_logit_softcapping = None
    assert logprobs.fused_head(model) is model.lm_head

    def scale_logits(module, args, output):
        output.logits = output.logits * 2.0  # an undeclared post-processing step
        return output

    hook = model.register_forward_hook(scale_logits)
    with pytest.raises(RuntimeError, match="changes its LM head's output"):
        head_log_probs(model, torch.zeros(1, 3, dtype=torch.long),
                       input_ids=torch.ones(1, 3, dtype=torch.long))
    hook.remove()


class FakeLiger:
    """liger's LigerFusedLinearScaledCrossEntropyFunction contract: per-token NLL [M] (and
    entropy [M]) of hidden [M, H] @ weight.T / temperature, computed here by algos."""

    calls = 0

    @staticmethod
    def apply(hidden, weight, target, temperature, ignore_index, m_tiles, return_entropy):
        FakeLiger.calls += 1
        assert hidden.ndim == 2 and target.ndim == 1 and ignore_index == -100 and m_tiles == 1
        lp, ent = algos.chunked_log_probs(hidden, target, weight, temperature=temperature,
                                          with_entropy=return_entropy, entropy_grad=True)
        return (-lp, ent.bfloat16()) if return_entropy else -lp


def test_backend_choice_adapts_liger_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, weight = torch.randn(2, 5, 8), torch.randn(50, 8)
    labels = torch.randint(0, 50, (2, 5))
    want = algos.chunked_log_probs(hidden, labels, weight, temperature=0.7, with_entropy=True)
    monkeypatch.setattr(logprobs, "_BACKENDS", {"cpu": FakeLiger})
    log_probs, entropy = token_log_probs(hidden, weight, labels, temperature=0.7,
                                         with_entropy=True)
    assert FakeLiger.calls == 1 and entropy is not None and entropy.dtype == torch.float32
    torch.testing.assert_close(log_probs, want[0])
    torch.testing.assert_close(entropy, want[1], atol=0.05, rtol=0.01)  # liger's entropy is bf16

    class Unusable:
        @staticmethod
        def apply(*args):
            raise ImportError("no cutedsl")

    monkeypatch.setattr(logprobs, "_BACKENDS", {"cpu": Unusable})
    torch.testing.assert_close(token_log_probs(hidden, weight, labels, temperature=0.7)[0],
                               want[0])
    assert logprobs._BACKENDS == {"cpu": None}  # decided once
    monkeypatch.setattr(logprobs, "_BACKENDS", {})
    assert logprobs._liger("cpu") is None  # never on CPU


def peak_live_bytes(fn) -> int:
    """The most bytes ``fn``'s new tensors held at once (the profiler's CPU allocation events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_log_probs_backward_holds_one_chunk(monkeypatch: pytest.MonkeyPatch,
                                                  dtype: torch.dtype) -> None:
    T, H, V, rows = 256, 64, 8192, 32
    chunk = rows * V * 4  # one chunk's fp32 logits
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(logprobs, "MIN_CHUNK_ROWS", rows)
    torch.manual_seed(0)
    hidden = torch.randn(T, H, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H) / H).to(dtype).requires_grad_()  # logits of order 1, as trained
    labels = torch.randint(0, V, (T,))
    log_probs, _ = token_log_probs(hidden, weight, labels, temperature=0.7, with_entropy=True)
    # The gradients (a bf16 head's summed in fp32 first), then one chunk at a time: its logits
    # become its gradient in place, and a bf16 head's [V, H] product is formed a slice at a time.
    grads = hidden.nbytes + weight.nbytes + (weight.numel() * 4 if dtype != torch.float32 else 0)
    assert peak_live_bytes(log_probs.sum().backward) <= grads + chunk + chunk // 4
    got = [hidden.grad, weight.grad]
    ref_hidden, ref_weight = (t.detach().float().requires_grad_() for t in (hidden, weight))
    token_log_probs(ref_hidden, ref_weight, labels, temperature=0.7)[0].sum().backward()
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05,
                                                                              "rtol": 0.02}
    for a, b in zip(got, [ref_hidden.grad, ref_weight.grad]):
        torch.testing.assert_close(a.float(), b, **tolerance)


def test_token_log_probs_backward_adds_into_a_gradient_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A later micro-batch: the head's gradient is added into the one accumulating (what
    ``weight_grad_into`` gives), with no [V, H] buffer of its own and none left for autograd."""
    T, H, V, rows = 256, 64, 8192, 32
    chunk = rows * V * 4
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(logprobs, "MIN_CHUNK_ROWS", rows)
    torch.manual_seed(0)
    hidden = torch.randn(T, H).requires_grad_()
    weight = (torch.randn(V, H) / H).requires_grad_()
    labels = torch.randint(0, V, (T,))
    earlier = torch.randn(V, H)
    accumulating = earlier.clone()
    log_probs, _ = token_log_probs(hidden, weight, labels, temperature=0.7,
                                   weight_grad_into=lambda: accumulating)
    assert peak_live_bytes(log_probs.sum().backward) <= hidden.nbytes + chunk + chunk // 4
    assert weight.grad is None
    ref_hidden, ref_weight = (t.detach().requires_grad_() for t in (hidden, weight))
    token_log_probs(ref_hidden, ref_weight, labels, temperature=0.7)[0].sum().backward()
    torch.testing.assert_close(accumulating, earlier + ref_weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad)
