"""Weight-bus test support: state dicts, digests, and the targets of spawned processes.

``receiver_main`` and ``engine_main`` run in ``spawn``-ed processes, which import them by module
name: this module must stay importable as ``tests.support.weights`` (no pytest-only imports).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch


def make_state(seed: int, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small mixed-dtype state dict (float32, bfloat16, int64, a 0-dim and an empty tensor)."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        f"layers.{i}.weight": torch.randn(64 * scale, 48, generator=gen) for i in range(6)
    }
    state["embed.weight"] = torch.randn(300 * scale, 64, generator=gen).to(torch.bfloat16)
    state["norm.bias"] = torch.randn(7, generator=gen).to(torch.bfloat16)
    state["step"] = torch.tensor(seed, dtype=torch.int64)
    state["empty"] = torch.empty(0, 3)
    return state


def digest(named: Any) -> dict[str, str]:
    out = {}
    for name, tensor in named:
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()}"
    return out


def receiver_main(endpoint: str, receiver_id: str, timeout_s: float, reports: Any,
                  unstuck: Any = None, receive: str = "staged") -> None:
    """A spawned receiver process: reports (id, pid, version, digest) for each loaded version.
    With ``unstuck`` (an mp.Event) its loading hangs until the event is set, as an engine that
    hangs would: heartbeats go on, announcements are not taken. ``receive``: the receiver's
    mode (``streamed``: the digest hashes each weight as it is received)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from streamrl.weight_bus.collective import CollectiveReceiver

    def sink(weights: Any, version: int) -> None:
        if unstuck is not None:
            unstuck.wait()
        reports.put((receiver_id, os.getpid(), version, digest(weights)))

    receiver = CollectiveReceiver(endpoint, sink, receiver_id=receiver_id, timeout_s=timeout_s,
                                  receive=receive)
    reports.put((receiver_id, os.getpid(), "ready", {}))
    time.sleep(300)  # the test terminates this process (an mp.Event would not survive SIGKILL)
    receiver.close()


def killing(named: dict[str, torch.Tensor], after: int, pid: int) -> Iterator[tuple[str, Any]]:
    """Yield ``named``; SIGKILL ``pid`` after ``after`` tensors (i.e. mid-broadcast)."""
    for i, item in enumerate(named.items()):
        if i == after:
            os.kill(pid, signal.SIGKILL)
        yield item


PROMPT = [25, 31, 25, 31, 9, 14]


def second_model(model_dir: str, seed: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Weights of another random model with the tiny model's config, and its HF greedy output."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                             pad_token_id=config.pad_token_id)
    return model.state_dict(), out[0, len(PROMPT):].tolist()


def engine_main(model_dir: str, endpoint: str, timeout_s: float, commands: Any,
                replies: Any, receive: str = "staged") -> None:
    """A spawned replica process: a VLLMEngine fed by a VLLMReceiver (``receive``: its mode),
    driven by commands."""
    import asyncio

    os.environ.update({"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from streamrl.config import RolloutConfig
    from streamrl.rollout_fleet.engine import SamplingParams
    from streamrl.rollout_fleet.vllm_engine import VLLMEngine
    from streamrl.weight_bus.vllm_receiver import VLLMReceiver

    async def main() -> None:
        engine = VLLMEngine(model_dir, RolloutConfig(max_model_len=256))
        receiver = VLLMReceiver(endpoint, engine, receiver_id="vllm", timeout_s=timeout_s,
                                receive=receive)
        loop = asyncio.get_running_loop()
        replies.put(("ready", engine.version))
        while True:
            cmd, arg = await loop.run_in_executor(None, commands.get)
            if cmd == "stop":
                break
            if cmd == "wait_version":
                ok = await loop.run_in_executor(None, receiver.wait_version, arg, 120)
                replies.put(("version", ok, engine.version))
            elif cmd == "generate":  # arg: a tag, or (tag, seconds to give up after)
                tag, within = arg if isinstance(arg, tuple) else (arg, None)
                params = SamplingParams(temperature=0.0, max_tokens=8)
                try:
                    [done] = await asyncio.wait_for(
                        engine.generate(PROMPT, params, f"greedy-{tag}"), within)
                except asyncio.TimeoutError:  # an engine that stays paused
                    replies.put(("tokens", None, None))
                    continue
                replies.put(("tokens", done.token_ids, done.versions))
            elif cmd == "sample":  # arg: (n, max_tokens); temperature 1, with log-probs
                n, max_tokens = arg
                params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
                done = await engine.generate(PROMPT, params, f"sample-{engine.version}")
                replies.put(("samples", [(c.token_ids, c.logprobs, c.versions) for c in done]))
        await receiver.aclose()
        await engine.close()

    asyncio.run(main())
