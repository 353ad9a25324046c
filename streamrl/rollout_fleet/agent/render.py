"""Chat rendering for token-in/token-out episodes: the first prompt, then only deltas.

``ChatRenderer.prompt(messages, tools)`` renders the first messages with the tokenizer's chat
template (``tools=`` schemas, generation prompt) into ids. ``ChatRenderer.observation(messages,
turn_ids)`` renders messages that follow an assistant turn as the chat-template *delta*: the
template is applied to ``[anchor user, anchor assistant, *messages]`` and only the text after
the anchor assistant's content is kept, i.e. the template's end of the assistant turn, the new
messages and the next generation prompt. Nothing before it (BOS, system prompt, tool list) is
rendered again, and the history itself is never decoded or re-encoded: an episode's ids are
the first prompt, the engine's sampled ids and these deltas, concatenated.

If the model closed its turn itself (its last sampled id is the token the delta opens with,
e.g. ``<|im_end|>``), that token is not added twice; if the turn was cut by its token cap, the
delta's closing token ends the turn as an observation token.

Depends on nothing else in streamrl (duck-typed HF tokenizer).
"""

from __future__ import annotations

from typing import Any

_ANCHOR = "streamrl-delta-anchor"
_ANCHOR_MESSAGES = [{"role": "user", "content": _ANCHOR + "-user"},
                    {"role": "assistant", "content": _ANCHOR + "-assistant"}]


class ChatRenderer:
    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("agent episodes need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    def _text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
            **self.template_kwargs)

    def _ids(self, text: str) -> list[int]:
        # The template text already holds any BOS it wants: never add special tokens again.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
               ) -> list[int]:
        """Ids of the first messages, ending with the generation prompt."""
        if not messages:
            raise ValueError("environment reset() returned no messages")
        return self._ids(self._text(messages, tools))

    def delta_text(self, messages: list[dict[str, Any]]) -> str:
        """What the template adds after an assistant turn's content for ``messages``."""
        full = self._text([*_ANCHOR_MESSAGES, *messages], None)
        anchor = _ANCHOR_MESSAGES[1]["content"]
        if full.count(anchor) != 1:
            raise ValueError("the chat template does not render assistant content verbatim; "
                             "cannot render observations as a delta")
        return full[full.index(anchor) + len(anchor):]

    def observation(self, messages: list[dict[str, Any]], turn_ids: list[int]) -> list[int]:
        """Ids to append after an assistant turn whose sampled ids were ``turn_ids``."""
        ids = self._ids(self.delta_text(messages))
        if ids and turn_ids and ids[0] == turn_ids[-1]:
            ids = ids[1:]  # the model already sampled the turn's closing token
        return ids
