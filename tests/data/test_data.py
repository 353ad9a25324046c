"""Prompt sources (verl parquet with good and bad rows, reasoning-gym, the toy task) and the
deterministic, resumable PromptStream."""

from __future__ import annotations

import logging
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config import ConfigError, TaskConfig
from streamrl.data import PromptStream, make_prompt_source
from streamrl.data.base import ListPromptSource, Prompt
from streamrl.data.toy import cross_reward, digit_token_ids, toy_reward


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _row(content, truth, source="openai/gsm8k", extra=None):
    return {
        "data_source": source,
        "prompt": None if content is None else [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra if extra is not None else {"split": "train", "index": 0},
    }


def test_parquet_loads_good_rows_and_skips_bad_ones(tmp_path, tokenizer, caplog):
    rows = [
        _row("What is 2 + 3?", "5", extra={"split": "train", "index": 7}),
        _row(None, "1"),                                # missing prompt
        _row("the " * 200, "1"),                        # longer than max_prompt_length
        _row("What is 1 + 1?", None),                   # missing ground truth
        _row("What is 4 + 4?", "8", source="lighteval/MATH"),
    ]
    bad_type = _row("What is 9 + 9?", "18")
    table = pa.Table.from_pylist(rows)
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    # a non-string ground truth needs its own file: a parquet column has one type
    bad_path = tmp_path / "int_truth.parquet"
    bad_type["reward_model"] = {"style": "rule", "ground_truth": 18}
    pq.write_table(pa.Table.from_pylist([bad_type]), bad_path)

    cfg = TaskConfig(source="parquet", train_files=(str(path), str(bad_path)),
                     max_prompt_length=64)
    with caplog.at_level(logging.WARNING):
        source = make_prompt_source(cfg, tokenizer, "train")
    assert len(source) == 2
    first = source[0]
    text = tokenizer.apply_chat_template(first.messages, add_generation_prompt=True,
                                         tokenize=False)
    assert first.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(first.prompt_ids).endswith("<|im_start|>assistant\n")
    assert (first.index, first.data_source, first.ground_truth) == (0, "openai/gsm8k", "5")
    assert first.extra == {"split": "train", "index": 7}
    assert source[1].data_source == "lighteval/MATH"
    assert source.skipped == {
        "missing prompt": 1, "prompt longer than max_prompt_length": 1,
        "missing reward_model.ground_truth": 1, "non-string reward_model.ground_truth": 1,
    }
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{path} row 2: prompt longer than max_prompt_length" in m for m in logged)
    assert any(f"{bad_path} row 0: non-string" in m for m in logged)
    # no val files: an empty validation source, not an error
    assert len(make_prompt_source(cfg, tokenizer, "val")) == 0


def test_parquet_without_usable_rows_is_a_clear_error(tmp_path, tokenizer):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([_row(None, "1")]), path)
    cfg = TaskConfig(source="parquet", train_files=(str(path),))
    with pytest.raises(ValueError, match="no usable training prompt"):
        make_prompt_source(cfg, tokenizer, "train")
    missing = TaskConfig(source="parquet", train_files=(str(tmp_path / "nope.parquet"),))
    with pytest.raises(ConfigError, match=r"task.train_files: .*nope\.parquet"):
        make_prompt_source(missing, tokenizer, "train")


def test_reasoning_gym_source(tokenizer):
    cfg = TaskConfig(source="reasoning_gym", name="gsm_symbolic,basic_arithmetic,chain_sum",
                     size=7, val_size=3, max_prompt_length=512, seed=5)
    source = make_prompt_source(cfg, tokenizer, "train")
    assert len(source) == 7
    assert {p.data_source for p in source} == {
        "reasoning_gym/gsm_symbolic", "reasoning_gym/basic_arithmetic", "reasoning_gym/chain_sum"}
    for p in source:
        assert p.ground_truth == p.extra["entry"]["answer"]
        assert p.messages[0]["content"].endswith('after "####".')
    again = make_prompt_source(cfg, tokenizer, "train")
    assert [p.prompt_ids for p in again] == [p.prompt_ids for p in source]  # seeded
    val = make_prompt_source(cfg, tokenizer, "val")
    assert len(val) == 3
    assert val[0].prompt_ids != source[0].prompt_ids
    import msgspec  # the entry rides in Trajectory.extra: it must be msgpack-encodable

    msgspec.msgpack.encode([p.extra for p in source])
    # short max_prompt_length: everything skipped, counted, and the train split refuses
    short = TaskConfig(source="reasoning_gym", name="basic_arithmetic", size=2,
                       max_prompt_length=3)
    with pytest.raises(ValueError, match="prompt longer than max_prompt_length"):
        make_prompt_source(short, tokenizer, "train")


def test_validation_sets_are_bounded_by_val_size(tokenizer, tmp_path):
    """task.val_size bounds every validation set (a validation pass answers each prompt);
    0 means none, for every source."""
    from streamrl.data.gsm8k_files import write_gsm8k

    files = write_gsm8k(tmp_path, train_size=6, test_size=5)
    parquet = TaskConfig(source="parquet", train_files=(str(files / "train.parquet"),),
                         val_files=(str(files / "test.parquet"),), max_prompt_length=512)
    assert len(make_prompt_source(parquet, tokenizer, "val")) == 5
    capped = TaskConfig(**{**parquet.__dict__, "val_size": 3})
    val = make_prompt_source(capped, tokenizer, "val")
    assert len(val) == 3
    whole = make_prompt_source(parquet, tokenizer, "val")
    assert [p.prompt_ids for p in val] == [whole[i].prompt_ids for i in range(3)]
    for source in ("toy", "reasoning_gym", "parquet"):
        none = TaskConfig(**{**parquet.__dict__, "source": source, "val_size": 0,
                             "name": "rep" if source == "toy" else "basic_arithmetic"})
        assert len(make_prompt_source(none, tokenizer, "val")) == 0


def test_toy_source_and_rewards(tokenizer):
    cfg = TaskConfig(source="toy", name="rep", size=50, seed=1)
    source = make_prompt_source(cfg, tokenizer, "train")
    digits = digit_token_ids(tokenizer)
    eq = tokenizer("=", add_special_tokens=False)["input_ids"]
    assert len(source) == 50
    assert len({p.ground_truth for p in source}) > 5
    for p in source:
        d = int(p.ground_truth)
        assert p.prompt_ids == [digits[d], *eq]
        assert tokenizer.decode(p.prompt_ids) == f"{d}="
        assert p.data_source == "toy/rep" and p.messages is None
    assert toy_reward("rep", "77777777", "7") == 1.0
    assert toy_reward("rep", "7a7b", "7", max_new_tokens=4) == 0.5
    assert toy_reward("copy1", "7", "7") == 1.0
    assert cross_reward("rep", "77777777", "7") == 0.0          # scored against "8"
    assert cross_reward("rep", "88888888", "7") == 1.0
    assert cross_reward("copy1", "9", "7", shift=2) == 1.0
    with pytest.raises(ValueError, match="toy task must be one of"):
        make_prompt_source(TaskConfig(source="toy", name="add"), tokenizer, "train")


def test_toy_long_tail_budgets_a_share_of_training_prompts_only(tokenizer):
    plain = make_prompt_source(TaskConfig(source="toy", size=400, seed=3), tokenizer, "train")
    cfg = TaskConfig(source="toy", size=400, seed=3, long_tail=0.25, long_tail_tokens=64)
    tail = make_prompt_source(cfg, tokenizer, "train")
    budgets = [p.extra.get("max_new_tokens") for p in tail]
    assert set(budgets) == {None, 64} and 70 < budgets.count(64) < 130
    # the digits stay those of the plain task, so the variants differ only in budgets
    assert [p.ground_truth for p in tail] == [p.ground_truth for p in plain]
    # rep counts over the prompt's own budget (the replica passes extra_info on)
    assert toy_reward("rep", "7" * 8, "7", max_new_tokens=64) == 0.125
    assert all("max_new_tokens" not in p.extra for p in make_prompt_source(cfg, tokenizer, "val"))


def _source(n: int) -> ListPromptSource:
    return ListPromptSource([Prompt(i, [i], "t", None, {}) for i in range(n)])


def test_prompt_stream_is_deterministic_and_resumes_from_cursor():
    source = _source(10)
    a = [p.index for p in PromptStream(source, shuffle=True, seed=3).take(35)]
    b = [p.index for p in PromptStream(source, shuffle=True, seed=3).take(35)]
    assert a == b
    for epoch in range(3):  # each epoch is a permutation, reshuffled per epoch
        assert sorted(a[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert a[:10] != a[10:20]
    assert a != [p.index for p in PromptStream(source, shuffle=True, seed=4).take(35)]
    assert [p.index for p in PromptStream(source, shuffle=False, seed=3).take(12)] == [
        *range(10), 0, 1]

    stream = PromptStream(source, shuffle=True, seed=3)
    stream.take(17)
    saved = stream.cursor
    assert saved == 17 and stream.epoch == 1
    resumed = PromptStream(source, shuffle=True, seed=3, cursor=saved)
    assert [p.index for p in resumed.take(18)] == a[17:35]


def test_prompt_stream_is_thread_safe():
    stream = PromptStream(_source(50), shuffle=True, seed=0)
    seen: list[int] = []
    lock = threading.Lock()

    def worker():
        for _ in range(25):
            p = stream.next()
            with lock:
                seen.append(p.index)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stream.cursor == 100
    assert sorted(seen) == sorted(list(range(50)) * 2)  # two full epochs, nothing lost
    with pytest.raises(ValueError, match="empty"):
        PromptStream(_source(0), shuffle=True, seed=0)
