"""Cache-as-Tool: give the model two tools and let it manage its own context.

    tools = CACHE_TOOLS + my_tools
    ... the model answers with tool calls; the agent appends that assistant message ...
    ops, calls = ops_from_tool_calls(history)
    for call in calls_of(calls, len(history) - 1):      # answer the cache calls of the newest message
        history.append({"role": "tool", "tool_call_id": call.call_id, "content": call.reply()})
    reply = client.chat.completions.create(..., messages=history, extra_body={"cache": ops})

`drop_messages(message_ids)` drops earlier messages and `reposition()` renumbers what is left. A call in
assistant message a becomes an operation of the cumulative list at trigger a: `drop {a: [ids]}`,
`reposition [a]`. So the model's own message (its tool calls) still sees what it drops, and everything
after it does not; when one message holds both calls, the drops act first (docs/design.md 2.2). The model
has to know the ids: the agent can prefix what it appends with `numbered(text, id)` ("[message 7] ..."),
the form the tool descriptions mention.

The helper reads the whole history every round, so the list is cumulative by construction. A call that is
not valid (ids that do not exist, are not earlier than the call, are already dropped, or belong to roles
the model may not drop: by default only tool results and assistant messages may go) is refused whole,
with a reason the agent can return to the model as the call's result.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minakv.agent.history import Message

DROP_MESSAGES = {
    "type": "function",
    "function": {
        "name": "drop_messages",
        "description": (
            "Remove earlier messages from your context to keep it short: you will no longer see them. Use it "
            "for tool results and turns you no longer need. Messages are numbered from 0 in conversation "
            "order; a '[message N]' label gives a message's number."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "message_ids": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "numbers of earlier messages to remove",
                }
            },
            "required": ["message_ids"],
        },
    },
}
REPOSITION = {
    "type": "function",
    "function": {
        "name": "reposition",
        "description": (
            "Close the gaps that removed messages left in your context's positions. Call it after removing "
            "many messages in a long conversation."
        ),
        "parameters": {"type": "object", "properties": {}},
    },
}
CACHE_TOOLS = [DROP_MESSAGES, REPOSITION]
CACHE_TOOL_NAMES = ("drop_messages", "reposition")


@dataclass(frozen=True)
class CacheCall:
    message: int  # the assistant message that made the call: the trigger of what it does
    call_id: str | None  # the tool call's id, for the tool message that answers it
    name: str  # "drop_messages" or "reposition"
    ids: tuple[int, ...] = ()  # drop_messages: the messages it drops
    error: str | None = None  # why the call was refused (then it does nothing)

    def reply(self) -> str:
        """The text to answer the call with."""
        if self.error is not None:
            return f"error: {self.error}"
        if self.name == "drop_messages":
            return "dropped messages " + ", ".join(map(str, self.ids))
        return "repositioned"


def numbered(text: str, message_id: int) -> str:
    return f"[message {message_id}] {text}"


def calls_of(calls: Sequence[CacheCall], message: int) -> list[CacheCall]:
    return [c for c in calls if c.message == message]


def ops_from_tool_calls(
    messages: Sequence[Message],
    base: dict[str, Any] | None = None,
    droppable: tuple[str, ...] = ("tool", "assistant"),
) -> tuple[dict[str, Any], list[CacheCall]]:
    """The cumulative operations of every cache call in `messages`, merged into `base` (e.g. a policy's
    ops; not modified), and every call with its verdict, in order."""
    base = base or {}
    drops: dict[int, list[int]] = {int(t): list(ids) for t, ids in (base.get("drop") or {}).items()}
    repositions = set(base.get("reposition") or [])
    calls: list[CacheCall] = []
    for a, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            if fn.get("name") not in CACHE_TOOL_NAMES:
                continue
            verdict = _check(messages, a, call, fn, drops, droppable)
            calls.append(verdict)
            if verdict.error is None and verdict.name == "drop_messages":
                drops[a] = sorted({*drops.get(a, []), *verdict.ids})
            elif verdict.error is None:
                repositions.add(a)
    ops = {"drop": {str(t): drops[t] for t in sorted(drops)}, "reposition": sorted(repositions)}
    return ops, calls


def _check(
    messages: Sequence[Message],
    a: int,
    call: dict,
    fn: dict,
    drops: dict[int, list[int]],
    droppable: tuple[str, ...],
) -> CacheCall:
    name, call_id = fn["name"], call.get("id")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return CacheCall(a, call_id, name, error=f"the arguments are not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return CacheCall(a, call_id, name, error="the arguments must be a JSON object")
    if name == "reposition":
        return CacheCall(a, call_id, name)
    ids = args.get("message_ids")
    if not isinstance(ids, list) or not ids or any(type(i) is not int for i in ids):
        return CacheCall(a, call_id, name, error="message_ids must be a non-empty list of integers")
    # dropped by a trigger up to this message: the policy's, earlier calls', this message's earlier calls'
    gone = {i for t, dropped in drops.items() if t <= a for i in dropped}
    for i in dict.fromkeys(ids):
        if not 0 <= i < a:
            return CacheCall(a, call_id, name, error=f"message {i} is not an earlier message (this is {a})")
        role = messages[i].get("role")
        if role not in droppable:
            return CacheCall(
                a, call_id, name, error=f"message {i} is a {role} message, which cannot be dropped"
            )
        if i in gone:
            return CacheCall(a, call_id, name, error=f"message {i} is already dropped")
    return CacheCall(a, call_id, name, ids=tuple(sorted(set(ids))))
