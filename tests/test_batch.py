"""Batch: construction checks, row/key operations, verl's padded layout and the packed layout."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.batch import Batch
from streamrl.types import OBSERVATION_VERSION, Group, Trajectory, decode, encode

PAD = 0


def two_groups() -> list[Group]:
    """Ragged, with multi-turn holes: hand-checked layout in `test_from_groups_field_values`."""
    a = [
        Trajectory(uid="a0", group_id="gA", prompt_ids=[11, 12], response_ids=[21, 22, 23],
                   loss_mask=[1, 1, 1], logprobs=[-0.1, -0.2, -0.3], versions=[3, 3, 4],
                   reward=1.0, finish_reason="stop", data_source="toy", ground_truth="7"),
        Trajectory(uid="a1", group_id="gA", prompt_ids=[11, 12], response_ids=[24],
                   loss_mask=[1], logprobs=[-0.4], versions=[2], reward=0.0,
                   data_source="toy", ground_truth="7"),
    ]
    b = [
        # policy, tool output, policy, trailing tool output (stamped 0 by a sloppy agent)
        Trajectory(uid="b0", group_id="gB", prompt_ids=[13, 14, 15], response_ids=[31, 90, 32, 91],
                   loss_mask=[1, 0, 1, 0], logprobs=[-0.5, 0.0, -0.6, 0.0],
                   versions=[5, 0, 6, OBSERVATION_VERSION], reward=0.5, finish_reason="stop",
                   data_source="calc"),
        Trajectory(uid="b1", group_id="gB", prompt_ids=[13, 14, 15], response_ids=[33, 92],
                   loss_mask=[1, 0], logprobs=[-0.7, 0.0], versions=[5, OBSERVATION_VERSION],
                   reward=1.0, token_rewards=[0.25, 0.75], data_source="calc"),
    ]
    return [Group(group_id="gA", trajectories=a), Group(group_id="gB", trajectories=b)]


@pytest.fixture
def batch() -> Batch:
    return Batch.from_groups(two_groups(), pad_token_id=PAD)


def assert_batches_equal(x: Batch, y: Batch) -> None:
    assert x.tensors.keys() == y.tensors.keys()
    assert x.non_tensors.keys() == y.non_tensors.keys()
    for key in x.tensors:
        assert x.tensors[key].dtype == y.tensors[key].dtype, key
        assert torch.equal(x.tensors[key], y.tensors[key]), key
    for key in x.non_tensors:
        assert np.array_equal(x.non_tensors[key], y.non_tensors[key]), key
    assert x.meta == y.meta


# ---- from_groups ------------------------------------------------------------------------------
def test_from_groups_field_values(batch: Batch) -> None:
    t = batch.tensors
    assert len(batch) == 4
    assert t["prompts"].tolist() == [[0, 11, 12], [0, 11, 12], [13, 14, 15], [13, 14, 15]]
    assert t["responses"].tolist() == [[21, 22, 23, 0], [24, 0, 0, 0], [31, 90, 32, 91],
                                       [33, 92, 0, 0]]
    assert t["input_ids"].tolist() == [[0, 11, 12, 21, 22, 23, 0], [0, 11, 12, 24, 0, 0, 0],
                                       [13, 14, 15, 31, 90, 32, 91], [13, 14, 15, 33, 92, 0, 0]]
    assert t["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0],
                                            [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]
    assert t["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 2, 2, 2],
                                          [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 4, 4]]
    assert t["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0],
                                           [1, 0, 0, 0]]
    assert t["rollout_log_probs"].tolist() == pytest.approx(
        np.array([[-0.1, -0.2, -0.3, 0], [-0.4, 0, 0, 0], [-0.5, 0, -0.6, 0], [-0.7, 0, 0, 0]]))
    # observation tokens and padding are -1, whatever the agent stamped on them
    assert t["versions"].tolist() == [[3, 3, 4, -1], [2, -1, -1, -1], [5, -1, 6, -1],
                                      [5, -1, -1, -1]]
    # reward at the last policy token (b0: index 2, not the trailing tool output); b1: token_rewards
    assert t["token_level_scores"].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0.5, 0],
                                                [0.25, 0.75, 0, 0]]
    dtypes = {k: v.dtype for k, v in t.items()}
    assert dtypes == {"prompts": torch.long, "responses": torch.long, "input_ids": torch.long,
                      "attention_mask": torch.long, "position_ids": torch.long,
                      "response_mask": torch.float32, "rollout_log_probs": torch.float32,
                      "versions": torch.long, "token_level_scores": torch.float32}
    nt = batch.non_tensors
    assert nt["uid"].tolist() == ["a0", "a1", "b0", "b1"]
    assert nt["index"].tolist() == ["gA", "gA", "gB", "gB"]
    assert nt["data_source"].tolist() == ["toy", "toy", "calc", "calc"]
    assert nt["ground_truth"].tolist() == ["7", "7", None, None]
    assert nt["reward"].dtype == np.float64 and nt["reward"].tolist() == [1.0, 0.0, 0.5, 1.0]
    assert nt["finish_reason"].tolist() == ["stop", "length", "stop", "length"]
    assert batch.meta == {"pad_token_id": 0, "num_groups": 2, "group_ids": ["gA", "gB"],
                          "min_version": 2}


def test_from_groups_reward_without_policy_tokens_goes_to_last_token() -> None:
    t = Trajectory(uid="x", group_id="g", prompt_ids=[1], response_ids=[7, 8, 9],
                   loss_mask=[0, 0, 0], logprobs=[0.0] * 3, versions=[-1] * 3, reward=2.0)
    b = Batch.from_groups([Group(group_id="g", trajectories=[t])], pad_token_id=PAD)
    assert b["token_level_scores"].tolist() == [[0.0, 0.0, 2.0]]
    assert b.meta["min_version"] is None


def test_from_groups_after_wire_round_trip(batch: Batch) -> None:
    groups = [decode(encode(g), Group) for g in two_groups()]
    assert_batches_equal(Batch.from_groups(groups, pad_token_id=PAD), batch)


def test_from_groups_errors() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        Batch.from_groups([], pad_token_id=PAD)
    t = Trajectory(uid="e", group_id="g", prompt_ids=[1], response_ids=[], loss_mask=[],
                   logprobs=[], versions=[])
    with pytest.raises(ValueError, match="Trajectory e: response_ids is empty"):
        Batch.from_groups([Group(group_id="g", trajectories=[t])], pad_token_id=PAD)
    t = Trajectory(uid="p", group_id="g", prompt_ids=[], response_ids=[3], loss_mask=[1],
                   logprobs=[0.0], versions=[0])
    with pytest.raises(ValueError, match="Trajectory p: prompt_ids is empty"):
        Batch.from_groups([Group(group_id="g", trajectories=[t])], pad_token_id=PAD)


# ---- construction and access ------------------------------------------------------------------
def test_construction_validates_shapes() -> None:
    with pytest.raises(ValueError, match="tensor 'b' has batch size 2 but 'a' has 3"):
        Batch({"a": torch.zeros(3, 4), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="non-tensor 'uid' has batch size 2 but 'a' has 3"):
        Batch({"a": torch.zeros(3)}, {"uid": np.array(["x", "y"])})
    with pytest.raises(ValueError, match="tensor 'a' is 0-dimensional"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="non-tensor 'uid' must be a ndarray, got list"):
        Batch({"a": torch.zeros(2)}, {"uid": ["x", "y"]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="tensor 'a' must be a Tensor, got ndarray"):
        Batch({"a": np.zeros(2)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"keys \['a'\] are both tensors and non-tensors"):
        Batch({"a": torch.zeros(2)}, {"a": np.zeros(2)})
    assert len(Batch()) == 0


def test_getitem_and_contains(batch: Batch) -> None:
    assert batch["responses"] is batch.tensors["responses"]
    assert batch["uid"] is batch.non_tensors["uid"]
    assert "uid" in batch and "versions" in batch and "nope" not in batch
    with pytest.raises(KeyError, match="no key 'nope' in batch"):
        batch["nope"]


# ---- row operations ---------------------------------------------------------------------------
def test_chunk_and_concat(batch: Batch) -> None:
    first, second = batch.chunk(2)
    assert first["uid"].tolist() == ["a0", "a1"] and second["uid"].tolist() == ["b0", "b1"]
    assert torch.equal(second["responses"], batch["responses"][2:])
    # row summaries follow the rows; batch-wide meta is carried
    assert first.meta == {"pad_token_id": 0, "num_groups": 1, "group_ids": ["gA"],
                          "min_version": 2}
    assert second.meta["group_ids"] == ["gB"] and second.meta["min_version"] == 5
    assert_batches_equal(Batch.concat([first, second]), batch)
    assert [len(c) for c in batch.chunk(4)] == [1, 1, 1, 1]
    assert_batches_equal(Batch.concat(batch.chunk(1)), batch)
    for k in (3, 0, -2):
        with pytest.raises(ValueError, match=f"cannot chunk a batch of 4 rows into k={k}"):
            batch.chunk(k)


def test_concat_errors(batch: Batch) -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"batch 1 keys differ from batch 0 in \['uid'\]"):
        Batch.concat([batch, batch.select([k for k in batch if k != "uid"])])
    # group gB alone has prompt width 3 and response width 4, group gA alone 2 and 3
    wide, narrow = (Batch.from_groups([g], pad_token_id=PAD) for g in reversed(two_groups()))
    with pytest.raises(ValueError, match=r"tensor 'prompts' has shape \(2, 2\) in batch 1 but "
                                         r"\(2, 3\) in batch 0"):
        Batch.concat([wide, narrow])
    other_pad = Batch.from_groups(two_groups(), pad_token_id=1)
    with pytest.raises(ValueError, match=r"meta\['pad_token_id'\] conflicts: 0 vs 1"):
        Batch.concat([batch, other_pad])


def test_index_forms(batch: Batch) -> None:
    picked = batch.index([2, 0])
    assert picked["uid"].tolist() == ["b0", "a0"]
    assert torch.equal(picked["input_ids"], batch["input_ids"][[2, 0]])
    assert picked.meta["group_ids"] == ["gB", "gA"] and picked.meta["min_version"] == 3
    for idx in ([False, True, False, True], torch.tensor([False, True, False, True]),
                np.array([1, 3]), torch.tensor([1, 3]), slice(1, None, 2), [-3, -1]):
        assert batch.index(idx)["uid"].tolist() == ["a1", "b1"], idx
    empty = batch.index([])
    assert len(empty) == 0 and empty["responses"].shape == (0, 4)
    assert empty.meta["group_ids"] == [] and empty.meta["min_version"] is None


def test_index_errors(batch: Batch) -> None:
    with pytest.raises(IndexError, match="bool mask has 3 entries, batch has 4"):
        batch.index([True, False, True])
    with pytest.raises(IndexError, match=r"out of range for batch of 4: 0\.\.4"):
        batch.index([0, 4])
    with pytest.raises(IndexError, match="must hold ints or bools"):
        batch.index([0.5])
    with pytest.raises(IndexError, match=r"must be 1-D .*wrap a single row as \[i\]"):
        batch.index(1)  # type: ignore[arg-type]


def test_row_meta_dropped_when_its_columns_are_gone(batch: Batch) -> None:
    slim = batch.select(["responses"])
    assert slim.meta["group_ids"] == ["gA", "gB"]  # same rows: still true
    assert slim.index([0]).meta == {"pad_token_id": 0}  # new rows, nothing to recompute from


# ---- key operations ---------------------------------------------------------------------------
def test_select_and_pop(batch: Batch) -> None:
    sel = batch.select(["responses", "uid"])
    assert sel.keys() == ["responses", "uid"] and len(sel) == 4
    sel.meta["extra"] = 1
    assert "extra" not in batch.meta
    with pytest.raises(KeyError, match="no key 'nope' in batch"):
        batch.select(["responses", "nope"])
    with pytest.raises(KeyError, match="no key 'nope'"):
        batch.pop(["responses", "nope"])
    assert "responses" in batch  # a failed pop removes nothing
    popped = batch.pop(["token_level_scores", "ground_truth"])
    assert popped.keys() == ["token_level_scores", "ground_truth"]
    assert "token_level_scores" not in batch and "ground_truth" not in batch
    assert popped.meta == batch.meta and len(batch) == 4


def test_union(batch: Batch) -> None:
    extra = Batch({"old_log_probs": torch.ones(4, 4), "responses": batch["responses"].clone()},
                  {"tag": np.arange(4)}, {"temperature": 1.0})
    both = batch.union(extra)
    assert set(both.keys()) == set(batch.keys()) | {"old_log_probs", "tag"}
    assert both.meta["temperature"] == 1.0 and both.meta["group_ids"] == ["gA", "gB"]
    assert "old_log_probs" not in batch  # union returns a new batch
    clash = Batch({"responses": batch["responses"] + 1})
    with pytest.raises(ValueError, match="key 'responses' has different values"):
        batch.union(clash)
    with pytest.raises(ValueError, match="key 'uid' has different values"):
        batch.union(Batch(non_tensors={"uid": np.array(["a0", "a1", "b0", "zz"], dtype=object)}))
    with pytest.raises(ValueError, match="union: batches have 4 and 2 rows"):
        batch.union(Batch({"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"meta\['pad_token_id'\] conflicts"):
        batch.union(Batch({"x": torch.zeros(4)}, meta={"pad_token_id": 5}))


def test_to_device(batch: Batch) -> None:
    moved = batch.to("cpu")
    assert_batches_equal(moved, batch)
    assert moved.meta is not batch.meta
    if torch.cuda.is_available():
        cuda = batch.to("cuda")
        assert cuda["input_ids"].is_cuda and isinstance(cuda["uid"], np.ndarray)
        assert cuda.index(torch.tensor([1], device="cuda"))["uid"].tolist() == ["a1"]


# ---- packed layout ----------------------------------------------------------------------------
def test_pack_layout_hand_checked(batch: Batch) -> None:
    packed = batch.pack()
    assert packed.rows == [0, 1, 2, 3]
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 15, 20]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23, 11, 12, 24,
                                          13, 14, 15, 31, 90, 32, 91, 13, 14, 15, 33, 92]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6,
                                             0, 1, 2, 3, 4]]
    assert packed.targets.tolist() == [[12, 21, 22, 23, 0, 12, 24, 0, 14, 15, 31, 90, 32, 91, 0,
                                        14, 15, 33, 92, 0]]
    # position 1 (token 12, the prompt's last) predicts response token 0 (21) of row 0, ...
    assert packed.response_token_index.tolist() == [[1, 2, 3, -1], [6, -1, -1, -1],
                                                    [10, 11, 12, 13], [17, 18, -1, -1]]
    assert packed.predict_mask[0].nonzero().flatten().tolist() == [1, 2, 3, 6, 10, 11, 12, 13,
                                                                    17, 18]
    # scattering the targets back reproduces the padded responses (PAD is 0)
    assert torch.equal(packed.unpack_response(packed.targets), batch["responses"])
    assert torch.equal(packed.unpack_response(packed.targets[0].float()),
                       batch["responses"].float())


def test_pack_subset_lines_up_with_index(batch: Batch) -> None:
    packed = batch.pack([3, 1])
    assert packed.rows == [3, 1] and packed.cu_seqlens.tolist() == [0, 5, 8]
    sub = batch.index([3, 1])
    assert torch.equal(packed.unpack_response(packed.targets), sub["responses"])
    assert torch.equal(packed.response_valid.long(), sub["attention_mask"][:, -4:])


def test_pack_errors(batch: Batch) -> None:
    with pytest.raises(IndexError, match=r"rows \[4\] must be a non-empty list within 0..3"):
        batch.pack([4])
    with pytest.raises(IndexError, match="non-empty"):
        batch.pack([])
    with pytest.raises(KeyError, match="pack needs tensor 'attention_mask'"):
        batch.select(["input_ids", "responses"]).pack()
    no_prompt = Batch({"input_ids": torch.tensor([[0, 5]]),
                       "attention_mask": torch.tensor([[0, 1]]), "responses": torch.tensor([[5]])})
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        no_prompt.pack()
    packed = batch.pack()
    with pytest.raises(ValueError, match=r"values must be \[T\] or \[1,T\] with T=20"):
        packed.unpack_response(torch.zeros(2, 10))


def random_groups(seed: int, vocab: int) -> list[Group]:
    """Ragged groups (sizes 2, 3, 1) with multi-turn loss masks holding interior holes."""
    rng = random.Random(seed)
    groups = []
    for g, size in enumerate((2, 3, 1)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        trajs = []
        for k in range(size):
            n = rng.randint(1, 9)
            mask = [1] * n
            if n >= 4:  # a tool observation in the middle: tokens the policy did not sample
                start, length = rng.randint(1, n - 3), rng.randint(1, 2)
                mask[start:start + length] = [0] * length
            trajs.append(Trajectory(
                uid=f"{g}-{k}", group_id=f"g{g}", prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(n)], loss_mask=mask,
                logprobs=[-1.0] * n, versions=[0 if m else -1 for m in mask],
            ))
        groups.append(Group(group_id=f"g{g}", trajectories=trajs))
    return groups


@pytest.mark.parametrize("attn", ["sdpa", "eager", "streamrl_varlen"])
def test_packed_log_probs_equal_padded(tiny_model_dir: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM

    from streamrl.learner import varlen_attention

    varlen = attn == varlen_attention.IMPLEMENTATION
    varlen_attention.register()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation=attn,
                                                 dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    batch = Batch.from_groups(random_groups(0, vocab), pad_token_id=PAD)
    holes = batch["response_mask"][:, 1:] < batch["response_mask"][:, :-1]
    assert holes.any(), "the fixture must contain interior loss-mask holes"
    R = batch["responses"].shape[1]

    with torch.no_grad():
        # padded, as verl: left-padded prompts, attention_mask, logits[:, -R-1:-1] predict responses
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits
        padded = torch.log_softmax(logits[:, -R - 1:-1].float(), -1)
        padded = padded.gather(-1, batch["responses"][..., None]).squeeze(-1)

        def packed_log_probs(rows: list[int] | None, restart: bool = True,
                             use_cache: bool = False, merged: bool = False) -> torch.Tensor:
            packed = batch.pack(rows)
            pos = packed.position_ids if restart else torch.arange(packed.num_tokens)[None]
            bounds = dict(packed.attention_kwargs) if varlen else {}
            if merged:  # the first two sequences' bound left out: one sequence to attention
                cu = torch.cat([packed.cu_seqlens[:1], packed.cu_seqlens[2:]])
                bounds.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                              max_length_q=int(cu.diff().max()), max_length_k=int(cu.diff().max()))
            out = model(input_ids=packed.input_ids, position_ids=pos, use_cache=use_cache,
                        **bounds).logits
            lp = torch.log_softmax(out.float(), -1).gather(-1, packed.targets[..., None])
            return packed.unpack_response(lp.squeeze(-1))

        valid = batch["attention_mask"][:, -R:].bool()  # policy and observation tokens
        got = packed_log_probs(None)
        assert (got - padded)[valid].abs().max() < 1e-5
        assert torch.all(got[~valid] == 0)
        rows = [4, 0, 2]
        sub = packed_log_probs(rows)
        assert (sub - padded[rows])[valid[rows]].abs().max() < 1e-5
        # controls: rows attend to each other, and the values change, when the positions do not
        # restart or a KV cache is used (transformers then skips packed-sequence detection);
        # for varlen attention, which goes by the bounds alone, when they merge two sequences
        controls = ([packed_log_probs(None, merged=True)] if varlen else
                    [packed_log_probs(None, restart=False), packed_log_probs(None, use_cache=True)])
        for leaky in controls:
            assert (leaky - padded)[valid].abs().max() > 1e-3


def test_from_groups_carries_remax_baselines_per_row() -> None:
    first, second = two_groups()
    first.baseline_reward, second.baseline_reward = 0.25, 1.0
    b = Batch.from_groups([first, second], pad_token_id=PAD)
    assert b["reward_baselines"].tolist() == (
        [0.25] * len(first.trajectories) + [1.0] * len(second.trajectories))
    assert "reward_baselines" not in Batch.from_groups(two_groups(), pad_token_id=PAD).tensors
    second.baseline_reward = None
    with pytest.raises(ValueError, match=rf"Group {second.group_id}: has no baseline_reward"):
        Batch.from_groups([first, second], pad_token_id=PAD)
