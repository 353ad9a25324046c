"""Reward models and LLM judges: the tiny reward model's batched scores against HF's own
forward pass, micro-batching of concurrent calls, the judge's template and answer parsing on a
real hf engine, weighted kinds through real Ray actors, failures scored 0 and counted, and a
`streamrl train reward.kind=model` run whose reward rises."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from streamrl.config import (
    Config,
    ConfigError,
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    load_config,
    validate,
)
from streamrl.rollout_fleet.rewards import (
    RemoteScorer,
    WeightedScorer,
    make_reward_scorer,
    start_reward_servers,
)
from streamrl.rollout_fleet.rewards.batching import MicroBatcher
from streamrl.rollout_fleet.rewards.judge import JudgeServer, fill_template, parse_judgement
from streamrl.rollout_fleet.rewards.prompt import PROMPT_KEY
from streamrl.rollout_fleet.rewards.reward_model import RewardModelServer
from streamrl.rollout_fleet.rewards.tiny_rm import build_tiny_reward_model

RESPONSES = ["", "12", "3", "33333333", "3 3 + 1 = 4", "the answer is 7 #### 3", "abcabcab",
             "31313131"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "7="}]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm"))


def _rm_server(rm_dir: Path, **changes: object) -> RewardModelServer:
    cfg = dataclasses.replace(RewardModelConfig(path=str(rm_dir)), **changes)
    server = RewardModelServer(cfg, str(rm_dir))
    asyncio.run(server.setup())
    return server


def _hf_one_by_one(rm_dir: Path, texts: list[str], add_special_tokens: bool) -> list[float]:
    """HF's own forward pass, one unpadded text at a time: the reference."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
            out.append(float(model(**ids).logits[0, 0]))
    return out


# -- config -----------------------------------------------------------------------------------


def test_kind_takes_one_name_or_a_list_and_bad_values_name_their_key():
    one = load_config(["reward.kind=model", "reward.model.path=tiny"])
    assert one.reward.kinds == ("model",)
    both = load_config(["reward.kind=[rule,model]", "reward.weights=[1.0,0.5]",
                        "reward.model.path=tiny"])
    assert both.reward.kinds == ("rule", "model") and both.reward.weights == (1.0, 0.5)
    base = Config()
    bad = [
        ({"kind": "foo"}, "reward.kind='foo'"),
        ({"kind": ("rule", "rule")}, "reward.kind="),
        ({"kind": ("rule", "model"), "weights": (1.0,),
          "model": RewardModelConfig(path="x")}, "reward.weights="),
        ({"weights": (math.inf,)}, "reward.weights="),
        ({"kind": "model"}, "reward.model.path=None"),
        ({"kind": "model", "model": RewardModelConfig(path="x", micro_batch_size=0)},
         "reward.model.micro_batch_size=0"),
        ({"kind": "judge"}, "reward.judge.model_path=None"),
        ({"kind": "judge", "judge": JudgeConfig(model_path="x", backend="sglang")},
         "reward.judge.backend='sglang'"),
        ({"kind": "judge", "judge": JudgeConfig(model_path="x", prompt_template="{prompt}")},
         "reward.judge.prompt_template="),
        ({"kind": "custom"}, "reward.custom_path=None"),
        ({"kind": ("rule", "custom"), "name": "custom", "custom_path": "f.py"}, "reward.name="),
    ]
    for changes, start in bad:
        reward = dataclasses.replace(base.reward, **changes)
        with pytest.raises(ConfigError) as info:
            validate(dataclasses.replace(base, reward=reward))
        message = str(info.value)
        assert message.startswith(start) and "\n" not in message, message


# -- the reward model -------------------------------------------------------------------------


def test_batched_scores_equal_hf_forward_one_by_one(rm_dir: Path):
    for templated in (True, False):
        server = _rm_server(rm_dir, apply_chat_template=templated)
        texts = [server.text(MESSAGES, r) for r in RESPONSES]
        batched = server.forward(texts)  # right-padded to the longest text
        reference = _hf_one_by_one(rm_dir, texts, add_special_tokens=not templated)
        assert batched == pytest.approx(reference, abs=1e-5)
    # templated: the RM reads the conversation in its own chat format
    assert texts[1] == "system: be brief\nuser: 7=12"
    assert server.text("7=", "12") == "7=12"
    templated_text = _rm_server(rm_dir).text(MESSAGES, "12")
    assert templated_text.endswith("<|im_start|>assistant\n12<|im_end|>\n")
    assert "<|im_start|>system\nbe brief" in templated_text


def test_tiny_reward_model_rewards_the_share_of_its_token(rm_dir: Path):
    server = _rm_server(rm_dir)
    none, one, many, half = server.forward(
        [server.text("7=", r) for r in ("12", "3", "33333333", "31313131")])
    assert none == pytest.approx(0.0, abs=1e-6)
    assert 0 < one < half < many


def test_concurrent_calls_share_forward_passes(rm_dir: Path):
    server = _rm_server(rm_dir, micro_batch_size=4, batch_wait_s=0.05)

    async def concurrent() -> list[float]:
        return list(await asyncio.gather(*(server.score("7=", r, None) for r in RESPONSES)))

    scores = asyncio.run(concurrent())
    assert server.stats() == {"forward_passes": 2.0, "texts": 8.0}  # 8 calls, batches of 4
    assert scores == pytest.approx(server.forward([server.text("7=", r) for r in RESPONSES]),
                                   abs=1e-5)

    async def one_by_one() -> list[float]:
        return [await server.score("7=", r, None) for r in RESPONSES[:3]]

    asyncio.run(one_by_one())
    assert server.stats()["forward_passes"] == 2.0 + 1.0 + 3.0  # the direct forward, then 3


def test_micro_batcher_skips_cancelled_calls_and_fails_a_batch_together():
    seen: list[list[int]] = []

    def double(items: list[int]) -> list[int]:
        seen.append(items)
        if -1 in items:
            raise ValueError("bad item")
        return [2 * i for i in items]

    async def run() -> None:
        batcher: MicroBatcher[int, int] = MicroBatcher(double, max_batch=8, wait_s=0.05)
        cancelled = asyncio.ensure_future(batcher.submit(5))
        await asyncio.sleep(0)
        cancelled.cancel()
        assert await asyncio.gather(batcher.submit(1), batcher.submit(2)) == [2, 4]
        results = await asyncio.gather(batcher.submit(3), batcher.submit(-1),
                                       return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results)
        assert await batcher.submit(4) == 8  # the batcher survives a failed batch
        await batcher.close()

    asyncio.run(run())
    assert seen == [[1, 2], [3, -1], [4]]


def test_a_classifier_with_two_labels_is_refused(tmp_path: Path, rm_dir: Path):
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    config = AutoConfig.from_pretrained(rm_dir)
    config.num_labels = 2
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    server = RewardModelServer(RewardModelConfig(path=str(tmp_path), tokenizer_path=str(rm_dir)),
                               str(tmp_path))
    with pytest.raises(ConfigError, match="2 labels; a reward model has one"):
        asyncio.run(server.setup())


# -- the judge --------------------------------------------------------------------------------


@pytest.mark.parametrize(("answer", "score"), [
    ("Score: 0.8", 0.8), ("reasoning 12 steps... score = 1", 1.0), ("SCORE:0", 0.0),
    ("0.25 because it is partly right", 0.25), ("1", 1.0),
    ("The response is correct.", 1.0), ("Looks right at first, but it is wrong", 0.0),
    ("Yes", 1.0), ("incorrect", 0.0),
    ("Score: 7", None), ("42", None), ("hmm, hard to say", None), ("", None),
])
def test_parse_judgement(answer: str, score: float | None):
    assert parse_judgement(answer) == score


def test_template_fills_placeholders_once():
    template = "Q: {prompt}\nA: {response}\nRef: {ground_truth} {other} \\boxed{x}"
    filled = fill_template(template, "say {response}", "42", None)
    assert filled == "Q: say {response}\nA: 42\nRef:  {other} \\boxed{x}"


@pytest.fixture(scope="module")
def judge(tiny_model_dir: Path):
    cfg = JudgeConfig(model_path=str(tiny_model_dir), backend="hf", max_new_tokens=6,
                      max_model_len=256, prompt_template="Task {prompt} answer {response} "
                                                         "truth {ground_truth}. Score:")
    loop = asyncio.new_event_loop()
    server = JudgeServer(cfg, str(tiny_model_dir))
    loop.run_until_complete(server.setup())
    yield server, loop
    loop.run_until_complete(server.shutdown())
    loop.close()


def test_judge_asks_through_its_chat_template_and_parses_the_engine_answer(judge):
    server, loop = judge
    ids = server.prompt_ids("7=", "777", "7")
    assert server.tokenizer.decode(ids) == (
        "<|im_start|>user\nTask 7= answer 777 truth 7. Score:<|im_end|>\n<|im_start|>assistant\n")
    value, answer = loop.run_until_complete(server.judge("7=", "777", "7"))
    assert value == parse_judgement(answer)  # greedy answer of the random tiny model
    with pytest.raises(ValueError, match=r"reward\.judge\.max_model_len=256"):
        server.prompt_ids("7=", "7" * 300, "7")


# -- servers in Ray actors, clients, weights ----------------------------------------------------


def test_weighted_kinds_through_shared_actors(ray_local, rm_dir: Path, tiny_model_dir: Path):
    cfg = RewardConfig(
        kind=("rule", "model", "judge"), weights=(1.0, 2.0, 0.5),
        model=RewardModelConfig(path=str(rm_dir), batch_wait_s=0.5),
        judge=JudgeConfig(model_path=str(tiny_model_dir), backend="hf", max_new_tokens=4),
    )
    servers = start_reward_servers(cfg)
    assert sorted(servers) == ["judge", "model"]
    scorer = make_reward_scorer(cfg, servers)
    assert isinstance(scorer, WeightedScorer)
    local_rm = _rm_server(rm_dir)
    judge_local = JudgeServer(cfg.judge, str(tiny_model_dir))
    extra = {"max_new_tokens": 4, PROMPT_KEY: [{"role": "user", "content": "3="}]}
    try:
        async def both() -> list[float]:
            return list(await asyncio.gather(scorer.score("toy/rep", "3333", "3", extra),
                                             scorer.score("toy/rep", "1212", "3", extra)))

        got = asyncio.run(both())

        async def judged() -> list[float | None]:
            await judge_local.setup()
            return [(await judge_local.judge(extra[PROMPT_KEY], r, "3"))[0]
                    for r in ("3333", "1212")]

        judge_values = asyncio.run(judged())
        rm_values = local_rm.forward([local_rm.text(extra[PROMPT_KEY], r)
                                      for r in ("3333", "1212")])
        rule_values = [1.0, 0.0]  # toy/rep: the share of the prompt's digit
        for i in range(2):
            expected = rule_values[i] + 2.0 * rm_values[i] + 0.5 * (judge_values[i] or 0.0)
            assert got[i] == pytest.approx(expected, abs=1e-5)
        # the group's two calls shared one forward in the model actor
        assert ray_local.get(servers["model"].stats.remote())["forward_passes"] == 1.0
        metrics = scorer.metrics()
        unparseable = float(sum(v is None for v in judge_values))
        assert metrics["calls"] == 2.0 and metrics["model/calls"] == 2.0
        assert metrics["judge/unparseable"] == unparseable
        assert metrics["failures"] == unparseable  # counted among failures too
        assert metrics["timeouts"] == 0.0
    finally:
        scorer.close()
        asyncio.run(judge_local.shutdown())
        for handle in servers.values():
            ray_local.kill(handle)


def test_remote_failures_score_zero_and_are_counted_nan_is_passed_on(
        ray_local, rm_dir: Path, tmp_path: Path):
    from transformers import AutoModelForSequenceClassification

    # A reward model whose head gives NaN: a real non-finite score.
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        model.score.weight.fill_(math.nan)
    model.save_pretrained(tmp_path)
    cfg = RewardConfig(kind="model", model=RewardModelConfig(
        path=str(tmp_path), tokenizer_path=str(rm_dir), timeout_s=30.0))
    handle = start_reward_servers(cfg)["model"]
    scorer = make_reward_scorer(cfg, {"model": handle})
    assert isinstance(scorer, RemoteScorer)
    extra = {PROMPT_KEY: "7="}

    def score(extra_info: dict, client: RemoteScorer = scorer) -> float:
        return asyncio.run(client.score("my/ds", "33", None, extra_info))

    assert math.isnan(score(extra))  # not a made-up 0.0: the replica drops its group
    assert score({}) == 0.0  # no prompt: the replica did not pass it
    assert scorer.metrics()["failures"] == 1.0
    hasty = RemoteScorer("model", handle, timeout_s=1e-6)
    assert score(extra, hasty) == 0.0
    assert hasty.metrics()["timeouts"] == 1.0
    ray_local.kill(handle)
    assert score(extra) == 0.0  # the actor is gone
    assert scorer.metrics() == {"calls": 3.0, "failures": 2.0, "timeouts": 0.0,
                                "unparseable": 0.0}


def test_model_kind_without_a_server_fails_clearly():
    with pytest.raises(ValueError, match="no model server was started"):
        make_reward_scorer(RewardConfig(kind="model", model=RewardModelConfig(path="x")))


def test_replica_passes_messages_or_decoded_prompt(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    from streamrl.data.base import Prompt
    from streamrl.rollout_fleet.rewards.prompt import reward_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer("7=", add_special_tokens=False)["input_ids"]
    plain = Prompt(index=0, prompt_ids=ids, data_source="toy/rep", ground_truth="7", extra={})
    chat = dataclasses.replace(plain, messages=MESSAGES)
    assert reward_prompt(plain, tokenizer) == "7="
    assert reward_prompt(chat, tokenizer) == MESSAGES


# -- a reward-model run ------------------------------------------------------------------------

# The same as `streamrl train model.path=tiny reward.kind=model reward.model.path=tiny
# trainer.mode=sync trainer.total_steps=30 runtime.num_cpus=2 actor.optim.lr=3e-3`. The tiny
# reward model rewards the share of the token "3" in the conversation (tiny_rm): the policy
# learns to answer with 3s. Measured: reward 0.003 -> 0.278 in 30 steps, 49 s.
@pytest.mark.slow
@pytest.mark.vllm
def test_reward_model_run_learns(tmp_path: Path, tiny_model_dir: Path):
    from streamrl.controller import run_training

    steps = 30
    cfg = load_config([
        "runtime.num_cpus=2", "trainer.logger=[jsonl]", "actor.optim.lr=3e-3",
        "task.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.mode=sync",
        f"model.path={tiny_model_dir}", "reward.kind=model", "reward.model.path=tiny",
        f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path}",
    ])
    history = run_training(cfg).history
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    assert history[-1]["replica/reward_failures"] == 0
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    print(f"reward model: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.02 and last > 2 * first, rewards
