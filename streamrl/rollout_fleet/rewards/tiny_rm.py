"""An offline tiny reward model whose reward is known: it rises with the share of one token.

No model hub is reachable here, so tests, examples and ``reward.model.path=tiny`` get a
``Qwen2ForSequenceClassification`` built from the tiny policy's tokenizer (``streamrl.testing``)
with hand-set weights:

- every token embedding has 1.0 in dimension 0, the ``token``'s also 1.0 in dimension 1; the
  other dimensions are small and random (so texts still differ in every dimension),
- one layer whose attention is uniform (zero query/key weights: every score equal) and passes
  values through unchanged (identity value and output maps), and whose MLP adds nothing: the
  last position then holds its own embedding plus the mean of the normalised embeddings of
  the whole text,
- a score head reading dimension 1.

So the reward grows with the fraction of ``token`` in prompt + response (from about 0 without
any to about 1 when the text is all ``token``): a policy can learn it, and a test can predict
which of two texts scores higher.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGET_TOKEN = "3"


def build_tiny_reward_model(out_dir: str | os.PathLike[str], token: str = TARGET_TOKEN,
                            seed: int = 0) -> Path:
    """Build (or reuse) the tiny reward model + tokenizer in ``out_dir``; returns the path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from streamrl.testing import build_tiny_tokenizer

    out = Path(out_dir)
    marker = out / "streamrl_tiny_rm.json"
    spec = {"token": token, "seed": seed, "version": 1}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out, seed=seed)
    [token_id] = tokenizer(token, add_special_tokens=False)["input_ids"]
    hidden = 64
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=4096, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 0.02)
        embed[:, 0] = 1.0
        embed[:, 1] = 0.0
        embed[token_id, 1] = 1.0
        layer = model.model.layers[0]
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        attn.v_proj.weight.copy_(torch.eye(hidden))
        attn.v_proj.bias.zero_()
        attn.o_proj.weight.copy_(torch.eye(hidden))
        layer.mlp.down_proj.weight.zero_()
        model.score.weight.zero_()
        # normalised, dimension 1 of a text of only ``token`` is about 5.7: scale that to ~1
        model.score.weight[0, 1] = 0.175
    model.save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out
