"""The offline tiny model: builds without a hub, loads in transformers and in real vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.cli import main


def test_tokenizer_keeps_digits_single_and_has_chat_template(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("7=1234", add_special_tokens=False)
    assert len(ids) == 6  # one token per digit and one for "="
    assert tok.decode(ids) == "7=1234"
    assert tok.eos_token_id is not None and tok.pad_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_transformers_generates(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([tok.encode("7=", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)


def test_cli_builds_model_and_is_reused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    assert main(["data", "tiny-model", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    spec = json.loads((out / "streamrl_tiny.json").read_text())
    assert spec["hidden_size"] == 64
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["data", "tiny-model", "--out", str(out)]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # same spec: not rebuilt


def test_real_vllm_generates_from_tiny_model(tiny_model_dir: Path) -> None:
    # A subprocess keeps this engine's memory out of the other test modules' processes.
    script = f"""
from vllm import LLM, SamplingParams
llm = LLM({str(tiny_model_dir)!r}, enforce_eager=True, max_model_len=256, dtype="float32", seed=0)
out = llm.generate({{"prompt_token_ids": [25, 31]}},
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))
completion = out[0].outputs[0]
print("TOKENS", list(completion.token_ids), len(completion.logprobs))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS"))
    tokens = json.loads(line.split(" ", 1)[1].rsplit(" ", 1)[0])
    assert len(tokens) == 6 and line.endswith(" 6")
    # Greedy vLLM agrees with greedy transformers on the same weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref = model.generate(torch.tensor([[25, 31]]), max_new_tokens=6, do_sample=False,
                         min_new_tokens=6)
    assert tokens == ref[0, 2:].tolist()
