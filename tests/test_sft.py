"""``streamrl sft``: assistant-only loss masks, bad input, training, DCP resume, HF export, and
(by hand) GRPO after SFT against GRPO alone.

Everything runs the real parts on CPU: the tiny Qwen2 model and tokenizer, FSDP2 over gloo
(world size 1 in this process, 2 spawned), torch DCP, transformers for the exported model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.cli import main
from streamrl.data.parquet import load_parquet_source
from streamrl.data.sft import assistant_token_mask, load_sft_examples
from streamrl.data.sft_toy import toy_sft_rows, write_toy_sft
from streamrl.data.toy import toy_reward
from streamrl.errors import ConfigError
from streamrl.net import LOOPBACK, free_port
from streamrl.sft import load_sft_config, run_sft
from streamrl.sft.trainer import SFTTrainer, load_data

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "and 3?"},
    {"role": "assistant", "content": "4 ok"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _write(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---- masks -----------------------------------------------------------------------------------

def test_mask_covers_exactly_each_assistant_answer(tokenizer) -> None:
    ids, mask = assistant_token_mask(CONVERSATION, tokenizer)

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # The expected spans from the literal rendering, tokenized piece by piece: each answer's
    # tokens start after its "<|im_start|>assistant\n" header and end after "<|im_end|>\n".
    head0 = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
             "<|im_start|>assistant\n")
    turn0 = head0 + "2<|im_end|>\n"
    head1 = turn0 + "<|im_start|>user\nand 3?<|im_end|>\n<|im_start|>assistant\n"
    turn1 = head1 + "4 ok<|im_end|>\n"
    assert tokenizer.decode(ids) == turn1
    expected = [*range(length(head0), length(turn0)), *range(length(head1), length(turn1))]
    assert [i for i, m in enumerate(mask) if m] == expected
    assert len(mask) == len(ids) == length(turn1)
    assert tokenizer.decode([ids[i] for i in expected]) == "2<|im_end|>\n4 ok<|im_end|>\n"


def test_single_turn_columns_train_on_the_response(tokenizer, tmp_path: Path) -> None:
    file = _write(tmp_path / "pr.parquet", [{"prompt": "1+1=", "response": "2"}])
    [example] = load_sft_examples([file], tokenizer, max_length=64)
    answer = [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    assert tokenizer.decode(answer) == "2<|im_end|>\n"


def test_template_that_rewrites_history_names_file_and_row(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    # A header that counts the messages changes every earlier token when a turn is added.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{{ messages | length }} turns\n{% for m in messages %}"
                         "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    file = _write(tmp_path / "c.parquet", [{"messages": CONVERSATION}])
    with pytest.raises(ConfigError, match=r"c\.parquet' row 0: the chat template does not "
                                          r"render messages\[:2\]"):
        load_sft_examples([file], tok, max_length=256)


# ---- bad input -------------------------------------------------------------------------------

def test_bad_files_and_overrides_are_one_config_error_line(tokenizer, tmp_path: Path,
                                                           capsys) -> None:
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(ConfigError, match=r"nope\.parquet' does not exist"):
        load_sft_examples([missing], tokenizer, 64)
    no_column = _write(tmp_path / "q.parquet", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"q\.parquet' has neither a 'messages' column nor "
                                          r"'prompt' \+ 'response' columns \(has question, "
                                          r"answer\)"):
        load_sft_examples([no_column], tokenizer, 64)
    text_column = _write(tmp_path / "t.parquet", [{"messages": "hello"}])
    with pytest.raises(ConfigError, match=r"t\.parquet' column 'messages' is string, not a "
                                          r"list"):
        load_sft_examples([text_column], tokenizer, 64)
    no_answer = _write(tmp_path / "u.parquet", [{"messages": CONVERSATION[:2]}])
    with pytest.raises(ConfigError, match=r"no usable conversation in .*u\.parquet \(skipped: "
                                          r"\{'no assistant message': 1\}\)"):
        load_sft_examples([no_answer], tokenizer, 64)

    with pytest.raises(ConfigError, match=r"data\.train_file='x': no such sft config key: did "
                                          r"you mean data\.train_files\?"):
        load_sft_config(["data.train_file=x"])
    verl = load_sft_config(["data.train_files=[a]", "data.micro_batch_size_per_gpu=2",
                            "trainer.default_local_dir=/x"])
    assert (verl.data.micro_batch_size, verl.trainer.output_dir) == (2, "/x")
    with pytest.raises(ConfigError, match=r"data\.max_length='abc': Value 'abc'"):
        load_sft_config(["data.train_files=[a]", "data.max_length=abc"])
    with pytest.raises(ConfigError, match=r"must be a multiple of learner\.world_size=2"):
        load_sft_config(["data.train_files=[a]", "learner.world_size=2",
                         "data.train_batch_size=3"])

    # (A bad override fails before the CLI configures logging for the run, as a bad file's
    # error would fail after it: both print the same one line.)
    assert main(["sft", "data.train_files=[a]", "trainer.resume=latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("streamrl: config error: trainer.resume='latest': must be one of "
                   "['disable', 'auto']")


# ---- training --------------------------------------------------------------------------------

def _cfg(data: Path, out: Path, model: Path, *extra: str):
    return load_sft_config([
        f"data.train_files=[{data}]", f"model.path={model}", f"trainer.output_dir={out}",
        "trainer.total_steps=6", "data.train_batch_size=16", "data.micro_batch_size=4",
        "optim.lr=3e-3", *extra])


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# The curve of the test below (tiny model, seed 0; 64 toy conversations, 16 a step, lr 3e-3):
# a change here is numerical drift, or a change to the masks or the loss normalisation.
LOSS_BASELINE = [5.13228, 5.08296, 4.69682, 4.36582, 4.13195, 4.00012]


def test_loss_falls_resume_and_export_match(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_toy_sft(tmp_path / "toy.parquet", size=64)
    cfg = _cfg(data, tmp_path / "out", tiny_model_dir, "trainer.save_freq=3")
    losses: list[float] = []
    trainer = SFTTrainer(cfg, load_data(cfg), 0, 1, LOOPBACK, free_port())
    try:
        hf = trainer.fit(lambda step, metrics: losses.append(metrics["sft/loss"]))
        assert hf == tmp_path / "out" / "hf"
        assert losses[-1] < losses[0] - 0.5 and losses == sorted(losses, reverse=True), losses
        assert max(abs(a - b) for a, b in zip(losses, LOSS_BASELINE, strict=True)) < 1e-3, losses
        assert sorted(p.name for p in (tmp_path / "out").glob("global_step_*")) == [
            "global_step_3", "global_step_6"]

        ids = torch.tensor([trainer.examples[0].input_ids, trainer.examples[1].input_ids])
        trained = _logits(trainer.model, ids)
        exported = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        assert (_logits(exported, ids) - trained).abs().max() < 1e-4
        assert AutoTokenizer.from_pretrained(hf).chat_template  # the tokenizer came along

        # resume=auto picks up step 6 with the same weights (same process group).
        again = SFTTrainer(_cfg(data, tmp_path / "out", tiny_model_dir, "trainer.resume=auto"),
                           load_data(cfg), 0, 1, LOOPBACK, free_port())
        assert again.resume() == tmp_path / "out" / "global_step_6" and again.step == 6
        assert (_logits(again.model, ids) - trained).abs().max() < 1e-6
    finally:
        trainer.shutdown()


def test_two_ranks_train_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """World size 2 (spawned ranks, gloo) gives the losses of world size 1: each rank takes
    half of every batch and the loss is normalised by the global token count."""
    data = write_toy_sft(tmp_path / "toy.parquet", size=64)
    curves = []
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        run_sft(_cfg(data, out, tiny_model_dir, f"learner.world_size={world}"))
        lines = (out / "metrics.jsonl").read_text().splitlines()
        curves.append([json.loads(line)["sft/loss"] for line in lines])
        assert (out / "hf" / "model.safetensors").is_file()
    assert len(curves[0]) == 6
    assert max(abs(a - b) for a, b in zip(*curves, strict=True)) < 1e-5, curves


def test_toy_sft_file_answers_score_one_and_serve_rl(tokenizer, tmp_path: Path) -> None:
    rows = toy_sft_rows("rep", size=20, seed=3)
    for row in rows:
        answer = row["messages"][-1]["content"]
        assert toy_reward("rep", answer, row["reward_model"]["ground_truth"]) == 1.0
    path = write_toy_sft(tmp_path / "toy.parquet", size=20, seed=3)
    # The same file is a task.source=parquet RL file whose prompts are SFT's prefixes.
    prompts = load_parquet_source([str(path)], tokenizer, max_prompt_length=64)
    [example, *_] = load_sft_examples([str(path)], tokenizer, 64)
    first = example.loss_mask.index(1)
    assert example.input_ids[:first] == prompts[0].prompt_ids
    assert prompts[0].data_source == "toy/rep"


# ---- by hand: the warm start pays off --------------------------------------------------------

GRPO = ["task.source=parquet", "runtime.num_cpus=2", "trainer.logger=[jsonl]",
        "task.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.total_steps=20"]


@pytest.mark.manual
@pytest.mark.vllm
def test_grpo_after_sft_beats_grpo_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two 20-step GRPO runs (~25 s each here) on the chat-format toy task: from the tiny
    random model, and from it after 20 SFT steps (~3 s). Manual: two full training runs.

    Measured (2 cores, fully_async, lr 1e-3; 100 s in all): SFT loss 5.15 -> 1.15; GRPO after
    SFT reward 0.068 -> 0.647 (mean of the last 5 steps 0.56); GRPO alone 0.002 -> 0.008 (0.006).
    An earlier run of the same commands: 0.077 -> 0.725 against 0.003 -> 0.008.
    """
    from streamrl.config import load_config
    from streamrl.controller import run_training

    data = write_toy_sft(tmp_path / "toy.parquet", size=256)
    hf = run_sft(load_sft_config([
        f"data.train_files=[{data}]", f"model.path={tiny_model_dir}", "optim.lr=3e-3",
        f"trainer.output_dir={tmp_path / 'sft'}", "trainer.total_steps=20"]))
    last5 = {}
    for name, model in (("alone", tiny_model_dir), ("after_sft", hf)):
        cfg = load_config([*GRPO, f"task.train_files=[{data}]", f"model.path={model}",
                           f"trainer.output_dir={tmp_path / name}"])
        rewards = [h["reward/mean"] for h in run_training(cfg).history]
        last5[name] = sum(rewards[-5:]) / 5
        print(name, [round(r, 3) for r in rewards])
    assert last5["after_sft"] > last5["alone"] + 0.3, last5
