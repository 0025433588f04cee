"""Tokens per message, counted the way the server counts them: one rendering, token ownership.

The token-based reposition schedule needs the length of the history in tokens. Rendering each message on
its own would count differently (templates look at neighbours, BPE merges across seams), so the counter
does what the server does (minakv/text/chat.py): render the whole conversation once with the model's chat
template, tokenize once, and count the tokens each message owns (docs/design.md 2.1). The counts match
the server's exactly when the counter gets what the server renders: the same messages, the same `tools`
(the server renders them only with tool_choice "auto") and the same template arguments
(`reasoning_effort`, `chat_template_kwargs`).

The tokenizer and the template engine load on first use, so `import minakv.agent` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minakv.agent.history import Message


class TokenCounter:
    """`count(messages)` -> tokens per message, then the generation prompt's (N + 1 numbers)."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a minakv Tokenizer (`engine.tokenizer`, or `TokenCounter.from_model`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template, so messages cannot be counted")
        self.tokenizer = tokenizer

    @classmethod
    def from_model(cls, model: str | Path) -> TokenCounter:
        """From a preset name, a checkpoint directory or a hub id (the tokenizer files only are read)."""
        from minakv.presets import resolve_model
        from minakv.text.tokenizer import Tokenizer

        return cls(Tokenizer.from_dir(resolve_model(model)))

    def count(
        self, messages: Sequence[Message], tools: list[dict] | None = None, **template_kwargs: Any
    ) -> list[int]:
        from minakv.text.chat import render

        rendered = render(list(messages), self.tokenizer, tools=tools, **template_kwargs)
        counts = [0] * (rendered.num_messages + 1)
        for owner in rendered.owners:
            counts[owner] += 1
        return counts
