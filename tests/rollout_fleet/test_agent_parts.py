"""The agent package's parts without an engine: the Hermes parser, tools (schemas, the four
ways a call fails), the chat-template delta renderer against a full re-render, the built-in
environments' contracts, loading by name / import path / file, and the config checks."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrl.config import ConfigError, RolloutConfig, load_config
from streamrl.data import Prompt
from streamrl.rollout_fleet.agent import (
    AssistantTurn,
    ChatRenderer,
    HermesParser,
    ToolBox,
    ToolCall,
    as_tool,
    load_object,
    make_agent,
)
from streamrl.rollout_fleet.agent.envs.calculator import CalculatorEnv, calculator
from streamrl.rollout_fleet.agent.envs.relay import RelayEnv
from streamrl.rollout_fleet.agent.envs.rgym import ReasoningGymEnv


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def executor():
    pool = ThreadPoolExecutor(4)
    yield pool
    pool.shutdown(wait=False)


def _turn(text: str, index: int = 0, last: bool = False, **kw) -> AssistantTurn:
    return AssistantTurn(index=index, text=text, content=text, token_ids=[], finish_reason="stop",
                         last=last, **kw)


# -- parser -------------------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_reports_ill_formed_ones():
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 3}"}</tool_call>'
            "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"name": "x", "arguments": 5}</tool_call> done <tool_call>{"name": "cut')
    parsed = HermesParser().parse(text)
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3})]
    assert parsed.content == "Let me add.  done"
    assert len(parsed.errors) == 4
    assert "not JSON" in parsed.errors[0] and "string 'name'" in parsed.errors[1]
    assert "'arguments' is not a JSON object" in parsed.errors[2]
    assert "without </tool_call>" in parsed.errors[3]
    assert HermesParser().parse("no calls here").calls == []


# -- tools --------------------------------------------------------------------------------


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first one.
        b: The second one.
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot handle {x}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def slow_async(seconds: float) -> str:
    """Sleeps without a thread.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


def junk() -> object:
    """Returns something JSON cannot hold."""
    return {1, 2}


def test_tool_schema_comes_from_hints_and_docstring():
    schema = as_tool(add).schema
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first one."},
            "b": {"type": "integer", "description": "The second one."}},
            "required": ["a"]}}}

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="cannot derive its JSON schema"):
        as_tool(undocumented)


def test_tool_failures_become_error_observations(executor):
    box = ToolBox([add, boom, slow, slow_async, junk], executor)

    async def run(name: str, **args):
        return await box.run(ToolCall(name, args), timeout_s=0.3)

    async def scenario():
        ok = await run("add", a=2, b=3)
        assert ok.error is None and ok.message == {"role": "tool", "name": "add", "content": "5"}
        results = {
            "raises": await run("boom", x="it"),
            "hangs": await run("slow", seconds=3.0),
            "hangs_async": await run("slow_async", seconds=3.0),
            "junk": await run("junk"),
            "unknown": await run("nope"),
            "bad_args": await run("add", c=1),
        }
        return results

    start = time.perf_counter()
    results = asyncio.run(scenario())
    assert time.perf_counter() - start < 2.5  # the hanging tools were abandoned at 0.3 s
    expected = {
        "raises": "boom raised RuntimeError: cannot handle it",
        "hangs": "slow timed out after 0.3s", "hangs_async": "slow_async timed out after 0.3s",
        "junk": "not JSON-serializable", "unknown": "unknown tool 'nope'",
        "bad_args": "bad arguments for add",
    }
    for key, text in expected.items():
        result = results[key]
        assert result.error is not None and text in result.error, (key, result)
        assert result.message["role"] == "tool"
        assert result.message["content"].startswith("Error: ") and text in result.message["content"]


def test_two_tools_with_one_name_are_refused(executor):
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolBox([add, add], executor)


# -- rendering ----------------------------------------------------------------------------


def test_delta_appends_exactly_what_a_full_render_has(tokenizer):
    """prompt + canonical turn ids + delta == the whole conversation rendered at once: the delta
    holds the turn's end and the new messages, and no second system prompt or tool list."""
    renderer = ChatRenderer(tokenizer)
    tools = [as_tool(calculator).schema]
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "7 + 5?"}]
    ids = renderer.prompt(first, tools)
    turns = [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "7+5"}}\n</tool_call>',
         [{"role": "tool", "name": "calculator", "content": "12"}]),
        ("it is 12", [{"role": "user", "content": "and 3 + 4?"}]),
    ]
    conversation = list(first)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, (text, observation) in enumerate(turns):
        sampled = tokenizer(text, add_special_tokens=False)["input_ids"]
        if i == 0:
            sampled = [*sampled, end]  # the model closed its turn: im_end is not added twice
        delta = renderer.observation(observation, sampled)
        assert "system" not in tokenizer.decode(delta) and "<tools>" not in tokenizer.decode(delta)
        ids = ids + sampled + delta
        conversation += [{"role": "assistant", "content": text}, *observation]
    full = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    assert ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert renderer.delta_text([{"role": "user", "content": "x"}]) == (
        "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


# -- built-in environments ------------------------------------------------------------------


def test_relay_targets_come_from_observations_and_score_per_turn():
    prompt = Prompt(index=3, prompt_ids=[1], data_source="toy/rep", ground_truth="7", extra={})
    env = RelayEnv()
    assert (env.turns, env.turn_tokens, env.repeat) == (2, 4, 8)
    assert env.reset(prompt) == [{"role": "user", "content": "77777777"}]  # the prompt's digit
    # Turn 0 repeats the opening; the observation brings a new digit turn 1 must repeat.
    obs, reward, done, info = env.step(_turn("77x7"))
    assert reward == 0.75 / 2 and not done
    new = env.targets[1]
    assert new != 7 and obs == [{"role": "user", "content": str(new) * 8}]
    obs, reward, done, info = env.step(_turn(str(new) * 4, index=1, last=True))
    assert obs is None and done and reward == 0.5
    assert info["observation_reward"] == 1.0
    assert info["observation_cross_reward"] == pytest.approx(0.1)  # its digits earn the credit
    # Repeating the old digit after the observation earns only the digit credit (0.1 each).
    env.reset(prompt)
    env.step(_turn("7777"))
    _, reward, _, info = env.step(_turn("7777", index=1))
    assert reward == pytest.approx(0.1 / 2) and info["observation_reward"] == pytest.approx(0.1)
    # The next prompt's digit scores the cross rewards instead.
    env.reset(prompt)
    env.step(_turn("xxxx"))
    _, _, _, info = env.step(_turn(str((new + 1) % 10) * 4, index=1))
    assert info == {"cross_reward": 0.5, "observation_reward": pytest.approx(0.1),
                    "observation_cross_reward": 1.0}

    class Longer(RelayEnv):
        turns = 4

    env = Longer()
    env.reset(prompt)
    again = Longer()
    again.reset(prompt)
    assert again.targets == env.targets  # the n episodes of one prompt see the same digits
    assert env.targets[0] == 7 and all(a != b for a, b in zip(env.targets, env.targets[1:]))
    said = [env.step(_turn(str(env.targets[k]) * 4, index=k)) for k in range(4)]
    assert [s.observation[0]["content"] for s in said[:3]] == [
        str(d) * 8 for d in env.targets[1:]]
    assert sum(s.reward for s in said) == pytest.approx(1.0) and said[-1].done
    with pytest.raises(ValueError, match=r"task\.source=toy"):
        RelayEnv().reset(Prompt(index=0, prompt_ids=[1], data_source="x", ground_truth="42",
                                extra={}))


def _gsm_prompt() -> Prompt:
    return Prompt(index=0, prompt_ids=[1], data_source="reasoning_gym/basic_arithmetic",
                  ground_truth="42", extra={},
                  messages=[{"role": "user", "content": "What is 6 * 7?"}])


def test_calculator_env_rewards_answers_that_use_the_tool_result(executor):
    assert calculator("(12 + 30) / 7") == "6" and calculator("2 ^ 3 * 1.5") == "12"
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1"):
        with pytest.raises((ValueError, ZeroDivisionError)):
            calculator(bad)

    async def play(turns: list[str]) -> tuple[float, dict]:
        env = CalculatorEnv()
        messages = env.reset(_gsm_prompt())
        assert messages[0]["role"] == "system" and messages[1]["content"] == "What is 6 * 7?"
        box = ToolBox(env.tools, executor)
        total = 0.0
        for i, text in enumerate(turns):
            parsed = HermesParser().parse(text)
            turn = _turn(text, index=i, tool_calls=parsed.calls)
            turn.content = parsed.content
            turn.tool_messages = [(await box.run(c, 1.0)).message for c in parsed.calls]
            _obs, reward, done, info = env.step(turn)
            total += reward
            assert done == (i == len(turns) - 1)
        return total, info

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert asyncio.run(play([call, "So #### 42"])) == (
        1.0, {"correct": 1.0, "used_tool_result": 1.0, "calculator_calls": 1})
    assert asyncio.run(play(["#### 42"]))[0] == 0.0  # right, but without the tool
    assert asyncio.run(play([call, "#### 41"]))[0] == 0.0


@pytest.mark.parametrize("hostile", [
    "9**9**9**9", "(10**100000)**100000",
    "(((9**64)**64)**64)**64",  # each power allowed alone: 13 s of GIL before the bound
    "(9**60)**60", "9**64*9**64*9**64*9**64*9**64*9**64", "1e300*1e300",
])
def test_calculator_refuses_huge_values_within_milliseconds(executor, hostile):
    """A tool runs on a thread of the replica's process: a result too large to print would
    hold the GIL (and the replica) while Python builds it, so its size is checked first."""
    box = ToolBox([calculator], executor)
    start = time.perf_counter()
    result = asyncio.run(box.run(ToolCall("calculator", {"expression": hostile}), 30.0))
    assert time.perf_counter() - start < 0.25
    assert result.error is not None and "is too large (limit" in result.error
    assert calculator("2**64 * 3 - 1") == str(3 * 2**64 - 1)  # the bound leaves room


def test_reasoning_gym_env_is_a_one_tool_environment(executor):
    import reasoning_gym

    from streamrl.data.reasoning_gym import _plain

    entry = _plain(dict(reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]))
    prompt = Prompt(index=0, prompt_ids=[1], data_source="reasoning_gym/basic_arithmetic",
                    ground_truth=entry["answer"], extra={"entry": entry})
    env = ReasoningGymEnv()
    messages = env.reset(prompt)
    assert messages[1]["content"] == entry["question"]
    [tool] = [as_tool(t) for t in env.tools]
    assert tool.name == "submit_answer"
    box = ToolBox(env.tools, executor)

    async def submit(answer: str, index: int) -> tuple:
        call = ToolCall("submit_answer", {"answer": answer})
        turn = _turn("", index=index, tool_calls=[call])
        turn.tool_messages = [(await box.run(call, 5.0)).message]
        return turn.tool_messages[0]["content"], env.step(turn)

    feedback, (obs, reward, done, _) = asyncio.run(submit("-1e9", 0))
    assert feedback.startswith("incorrect") and obs and not done and reward == 0.0
    feedback, (obs, reward, done, info) = asyncio.run(submit(entry["answer"], 1))
    assert feedback == "correct" and done and reward == 1.0 and info["submissions"] == 2


# -- loading and config --------------------------------------------------------------------


def test_make_agent_loads_builtins_import_paths_and_files(tokenizer, tmp_path: Path):
    agent = make_agent(RolloutConfig(agent="relay", max_turns=2, max_episode_tokens=30,
                                     tools=("tests.rollout_fleet.test_agent_parts:add",)),
                       tokenizer)
    assert agent.new_env is RelayEnv and [t.name for t in agent.tools] == ["add"]
    assert (agent.max_turns, agent.max_episode_tokens) == (2, 30)
    file = tmp_path / "my_env.py"
    file.write_text("from streamrl.rollout_fleet.agent import Environment\n"
                    "class Mine(Environment):\n    pass\n")
    assert load_object(f"{file}:Mine", "rollout.agent").__name__ == "Mine"
    with pytest.raises(TypeError, match="not a subclass"):
        make_agent(RolloutConfig(agent="tests.rollout_fleet.test_agent_parts:add"), tokenizer)
    with pytest.raises(ConfigError, match="defines no 'Nope'"):
        load_object(f"{file}:Nope", "rollout.agent")
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(no_template)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.tools=[m:f]"], "needs rollout.agent"),
    (["rollout.agent=nosuchenv"], "must be a built-in environment"),
    (["rollout.agent=relay", "rollout.tools=[nocolon]"], "'module:function'"),
    (["rollout.agent=relay", "rollout.max_turns=0"], "rollout.max_turns=0"),
    (["rollout.agent=relay", "rollout.max_episode_tokens=600"], "rollout.max_model_len"),
    (["rollout.agent=relay", "actor.ppo_max_token_len=100"], "longest episode"),
])
def test_agent_config_is_checked(overrides: list[str], message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_agent_config_accepts_a_builtin_and_a_class_path():
    cfg = load_config(["rollout.agent=relay", "rollout.tools=[a.b:c]"])
    assert cfg.rollout.agent == "relay" and cfg.rollout.tools == ("a.b:c",)
    assert load_config(["rollout.agent=pkg.mod:Env"]).rollout.agent == "pkg.mod:Env"
    json.dumps(cfg.rollout.tools)


def test_example_guess_env_contract(executor):
    """examples/agent_guess.py: its bound-method tool sees the episode's state."""
    root = Path(__file__).resolve().parents[2]
    env_cls = load_object(f"{root}/examples/agent_guess.py:GuessEnv", "rollout.agent")
    hint = load_object(f"{root}/examples/agent_guess.py:hint", "rollout.tools")
    env = env_cls()
    env.reset(Prompt(index=5, prompt_ids=[1], data_source="x", ground_truth=None, extra={}))
    box = ToolBox([*env.tools, hint], executor)

    async def turn(index: int, number: int):
        call = ToolCall("guess", {"number": number})
        t = _turn("", index=index, tool_calls=[call])
        t.tool_messages = [(await box.run(call, 1.0)).message]
        return t.tool_messages[0]["content"], env.step(t)

    low = (env.secret + 1) % 10 if env.secret < 9 else 0
    said, (obs, reward, done, _) = asyncio.run(turn(0, low))
    assert said in ("higher", "lower") and obs and not done and reward == 0.0
    said, (obs, reward, done, info) = asyncio.run(turn(1, env.secret))
    assert said == "correct" and done and reward == pytest.approx(0.9) and info["guesses"] == 2
    assert asyncio.run(box.run(ToolCall("hint", {"number": 3}), 1.0)).message["content"] == "odd"
