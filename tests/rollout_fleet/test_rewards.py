"""Reward scorers on hand-written examples, and the process pool's failure handling (real
worker processes: raising, hanging, NaN-returning and dict-returning custom functions, alone
and inside a burst of calls that one worker call scores)."""

from __future__ import annotations

import asyncio
import logging
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from streamrl.config import RewardConfig
from streamrl.rollout_fleet.rewards import (
    RewardConfigError,
    ScorerSpec,
    compute_score,
    gsm8k,
    make_reward_scorer,
    math_answer,
    rgym,
    scorer_for,
)

# -- scorers, called directly ---------------------------------------------------------------


def test_gsm8k_strict_and_flexible_extraction():
    text = "Half of 10 is 5, plus 37 gives 42.\n#### 42"
    assert gsm8k.extract_solution(text, "strict") == "42"
    assert gsm8k.extract_solution("#### 1,234 then #### 7", "strict") == "7"
    assert gsm8k.extract_solution("#### -3", "strict") == "-3"
    assert gsm8k.extract_solution("the answer is 12.", "strict") is None
    assert gsm8k.extract_solution("the answer is 12.", "flexible") == "12."
    assert gsm8k.extract_solution("first 3 then 1,500 .", "flexible") == "1,500"
    assert gsm8k.compute_score(text, "42") == 1.0
    assert gsm8k.compute_score("#### 41", "42") == 0.0
    assert gsm8k.compute_score("42", "42") == 0.0  # strict: no #### means no answer
    assert gsm8k.compute_score("#### $1,000", "1000") == 0.0  # $ before the number: no match
    assert gsm8k.compute_score("#### 1,000", "1000") == 1.0
    # only the last 300 characters are searched
    assert gsm8k.extract_solution("#### 5" + " x" * 200, "strict") is None


def test_math_verify_equivalent_forms():
    assert math_answer.compute_score("so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math_answer.compute_score("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math_answer.compute_score("\\boxed{3}", "4") == 0.0
    assert math_answer.compute_score("no answer here", "4") == 0.0


def test_reasoning_gym_scores_with_entry():
    import reasoning_gym

    entry = dict(reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0])
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    source = "reasoning_gym/basic_arithmetic"
    assert rgym.compute_score(source, f"work... #### {right}", right, {"entry": entry}) == 1.0
    assert rgym.compute_score(source, f"<answer>{right}</answer>", right, {"entry": entry}) == 1.0
    assert rgym.compute_score(source, f"#### {wrong}", right, {"entry": entry}) == 0.0
    # without the entry, a minimal one built from the ground truth is graded
    assert rgym.compute_score(source, f"#### {right}", right, {}) == 1.0


def test_toy_scores_and_auto_dispatch():
    spec = ScorerSpec()
    assert compute_score(spec, "toy/rep", "7777", "7", {"max_new_tokens": 8}) == 0.5
    assert compute_score(spec, "toy/rep", "77777777", "7", {}) == 1.0
    assert compute_score(spec, "toy/copy1", "7abc", "7", {}) == 1.0
    assert compute_score(spec, "toy/copy1", "a7", "7", {}) == 0.0
    assert compute_score(spec, "openai/gsm8k", "#### 3", "3", {}) == 1.0
    assert compute_score(spec, "HuggingFaceH4/MATH-500", "\\boxed{0.5}", "\\frac12", {}) == 1.0
    assert scorer_for("auto", "reasoning_gym/chain_sum") == "reasoning_gym"
    assert scorer_for("gsm8k", "anything") == "gsm8k"
    with pytest.raises(ValueError, match="no scorer for data_source='unknown/ds'"):
        scorer_for("auto", "unknown/ds")


# -- the process pool -----------------------------------------------------------------------

CUSTOM = textwrap.dedent("""
    import math
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "raise":
            raise RuntimeError("boom")
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "nan":
            return math.nan
        if solution_str == "dict":
            return {"score": 0.75, "acc": 1.0, "label": "not a number"}
        return float(solution_str == ground_truth)
""")


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory):
    path = Path(tmp_path_factory.mktemp("reward")) / "my_reward.py"
    path.write_text(CUSTOM)
    cfg = RewardConfig(name="custom", custom_path=str(path), timeout_s=1.0, num_workers=1)
    s = make_reward_scorer(cfg)
    yield s
    s.close()


def _score(scorer, solution: str, truth: str = "x") -> float:
    return asyncio.run(scorer.score("my/ds", solution, truth, {}))


def test_custom_function_scores_and_counts_calls(scorer):
    before = scorer.metrics()["calls"]
    assert _score(scorer, "x") == 1.0
    assert _score(scorer, "y") == 0.0
    assert scorer.metrics()["calls"] == before + 2


def test_custom_exception_scores_zero_and_is_counted(scorer, caplog):
    before = scorer.metrics()["failures"]
    with caplog.at_level(logging.WARNING):
        assert _score(scorer, "raise") == 0.0
    assert scorer.metrics()["failures"] == before + 1
    if before == 0:
        assert any("RuntimeError: boom" in r.getMessage() for r in caplog.records)


def test_hang_times_out_fast_and_next_call_works(scorer):
    before = scorer.metrics()["timeouts"]
    start = time.monotonic()
    assert _score(scorer, "hang") == 0.0
    assert time.monotonic() - start < 2.5
    assert scorer.metrics()["timeouts"] == before + 1
    # the hung worker was replaced: later calls (even concurrent ones) still work
    assert _score(scorer, "x") == 1.0

    async def many():
        return await asyncio.gather(*(scorer.score("my/ds", "x", "x", {}) for _ in range(4)))

    assert asyncio.run(many()) == [1.0] * 4


def _burst(scorer, solutions: list[str]) -> list[float]:
    async def run():
        return await asyncio.gather(*(scorer.score("my/ds", s, "x", {}) for s in solutions))

    return asyncio.run(run())


def test_a_burst_of_calls_is_scored_in_one_worker_call(scorer, monkeypatch):
    from streamrl.rollout_fleet.rewards import dispatch

    batches: list[int] = []
    submit = ProcessPoolExecutor.submit

    def counting(self, fn, *args, **kwargs):
        if fn is dispatch.score_batch_in_worker:
            batches.append(len(args[1]))
        return submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", counting)
    assert _burst(scorer, ["x", "y"] * 4) == [1.0, 0.0] * 4
    assert batches == [8]


def test_a_hang_or_a_raise_in_a_burst_scores_only_that_response_zero(scorer):
    """The batch runs past timeout_s (the hang), so its responses are scored again one per
    call: the hang times out alone, the raise fails alone, the others keep their scores."""
    before = scorer.metrics()
    start = time.monotonic()
    assert _burst(scorer, ["x", "hang", "raise", "x", "y"]) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert time.monotonic() - start < 4.5  # the batch's timeout_s, then the hang's own
    after = scorer.metrics()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["failures"] == before["failures"] + 1
    assert _burst(scorer, ["x"] * 3) == [1.0] * 3  # the hung worker was replaced


def test_non_finite_scores_zero_and_is_counted(scorer):
    before = scorer.metrics()["non_finite"]
    assert _score(scorer, "nan") == 0.0
    assert scorer.metrics()["non_finite"] == before + 1


def test_dict_return_takes_score_and_reports_other_keys(scorer):
    score, extras = asyncio.run(scorer.score_with_info("my/ds", "dict", "x", {}))
    assert score == 0.75
    assert extras == {"acc": 1.0}
    assert scorer.metrics()["extra/acc"] == 1.0


def test_auto_pool_scores_builtin_sources():
    with make_reward_scorer(RewardConfig(name="auto", timeout_s=30.0)) as s:
        async def run():
            return await asyncio.gather(
                s.score("openai/gsm8k", "#### 12", "12", {}),
                s.score("toy/rep", "3333", "3", {"max_new_tokens": 4}),
                s.score("unknown/source", "x", "x", {}),
            )

        assert asyncio.run(run()) == [1.0, 1.0, 0.0]
        assert s.metrics()["failures"] == 1.0


def test_bad_custom_path_fails_at_construction(tmp_path):
    bad = tmp_path / "r.py"
    bad.write_text("def other(*a): return 1.0\n")
    cfg = RewardConfig(name="custom", custom_path=str(bad), custom_name="compute_score")
    with pytest.raises(RewardConfigError, match="compute_score"):
        make_reward_scorer(cfg)
    with pytest.raises(RewardConfigError, match="no such file"):
        make_reward_scorer(RewardConfig(name="custom", custom_path=str(tmp_path / "nope.py")))


def test_reward_processes_die_with_their_replica_even_on_kill_9():
    """The fork server and its workers must not outlive the process that started them, even
    when it is SIGKILLed and runs no clean-up (the orphans a killed run used to leave)."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from streamrl.config import RewardConfig
            from streamrl.rollout_fleet.rewards import make_reward_scorer
            scorer = make_reward_scorer(RewardConfig(num_workers=2))
            print("ready", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        children = psutil.Process(owner.pid).children(recursive=True)
        assert len(children) >= 3  # the fork server and two workers
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        if owner.poll() is None:
            owner.kill()
