"""Offline tiny tokenizer and tiny Qwen2 model, for tests, examples and the embedded defaults.

No model hub is reachable here, so ``build_tiny_model`` trains a byte-level BPE tokenizer on
generated text (digits always stay single tokens, which the toy tasks rely on), wraps it in a
``PreTrainedTokenizerFast`` with eos/pad and a chat template, builds a randomly initialised
``Qwen2ForCausalLM`` and saves both with ``save_pretrained``. The result loads offline in
transformers and in vLLM. Also exposed as ``streamrl data tiny-model --out DIR``.

Also what tests and benchmarks share: the one Group/Trajectory factory (``make_trajectory``,
``make_group`` with chosen versions, ``random_groups`` with ragged random tokens),
``redis_server`` (a real redis-server on a free loopback port), ``CountingEngine`` (a real
engine counting the tokens it samples), ``ResidentMemory`` (this process's resident set and its
high-water mark, Linux), ``result_line`` (the ``RESULT`` line every benchmark ends with) and
``SMOLLM2_REP`` (the LoRA learning runs' task, in ``benchmarks/lora.py`` and its test).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from streamrl.types import OBSERVATION_VERSION, Group, Trajectory

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen-style: plain messages render as before; ``tools=`` adds a system block listing their
# schemas, assistant ``tool_calls`` render as <tool_call> blocks, consecutive ``tool`` messages
# as one user turn of <tool_response> blocks, and assistant history drops its <think> block (as
# Qwen3 does: what re-rendering agent loops get wrong, and streamrl's never re-renders).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nCall a function with <tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] or '' %}"
    "{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>assistant\n' + content }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{ (fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the", "a", "model", "answer", "question", "number", "sum", "add", "plus", "minus",
    "times", "equals", "result", "step", "think", "tool", "call", "observation", "user",
    "assistant", "system", "reward", "is", "of", "to", "and", "what", "how", "many", "total",
    "compute", "value", "left", "right", "first", "second", "apple", "orange", "has", "gives",
    "takes", "each", "more", "less",
)


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        numbers = f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = {rng.randint(0, 1998)}"
        out.append(" ".join(words) + " " + numbers + " #### " + str(rng.randint(0, 99)))
    return out


def build_tiny_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int = 320, seed: int = 0):
    """Train and save a byte-level BPE tokenizer; returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 320,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a random tiny Qwen2 model + tokenizer in ``out_dir``; returns the path.

    head_dim = hidden_size / num_heads is 32 by default: vLLM's CPU attention kernels support
    head sizes from 32 up, and two heads of 32 learn the toy tasks as fast as four of 16.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    marker = out / "streamrl_tiny.json"
    spec = {
        "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
        "intermediate_size": intermediate_size, "vocab_size": vocab_size, "seed": seed,
        # A cached model rebuilds when the chat template changes (same seed: same weights).
        "chat_template": hashlib.sha1(CHAT_TEMPLATE.encode()).hexdigest()[:12],
    }
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out, vocab_size=vocab_size, seed=seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out


def make_trajectory(uid: str = "t0", group_id: str = "g0", n: int = 3, **fields: Any
                    ) -> Trajectory:
    """A valid trajectory of ``n`` policy tokens stamped version 4; ``fields`` override any."""
    values: dict[str, Any] = {
        "prompt_ids": [5, 6], "response_ids": list(range(10, 10 + n)), "loss_mask": [1] * n,
        "logprobs": [-0.5] * n, "versions": [4] * n,
    }
    values.update(fields)
    return Trajectory(uid=uid, group_id=group_id, **values)


def make_group(
    versions: list[int] | int, group_id: str | None = None, n: int = 2, obs_tokens: int = 1,
    *, prompt_len: int = 3,
) -> Group:
    """A group of ``n`` trajectories whose policy tokens carry ``versions``, followed by
    ``obs_tokens`` observation tokens; trajectory i has reward i."""
    versions = [versions] if isinstance(versions, int) else list(versions)
    gid = group_id or uuid.uuid4().hex
    stamps = versions + [OBSERVATION_VERSION] * obs_tokens
    return Group(group_id=gid, trajectories=[
        make_trajectory(
            f"{gid}-{i}", gid, len(stamps), prompt_ids=list(range(1, 1 + prompt_len)),
            loss_mask=[1] * len(versions) + [0] * obs_tokens, versions=stamps, reward=float(i),
        )
        for i in range(n)
    ])


def random_groups(
    num_groups: int, n: int, *, seed: int = 0, vocab: int = 300, observation: bool = True
) -> list[Group]:
    """Random groups with ragged prompt/response lengths and a few interior observation tokens."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        gid = f"g{seed}-{g}"
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        trajs = []
        for i in range(n):
            r = rng.randint(2, 14)
            mask = [1] * r
            if observation and r > 6 and i % 2:
                mask[2:4] = [0, 0]  # an interior tool observation
            trajs.append(make_trajectory(
                f"{gid}-{i}", gid, r, prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(r)], loss_mask=mask,
                logprobs=[-rng.uniform(4.0, 7.0) if m else 0.0 for m in mask],
                versions=[0 if m else OBSERVATION_VERSION for m in mask], reward=rng.random(),
            ))
        groups.append(Group(group_id=gid, trajectories=trajs))
    return groups


@contextlib.contextmanager
def redis_server(workdir: str | os.PathLike[str]) -> Iterator[str]:
    """A real redis-server (append-only, data in ``workdir``) on a free loopback port; yields
    its URL and shuts it down afterwards."""
    import redis

    from streamrl.net import free_port

    server = shutil.which("redis-server")
    if server is None:
        raise FileNotFoundError("redis-server is not installed: run scripts/setup.sh "
                                "(apt-get install -y redis-server)")
    port = free_port()
    subprocess.run([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "yes", "--dir", str(workdir), "--daemonize", "yes",
                    "--logfile", f"{workdir}/redis.log"], check=True)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {port} did not answer within 10 s "
                                   f"(log: {workdir}/redis.log)") from None
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        with contextlib.suppress(redis.ConnectionError):  # shutdown drops its own connection
            client.shutdown(nosave=True)


class CountingEngine:
    """A real rollout engine, counting every token it samples (aborted returns included): what
    tests and benchmarks of resumed partials compare with the tokens kept."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.sampled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        out = await self._engine.generate(prompt_ids, params, request_id)
        self.sampled += sum(len(c.token_ids) for c in out)
        return out


class ResidentMemory:
    """This process's resident memory from now on (Linux): the kernel's high-water mark (VmHWM)
    is reset to the current resident set (``/proc/self/clear_refs`` 5), the baseline."""

    def __init__(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")
        self.base_mib = _status_mib("VmRSS")

    def peak_mib(self) -> float:
        """The resident set's high-water mark since the baseline, MiB."""
        return _status_mib("VmHWM")

    def extra_mib(self) -> tuple[float, float]:
        """MiB above the baseline: at the peak since, and now."""
        return self.peak_mib() - self.base_mib, _status_mib("VmRSS") - self.base_mib


def _status_mib(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB$", status, re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(match.group(1)) / 1024


SMOLLM2_REP = ("model=smollm2-135m", "task=toy", "task.name=rep", "rollout.max_new_tokens=2",
               "actor.entropy_coeff=0.03", "model.gradient_checkpointing=false")
"""The toy task (``d=`` -> ``dd``) on SmolLM2, 2 tokens (a step ~6 s here, 19 s at 8). Without
the entropy bonus the policy collapsed onto one answer for every prompt within ~10 steps
(entropy 4.0 -> 0.06; reward ~0.1, where GRPO's groups stop differing); at 0.01 fully_async
still collapsed, at 0.03 neither mode did: docs/lora.md."""


def result_line(name: str, value: float, op: str, goal: float, met: bool | None = None,
                digits: int = 2) -> str:
    """A benchmark's goal line: ``RESULT <name> value=<x> goal=<op><y> met=yes|no``; ``met``
    defaults to comparing ``value`` with ``goal`` (op ``>=`` or ``<=``)."""
    if op not in (">=", "<="):
        raise ValueError(f"result_line: op={op!r}: must be '>=' or '<='")
    if met is None:
        met = value >= goal if op == ">=" else value <= goal
    return f"RESULT {name} value={value:.{digits}f} goal={op}{goal:g} met={'yes' if met else 'no'}"
