"""`CachePolicy`: an agent's message list -> the cache operations (or the shortened text) to send with it.

    policy = CachePolicy(keep_tool_results=12, reposition_every_calls=4)
    reply = client.chat.completions.create(model=..., messages=policy.messages(history),
                                           extra_body=policy.extra_body(history))

The policy is a pure function of the history: no state, nothing remembered between rounds. Each round it
computes the whole cumulative list again, and because every decision about message m depends only on
messages up to m (and their token counts), round r + 1's operations extend round r's: every trigger of
round r keeps its list, and round r's repositions are a prefix of round r + 1's. That is what lets the
server reuse the KV of every earlier round (docs/design.md 3.1). The schedules themselves are in drops.py
(rolling drop) and reposition.py (call- and token-based reposition); docs/agent.md has the pictures.

Modes:
- `kv_drop`: the messages go as they are and the operations change what the model attends to.
- `text_drop`: the baseline of "text engineering": the messages kv_drop would drop are deleted from the
  text (`messages`), and no operations are sent. Everything after the first deleted message is new text,
  so the server recomputes it every round.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minakv.agent.drops import TARGETS, dropped_ids, rolling_drops
from minakv.agent.history import Message, call_boundaries
from minakv.agent.reposition import reposition_points

MODES = ("kv_drop", "text_drop")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # as the server's renderer reads them
_INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class CachePolicy:
    """What to drop and when to reposition (see the module docstring and docs/agent.md).

    keep_tool_results: K, the tool results kept in attention (None: no rolling drop).
    target: "tool", "assistant" or "both" (drops.py).
    reposition_every_calls / reposition_first_call: the call-based schedule, i and a (a defaults to i).
    reposition_after_tokens: the token-based threshold T (REPOSITION_AFTER_TOKENS is AKV's 98,304).
    thinking_drop: drop assistant reasoning at the end of its message (kv_drop: the server's drop_rule;
        text_drop: deleted from the text).
    """

    keep_tool_results: int | None = None
    target: str = "tool"
    reposition_every_calls: int | None = None
    reposition_after_tokens: int | None = None
    thinking_drop: bool = False
    mode: str = "kv_drop"
    reposition_first_call: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_tool_results", "reposition_every_calls", "reposition_after_tokens",
                     "reposition_first_call"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.reposition_first_call is not None and self.reposition_every_calls is None:
            raise ValueError("reposition_first_call needs reposition_every_calls")
        repositions = self.reposition_every_calls is not None or self.reposition_after_tokens is not None
        if self.mode == "text_drop" and repositions:
            raise ValueError("text_drop sends no cache operations, so it cannot reposition")
        if self.mode == "kv_drop" and self.thinking_drop and self.keep_tool_results is not None:
            # The server takes thinking_drop only as `drop_rule`, which excludes message drops (cache_ops.py).
            raise ValueError("the server cannot combine thinking_drop with message drops in one request")

    # ----- kv_drop -----

    def ops(self, messages: Sequence[Message], token_counts: Sequence[int] | None = None) -> dict[str, Any]:
        """The cumulative operations for this history: `{"drop": {"<trigger>": [ids]}, "reposition": [ids]}`
        (trigger keys are strings, as in JSON). `token_counts`: tokens per message as the server renders
        them, optionally followed by the generation prompt's (TokenCounter.count gives exactly that);
        needed by the token-based schedule only. text_drop: no operations."""
        if self.mode == "text_drop":
            return {"drop": {}, "reposition": []}
        counts, generation = _split_counts(token_counts, len(messages))
        drops = self._drops(messages)
        holes = [i for i, m in enumerate(messages) if self.thinking_drop and _has_reasoning(m)]
        reposition = reposition_points(
            call_boundaries(messages),
            drops,
            counts,
            every=self.reposition_every_calls,
            first=self.reposition_first_call,
            after_tokens=self.reposition_after_tokens,
            generation_tokens=generation,
            extra_holes=holes,
        )
        return {"drop": {str(t): ids for t, ids in drops.items()}, "reposition": reposition}

    def extra_body(self, messages: Sequence[Message], token_counts: Sequence[int] | None = None) -> dict:
        """The request fields to send (the `openai` client's `extra_body`): `{"cache": ops}`, or with
        thinking_drop AKV's `drop_rule` plus a top-level `reposition`; text_drop: nothing."""
        if self.mode == "text_drop":
            return {}
        ops = self.ops(messages, token_counts)
        if self.thinking_drop:
            return {"drop_rule": {"type": "thinking_drop"}, "reposition": ops["reposition"]}
        return {"cache": ops}

    # ----- text_drop -----

    def messages(self, messages: Sequence[Message]) -> list[Message]:
        """The messages to send: text_drop deletes what kv_drop would drop (and the reasoning, with
        thinking_drop); kv_drop sends them unchanged."""
        if self.mode == "kv_drop":
            return list(messages)
        gone = dropped_ids(self._drops(messages))
        kept = [m for i, m in enumerate(messages) if i not in gone]
        return [_without_reasoning(m) for m in kept] if self.thinking_drop else kept

    def _drops(self, messages: Sequence[Message]) -> dict[int, list[int]]:
        if self.keep_tool_results is None:
            return {}
        return rolling_drops(messages, self.keep_tool_results, self.target)


def _split_counts(token_counts: Sequence[int] | None, n: int) -> tuple[list[int] | None, int]:
    """(tokens per message, generation prompt tokens) from N or N + 1 counts."""
    if token_counts is None:
        return None, 0
    counts = list(token_counts)
    if len(counts) not in (n, n + 1):
        raise ValueError(f"token_counts has {len(counts)} entries for {n} messages (expected {n} or {n + 1})")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError("token_counts must be non-negative integers")
    return counts[:n], counts[n] if len(counts) > n else 0


def _has_reasoning(message: Message) -> bool:
    if message.get("role") != "assistant":
        return False
    if any(isinstance(message.get(k), str) and message[k].strip() for k in REASONING_FIELDS):
        return True
    content = message.get("content")
    inline = _INLINE_THINK.match(content) if isinstance(content, str) else None
    return inline is not None and bool(inline.group(1).strip())


def _without_reasoning(message: Message) -> Message:
    if not _has_reasoning(message):
        return message
    out = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    if isinstance(out.get("content"), str):
        out["content"] = _INLINE_THINK.sub("", out["content"], count=1)
    return out
