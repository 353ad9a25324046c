"""RewardModelServer: a discriminative reward model, served to every replica from one actor.

The model is an HF ``AutoModelForSequenceClassification`` checkpoint with one label (verl's
``reward_model``); the reward is that label's logit at the last token of prompt + response. As
in verl, the RM reads the conversation in its own format: the prompt's messages plus the
response as an assistant turn, rendered with the RM tokenizer's chat template (or, without one,
the prompt text followed by the response), then tokenized with the RM's tokenizer.

Calls are micro-batched (``batching.MicroBatcher``): the n responses of a group, scored
together by the replica, usually share one forward. Texts are right-padded (padding then never
moves a real token's position, so a text scores the same in any batch) and truncated on the
left to ``max_length`` (the head reads the last token).

``runtime`` places it in a Ray actor (``remote.start_reward_servers``); tests may use it in
process: ``await setup()``, then ``await score(prompt, response, ground_truth)``.
"""

from __future__ import annotations

import threading
from typing import Any

from streamrl.config import RewardModelConfig
from streamrl.errors import ConfigError
from streamrl.rollout_fleet.rewards.batching import MicroBatcher
from streamrl.rollout_fleet.rewards.prompt import PromptLike, as_messages, as_text


class RewardModelServer:
    def __init__(self, cfg: RewardModelConfig, path: str) -> None:
        """``path``: ``cfg.path`` resolved (``remote.resolve_paths``)."""
        self.cfg, self.path = cfg, path
        self.model: Any = None
        self._lock = threading.Lock()
        self._forwards = 0
        self._texts = 0
        self._batcher = MicroBatcher(self.forward, cfg.micro_batch_size, cfg.batch_wait_s)

    async def setup(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or self.path)
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=getattr(torch, cfg.dtype))
        if model.config.num_labels != 1:
            raise ConfigError(f"reward.model.path={cfg.path!r}: the head has "
                              f"{model.config.num_labels} labels; a reward model has one")
        if model.config.pad_token_id is None:  # HF pools at the last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer, self.model = tokenizer, model.to(device).eval()
        self._templated = cfg.apply_chat_template and bool(tokenizer.chat_template)

    def text(self, prompt: PromptLike, response: str) -> str:
        """What the RM reads for ``response`` to ``prompt``."""
        if self._templated:
            chat = [*as_messages(prompt), {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(chat, tokenize=False))
        return as_text(prompt) + response

    def forward(self, texts: list[str]) -> list[float]:
        """One forward over ``texts``: each one's reward."""
        import torch

        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.cfg.max_length,
            return_tensors="pt",
            # a chat template writes its own special tokens: do not add a second BOS
            add_special_tokens=not self._templated,
        ).to(self.model.device)
        with torch.inference_mode():
            logits = self.model(**batch).logits[:, 0].float()
        with self._lock:
            self._forwards += 1
            self._texts += len(texts)
        return [float(x) for x in logits.cpu()]

    async def score(self, prompt: PromptLike, response: str, ground_truth: str | None) -> float:
        """The reward of ``response`` to ``prompt`` (the RM ignores the ground truth)."""
        if self.model is None:
            raise RuntimeError("RewardModelServer: call setup() first")
        return await self._batcher.submit(self.text(prompt, response))

    def stats(self) -> dict[str, float]:
        """Forward passes and texts scored since start (texts / passes: the batch size)."""
        with self._lock:
            return {"forward_passes": float(self._forwards), "texts": float(self._texts)}

    async def shutdown(self) -> None:
        await self._batcher.close()
