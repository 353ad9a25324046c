"""Reward scorers on hand-written examples, and the process pool's failure handling (real
worker processes: raising, hanging, NaN-returning and dict-returning custom functions, alone
and inside a burst of calls that one worker call scores); a replica dropping the groups of a
custom function's non-finite rewards."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import RewardConfig, RolloutConfig
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.rollout_fleet.replica import Replica
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
from tests.support.rollout import IdTokenizer, ScriptedEngine, train_steps

# -- scorers, called directly ---------------------------------------------------------------


def test_gsm8k_strict_and_flexible_extraction_are_verls():
    text = "Half of 10 is 5, plus 37 gives 42.\n#### 42"
    assert gsm8k.extract_solution(text, "strict") == "42"
    assert gsm8k.extract_solution(text) == "42"  # extract_solution's default stays verl's strict
    assert gsm8k.extract_solution("#### 1,234 then #### 7", "strict") == "7"
    assert gsm8k.extract_solution("#### -3", "strict") == "-3"
    assert gsm8k.extract_solution("#### 42.", "strict") == "42."  # as verl returns it
    assert gsm8k.extract_solution("#### 42.0", "strict") == "42.0"
    assert gsm8k.extract_solution("#### $1,234", "strict") is None  # $ before the number
    assert gsm8k.extract_solution("\\boxed{42}", "strict") is None
    assert gsm8k.extract_solution("the answer is 12.", "strict") is None
    assert gsm8k.extract_solution("the answer is 12.", "flexible") == "12."
    assert gsm8k.extract_solution("first 3 then 1,500 .", "flexible") == "1,500"
    # only the last 300 characters are searched
    assert gsm8k.extract_solution("#### 5" + " x" * 200, "strict") is None
    # compute_score with a verl method compares strings, as verl does
    assert gsm8k.compute_score(text, "42", method="strict") == 1.0
    assert gsm8k.compute_score("#### 42.", "42", method="strict") == 0.0
    assert gsm8k.compute_score("#### $1,000", "1000", method="strict") == 0.0
    assert gsm8k.compute_score("#### 1,000", "1000", method="strict") == 1.0
    assert gsm8k.compute_score("#### 41", "42", method="strict", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="must be one of"):
        gsm8k.extract_solution("#### 1", "exact")


COT = "Natalia sold 48 clips in April and half as many, 48 / 2 = 24, in May: 48 + 24 = 72.\n"
# (response, ground truth, score) under compute_score's default (lenient) method
GSM8K_CASES = [
    (COT + "#### 72", "72", 1.0),
    (COT + "#### 72.", "72", 1.0),                    # trailing period
    (COT + "#### 72.0", "72", 1.0),
    (COT + "#### **72**", "72", 1.0),                 # markdown
    (COT + "#### $72", "72", 1.0),
    (COT + "#### \\$72.00", "72", 1.0),
    (COT + "#### The answer is 72", "72", 1.0),
    ("So she paid 1,000 + 234 dollars.\n#### $1,234", "1234", 1.0),
    ("So she paid 1,000 + 234 dollars.\n#### 1234", "1,234", 1.0),  # comma in the truth
    (COT + "#### 72\n\nLet me know if you need more help with 3 other questions.", "72", 1.0),
    (COT + "#### 72" + " Explanation follows." * 30, "72", 1.0),  # beyond 300 characters
    (COT + "The answer is $\\boxed{72}$.", "72", 1.0),        # boxed, no ####
    (COT + "\\boxed{\\$72}", "72", 1.0),
    (COT + "\\boxed{72 \\text{ clips}}", "72", 1.0),
    ("#### Step 1: April\n48 clips.\n#### Step 2: May\n24 clips, so \\boxed{72}", "72", 1.0),
    (COT + "#### -72", "-72", 1.0),
    (COT + "#### 73", "72", 0.0),                     # wrong
    (COT + "#### 72.5", "72", 0.0),
    ("First 72, then I doubled it: \\boxed{144}", "72", 0.0),  # right number, wrong answer
    ("#### 72\nthough a second look gives 73", "72", 1.0),    # #### beats a later number
    ("#### 73\nthough a second look gives 72", "72", 0.0),
    ("#### 71\n...\n#### 72", "72", 1.0),             # the last #### answer counts
    ("#### 72\n...\n#### 71", "72", 0.0),
    ("#### 73\n\\boxed{72}", "72", 0.0),               # the prompt asks for ####
    (COT + "The answer is 72.", "72", 0.0),           # no ####, no \boxed: no answer
    ("72", "72", 0.0),
    (COT + "\\boxed{72", "72", 0.0),                  # truncated: braces do not balance
    ("\\boxed{\\frac{1}{2}}", "1", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), GSM8K_CASES,
                         ids=[case[0].rsplit("\n", 1)[-1][:40] for case in GSM8K_CASES])
def test_gsm8k_default_scores_model_outputs(response, truth, expected):
    assert gsm8k.compute_score(response, truth) == expected
    assert compute_score(ScorerSpec(), "openai/gsm8k", response, truth, {}) == expected


def test_gsm8k_lenient_extraction_is_canonical():
    assert gsm8k.extract_solution("#### $1,234.50.", "lenient") == "1234.5"
    assert gsm8k.extract_solution("#### 0", "lenient") == "0"
    assert gsm8k.extract_solution("#### -0.0", "lenient") == "0"
    assert gsm8k.extract_solution("\\boxed{\\boxed{7}} then 8", "lenient") == "7"
    assert gsm8k.extract_solution("5-3 gives\n\\boxed{2}", "lenient") == "2"


def test_math_verify_equivalent_forms():
    assert math_answer.compute_score("so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math_answer.compute_score("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math_answer.compute_score("\\boxed{3}", "4") == 0.0
    assert math_answer.compute_score("no answer here", "4") == 0.0


def _rgym_entry(dataset: str) -> dict:
    import reasoning_gym

    return dict(reasoning_gym.create_dataset(dataset, size=1, seed=3)[0])


def _rgym(dataset: str, response: str, entry: dict) -> float:
    return rgym.compute_score(f"reasoning_gym/{dataset}", response, entry["answer"],
                              {"entry": entry})


def test_reasoning_gym_scores_with_entry():
    entry = _rgym_entry("basic_arithmetic")
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    source = "reasoning_gym/basic_arithmetic"
    assert rgym.compute_score(source, f"work... #### {right}", right, {"entry": entry}) == 1.0
    assert rgym.compute_score(source, f"<answer>{right}</answer>", right, {"entry": entry}) == 1.0
    assert rgym.compute_score(source, f"#### {wrong}", right, {"entry": entry}) == 0.0
    # without the entry, a minimal one built from the ground truth is graded
    assert rgym.compute_score(source, f"#### {right}", right, {}) == 1.0


# Chains of thought for the numeric datasets: {r} is the right answer, {w} a wrong one.
RGYM_NUMERIC_CASES = [
    ("Let me compute. The result is {r}.", 1.0),
    ("Step by step: the total is {r}.\n#### {r}", 1.0),
    ("Step by step.\n#### {r}.", 1.0),
    ("Step by step.\n#### **{r}**", 1.0),
    ("Step by step.\n#### {r}.0", 1.0),
    ("Step by step.\n#### {r}\n\nHope this helps! (checked 3 times)", 1.0),
    ("Adding the terms one by one gives\n$$\\boxed{{{r}}}$$", 1.0),
    ("#### Step 1\nadd the terms\n#### Step 2\nso \\boxed{{{r}}}", 1.0),
    ("So the answer is {r}, because I added 2 more at the end.", 1.0),
    ("<answer>{r}</answer>", 1.0),
    # the first number is the right answer, the final one is not
    ("{r} is my first guess. Checking again, the final answer is {w}.", 0.0),
    ("{r} is my first guess. Checking again: \\boxed{{{w}}}", 0.0),
    ("{r} is my first guess.\n#### {w}", 0.0),
    ("{r} is my first guess, but recomputing gives {w}", 0.0),
    ("#### {w}\nthough {r} would also be plausible", 0.0),
]


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
@pytest.mark.parametrize(("template", "expected"), RGYM_NUMERIC_CASES,
                         ids=[case[0][-40:] for case in RGYM_NUMERIC_CASES])
def test_reasoning_gym_numeric_datasets_grade_the_final_answer(dataset, template, expected):
    entry = _rgym_entry(dataset)
    right = entry["answer"]
    response = template.format(r=right, w=int(right) + 7)
    if dataset == "gsm_symbolic" and expected == 0.0:
        expected = 0.01  # its own scorer gives any wrong number 0.01
    assert _rgym(dataset, response, entry) == expected


def test_reasoning_gym_numbers_are_written_like_the_answer():
    assert rgym.extract_answer("#### $1,234.", "1234") == "1234"
    assert rgym.extract_answer("#### 1,234", "1,234") == "1,234"
    assert rgym.extract_answer("#### +5.0", "5") == "5"
    assert rgym.extract_answer("#### 4.50", "4.5") == "4.50"  # the dataset compares values
    assert rgym.extract_answer("so 10-3 = 7", "7") == "7"     # the - of 10-3 is not a sign
    assert rgym.extract_answer("no digits here", "7") == "no digits here"


def test_reasoning_gym_non_numeric_dataset():
    entry = _rgym_entry("spell_backward")
    right = entry["answer"]
    wrong = right[::-1]
    cot = f"The word is {wrong}; reading it from the end, letter by letter, gives {right}.\n"
    assert _rgym("spell_backward", cot + f"<answer>{right}</answer>", entry) == 1.0
    assert _rgym("spell_backward", f"<answer>{right}</answer> or maybe {wrong}", entry) == 1.0
    assert _rgym("spell_backward", cot + f"#### **{right}**.", entry) == 1.0
    assert _rgym("spell_backward", cot + f"\\boxed{{\\text{{{right}}}}}", entry) == 1.0
    assert _rgym("spell_backward", cot + f"Final answer: `{right}`", entry) == 1.0
    assert _rgym("spell_backward", f"{right}.", entry) == 1.0
    assert _rgym("spell_backward", cot + f"<answer>{wrong}</answer>", entry) < 1.0
    # tidying only strips what the answer lacks
    assert rgym.extract_answer("#### The cat sat.", "The cat sat.") == "The cat sat."
    assert rgym.extract_answer("#### **bold**", "**bold**") == "**bold**"
    assert rgym.extract_answer("#### \\text{a} or \\text{b}", "a") == "\\text{a} or \\text{b}"


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


def test_a_non_finite_score_is_passed_on_for_the_replica_to_drop(scorer):
    before = scorer.metrics()
    assert math.isnan(_score(scorer, "nan"))  # not 0.0: a made-up reward would be trained on
    assert scorer.metrics() == {**before, "calls": before["calls"] + 1}


BAD_REWARDS = textwrap.dedent("""
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "huge":
            return 1e39  # finite in Python, inf in the learner's float32 tensors
        if ground_truth == "nan":
            return float("nan")
        return float(solution_str.split()[0])  # sample j answers token j: rewards 0.0, 1.0
""")


def test_a_replica_drops_a_group_whose_custom_reward_is_not_finite_in_float32(tmp_path, caplog):
    """A real custom reward function returns 1e39 for one prompt and NaN for another: those
    groups never reach the buffer (nothing made up is trained on), each drop is one line naming
    the group, the prompt, the data source and the value, counted, and the run goes on."""
    path = tmp_path / "bad_reward.py"
    path.write_text(BAD_REWARDS)
    prompts = [Prompt(index=i, prompt_ids=[i], data_source="my/ds", ground_truth=truth,
                      extra={}) for i, truth in enumerate(["ok", "huge", "ok", "nan"])]
    stream = PromptStream(ListPromptSource(prompts, name="bad"), shuffle=False, seed=0)
    buffer = MemoryBuffer(groups_per_step=2, max_staleness=0)
    cfg = RewardConfig(name="custom", custom_path=str(path), num_workers=1)
    with make_reward_scorer(cfg) as scorer, caplog.at_level(logging.WARNING):
        replica = Replica(ScriptedEngine(), buffer, stream, scorer, IdTokenizer(),
                          RolloutConfig(n=2, max_new_tokens=8, max_inflight_groups=2),
                          admit_backoff_s=0.001)
        taken = [g for batch in train_steps(buffer, replica, steps=2) for g in batch]
    assert sorted(g.prompt_index for g in taken) == [0, 0, 2, 2]
    assert all(g.rewards == [0.0, 1.0] for g in taken)
    m = replica.metrics()
    assert m["groups_bad_reward"] >= 2 and m["groups_failed"] == m["reward_failures"] == 0
    lines = [r.getMessage() for r in caplog.records if "not finite in float32" in r.getMessage()]
    assert len(lines) == m["groups_bad_reward"]
    for prompt, value in [(1, "1e+39"), (3, "nan")]:
        assert any(re.fullmatch(
            rf"replica: group [0-9a-f]{{32}} of prompt {prompt} dropped, admission given back: "
            rf"the reward function for data_source 'my/ds' returned {re.escape(value)}, not "
            r"finite in float32", line) for line in lines), lines
    s = buffer.stats()
    assert s.in_flight == 0 and s.started == s.consumed + s.queued


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


def test_the_warm_up_imports_only_the_scorers_of_the_tasks_sources():
    """A worker starts with its task's scorers imported (a first call is not charged for them),
    and with no others: math_verify and reasoning_gym cost seconds at every replica start."""
    import subprocess
    import sys

    probe = textwrap.dedent("""
        import sys
        from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec, warmup
        heavy = lambda: ["math_verify" in sys.modules, "reasoning_gym" in sys.modules]
        warmup(ScorerSpec(sources=("toy/rep",)))
        print(heavy())
        warmup(ScorerSpec(sources=("toy/rep", "reasoning_gym/leg_counting")))
        print(heavy())
        warmup(ScorerSpec(sources=("unknown/source",)))  # not known: every scorer's
        print(heavy())
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[:3] == ["[False, False]", "[False, True]", "[True, True]"], out


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
