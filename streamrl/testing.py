"""Offline tiny tokenizer and tiny Qwen2 model, for tests, examples and the embedded defaults.

No model hub is reachable here, so ``build_tiny_model`` trains a byte-level BPE tokenizer on
generated text (digits always stay single tokens, which the toy tasks rely on), wraps it in a
``PreTrainedTokenizerFast`` with eos/pad and a chat template, builds a randomly initialised
``Qwen2ForCausalLM`` and saves both with ``save_pretrained``. The result loads offline in
transformers and in vLLM. Also exposed as ``streamrl data tiny-model --out DIR``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
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


def default_tiny_model_dir() -> Path:
    """Where ``model.path=tiny`` builds its model (overridable with STREAMRL_TINY_MODEL)."""
    env = os.environ.get("STREAMRL_TINY_MODEL")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamrl" / "tiny"


def resolve_model_path(path: str) -> str:
    """``tiny`` means the offline tiny model (built on first use); anything else is as given."""
    if path == "tiny":
        return str(build_tiny_model(default_tiny_model_dir()))
    return path
