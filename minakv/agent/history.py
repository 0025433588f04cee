r"""Reading an agent's message list: which messages are tool results, and how they group into tool batches.

An OpenAI-style agent history looks like this (message ids are indices in the list, as the server numbers
them; docs/design.md 2.2):

    0 system | 1 user | 2 assistant (calls a, b) | 3 tool a | 4 tool b | 5 assistant (calls c) | 6 tool c | ...
                        \______________ batch 1 ______________/          \_______ batch 2 _______/

A **tool batch** is an assistant message that calls tools (its *opener*) and the run of tool messages right
after it. The batch is **complete** once its last result is known; its **boundary** is that result's id:
the point where the agent sends its next request and the model reads the results. A batch is complete
when it has as many results as its opener made calls, or, if the opener does not say (no `tool_calls`), as
soon as some other message follows the run. Either way the answer for a message never changes when more
messages are appended, which is what keeps the operations built from it cumulative (docs/agent.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolBatch:
    opener: int | None  # the assistant message that made the calls (None: the run follows another role)
    results: tuple[int, ...]  # ids of its tool results, in order
    boundary: int | None  # id of the result that completes the batch; None while results are missing


def is_tool_result(message: Message) -> bool:
    return message.get("role") == "tool"


def tool_result_ids(messages: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if is_tool_result(m)]


def tool_batches(messages: Sequence[Message]) -> list[ToolBatch]:
    """Every run of consecutive tool messages, as a batch (complete or not), in order."""
    batches: list[ToolBatch] = []
    i, n = 0, len(messages)
    while i < n:
        if not is_tool_result(messages[i]):
            i += 1
            continue
        start = i
        while i < n and is_tool_result(messages[i]):
            i += 1
        results = tuple(range(start, i))
        before = messages[start - 1] if start > 0 else None
        opener = start - 1 if before is not None and before.get("role") == "assistant" else None
        calls = len(before.get("tool_calls") or []) if opener is not None else 0
        if calls and len(results) >= calls:
            boundary: int | None = results[calls - 1]  # results past the declared calls join the batch
        elif i < n:
            boundary = results[-1]  # another message follows: nothing more will join
        else:
            boundary = None
        batches.append(ToolBatch(opener, results, boundary))
    return batches


def call_boundaries(messages: Sequence[Message]) -> list[int]:
    """The boundary of each complete tool batch, in order: the legal reposition points."""
    return [b.boundary for b in tool_batches(messages) if b.boundary is not None]
