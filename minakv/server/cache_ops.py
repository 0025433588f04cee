"""Cache operations as clients spell them -> the engine's `{"drop": {...}, "reposition": [...]}`.

Two spellings reach the server (docs/design.md 2.2, AKV's API):
- the paper's: `"cache": {"drop": {"2": [0]}, "reposition": [2]}`;
- AKV's: `"drop_message": {"2": [0]}` or `"drop_rule": {"type": "message_drop", "drop_messages": {...}}`
  or `{"type": "thinking_drop"}`, plus `"reposition": [...]`.
Message ids are positions in `messages` as sent. Syntax is checked here, against the number of messages,
so the error names the field the client wrote; the engine re-checks the semantics against the rendering.

`thinking_drop` drops each assistant message's reasoning at the end of that same message. A message-level
drop cannot say "part of message i", so the server renders the conversation itself, finds where each
reasoning was printed (`with_sentinels`, `reasoning_spans`), cuts every message into parts at reasoning
boundaries (`split_parts`), and sends the engine a `message_tokens` prompt in which the reasoning of
message i is its own owner: the drop becomes `{last part of i: [reasoning parts]}` and the client's
message-level operations are renumbered into part ids (`ops_over_parts`).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from itertools import pairwise

from minakv.server.protocol import ChatCompletionRequest, RequestError


@dataclass
class CacheOps:
    drop: dict[int, list[int]] = field(default_factory=dict)  # trigger message -> dropped messages
    reposition: list[int] = field(default_factory=list)
    thinking_drop: bool = False
    drop_param: str = "cache.drop"  # the field the client used, for error messages
    reposition_param: str = "cache.reposition"

    def engine_form(self) -> dict:
        """The engine's cache dict (message-level operations only)."""
        return {"drop": {n: list(ids) for n, ids in self.drop.items()}, "reposition": list(self.reposition)}


def has_cache_ops(req: ChatCompletionRequest) -> bool:
    """Whether the request carries any cache-operation field (AKV's "context mode": usage details)."""
    return any(f is not None for f in (req.cache, req.drop_message, req.drop_rule, req.reposition))


def parse_cache_ops(req: ChatCompletionRequest) -> CacheOps | None:
    """Read the operations of either spelling from `req`, checked against len(req.messages)."""
    if not has_cache_ops(req):
        return None
    if req.cache is not None and (req.drop_message is not None or req.drop_rule is not None):
        raise RequestError("give drops either in `cache` or in `drop_message`/`drop_rule`, not both", "cache")
    if req.cache is not None and req.reposition is not None:
        raise RequestError(
            "give `reposition` either inside `cache` or at the top level, not both", "reposition"
        )
    if req.drop_message is not None and req.drop_rule is not None:
        raise RequestError(
            "`drop_message` and `drop_rule` are two forms of the same drop; give one", "drop_rule"
        )
    ops = CacheOps()
    if req.cache is not None:
        ops.drop = dict(req.cache.drop or {})
        ops.reposition = list(req.cache.reposition or [])
    else:
        ops.reposition_param = "reposition"
        ops.reposition = list(req.reposition or [])
        if req.drop_message is not None:
            ops.drop, ops.drop_param = dict(req.drop_message), "drop_message"
        elif req.drop_rule is not None:
            ops.drop, ops.thinking_drop, ops.drop_param = read_drop_rule(req.drop_rule)
    check_drops(ops.drop, ops.drop_param)
    check_reposition(ops.reposition, ops.reposition_param)
    return ops


def read_drop_rule(rule) -> tuple[dict[int, list[int]], bool, str]:
    if rule.type == "message_drop":
        if rule.drop_messages is None:
            raise RequestError(
                "drop_rule of type message_drop needs `drop_messages`", "drop_rule.drop_messages"
            )
        return dict(rule.drop_messages), False, "drop_rule.drop_messages"
    if rule.type == "thinking_drop":
        if rule.drop_messages is not None:
            raise RequestError(
                "drop_rule of type thinking_drop takes no `drop_messages`", "drop_rule.drop_messages"
            )
        return {}, True, "drop_rule"
    raise RequestError(
        f"unknown drop_rule type {rule.type!r}: expected 'message_drop' or 'thinking_drop'", "drop_rule.type"
    )


MAX_ID = 2**31 - 1  # message ids past this are certainly not messages (and overflow int64 arithmetic)


def check_drops(drop: dict[int, list[int]], param: str) -> None:
    """Trigger n drops messages i <= n (so ids are < len(messages) whenever the trigger is); a trigger
    >= len(messages) is a future event, accepted and ignored."""
    for trigger, ids in drop.items():
        if trigger > MAX_ID or any(i > MAX_ID for i in ids):
            raise RequestError(f"{param}: message ids must be below 2**31", param)
        if trigger < 0:
            raise RequestError(f"{param}: trigger message id {trigger} is negative", param)
        for i in ids:
            if i < 0:
                raise RequestError(f"{param}[{trigger}]: dropped message id {i} is negative", param)
            if i > trigger:
                raise RequestError(
                    f"{param}[{trigger}]: message {i} is after its trigger {trigger}; a drop can only remove "
                    "messages up to and including the one that triggers it",
                    param,
                )


def check_reposition(reposition: list[int], param: str) -> None:
    for a, b in pairwise(reposition):
        if b <= a:
            raise RequestError(f"{param} must be strictly increasing message ids, got {reposition}", param)
    if reposition and reposition[0] < 0:
        raise RequestError(f"{param}: message id {reposition[0]} is negative", param)
    if reposition and reposition[-1] > MAX_ID:
        raise RequestError(f"{param}: message ids must be below 2**31", param)


# ---------------------------------------------------------------------------------------------------------
# thinking_drop: parts of messages, cut at reasoning boundaries


@dataclass
class Parts:
    token_ids: list[list[int]]  # one token list per part (= per owner in the engine's message_tokens form)
    of_message: list[list[int]]  # message id -> its part ids, in order (possibly empty)
    reasoning: list[bool]  # per part: holds an assistant message's reasoning


def split_parts(token_ids: list[int], owners: list[int], reasoning: list[bool], num_messages: int) -> Parts:
    """Cut the rendered tokens wherever the owner or the reasoning flag changes. Owners must be monotone
    (0..num_messages; the generation prompt is owner num_messages)."""
    if not (len(token_ids) == len(owners) == len(reasoning)):
        raise ValueError("token_ids, owners and reasoning flags must have the same length")
    segs = Parts([], [[] for _ in range(num_messages + 1)], [])
    prev: tuple[int, bool] | None = None
    for tok, owner, flag in zip(token_ids, owners, reasoning):
        owner = min(max(owner, 0), num_messages)
        if prev is not None and owner < prev[0]:
            raise ValueError(f"token owners are not monotone ({prev[0]} then {owner})")
        if (owner, flag) != prev:
            segs.of_message[owner].append(len(segs.token_ids))
            segs.token_ids.append([])
            segs.reasoning.append(flag)
            prev = (owner, flag)
        segs.token_ids[-1].append(tok)
    return segs


def _last_part_upto(segs: Parts, message: int) -> int | None:
    """The last part of the latest message <= `message` that owns tokens: a boundary placed after
    message m is the first token after that part."""
    for m in range(min(message, len(segs.of_message) - 1), -1, -1):
        if segs.of_message[m]:
            return segs.of_message[m][-1]
    return None


def ops_over_parts(ops: CacheOps, segs: Parts, num_messages: int) -> dict:
    """The engine's cache dict over part ids: message operations renumbered, plus the reasoning drops
    when `ops.thinking_drop`. Operations after the last message (future events) are left out."""
    drop: dict[int, set[int]] = {}
    for trigger, ids in ops.drop.items():
        if trigger >= num_messages:
            continue
        at = _last_part_upto(segs, trigger)
        dropped = {s for i in ids for s in segs.of_message[i]}
        if at is not None and dropped:
            drop.setdefault(at, set()).update(dropped)
    if ops.thinking_drop:
        for m in range(num_messages):
            mine = [s for s in segs.of_message[m] if segs.reasoning[s]]
            if mine:
                drop.setdefault(segs.of_message[m][-1], set()).update(mine)
    reposition = sorted(
        {s for m in ops.reposition if m < num_messages and (s := _last_part_upto(segs, m)) is not None}
    )
    return {"drop": {n: sorted(ids) for n, ids in sorted(drop.items())}, "reposition": reposition}


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as the renderer reads them, in order


def reasoning_of(message: dict, index: int) -> tuple[str | None, bool]:
    """An assistant message's reasoning as sent (None if absent or blank), and whether it is inline: one
    leading `<think>...</think>` in the content (MiniMax clients replay it that way). Both at once is
    ambiguous, an unclosed tag malformed."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    content = message.get("content")
    inline = None
    if isinstance(content, str) and content.lstrip().startswith("<think>"):
        body = content.lstrip()[len("<think>") :]
        if "</think>" not in body:
            raise RequestError("thinking_drop: unclosed <think> in the content", f"messages[{index}].content")
        inline = body.split("</think>", 1)[0]
    if isinstance(reasoning, str) and reasoning.strip() and inline is not None:
        raise RequestError(
            "thinking_drop: reasoning given both as reasoning_content and as <think> in the content",
            f"messages[{index}]",
        )
    if isinstance(reasoning, str) and reasoning.strip():
        return reasoning, False
    return (inline, True) if inline is not None and inline.strip() else (None, False)


SENTINEL = "\ue000{}\ue001"  # private-use characters: never in real text, printed as is by templates


def with_sentinels(messages: list[dict]) -> tuple[list[dict], dict[str, tuple[int, str]]]:
    """A copy of `messages` whose assistant reasoning is replaced by a unique sentinel each, and
    sentinel -> (message index, reasoning as sent)."""
    out, where = [], {}
    for i, message in enumerate(messages):
        reasoning, inline = reasoning_of(message, i) if message.get("role") == "assistant" else (None, False)
        if reasoning is None:
            out.append(message)
            continue
        mark = SENTINEL.format(i)
        where[mark] = (i, reasoning)
        if inline:  # replace just the body of <think>...</think>
            head, rest = message["content"].split("<think>", 1)
            copy = {**message, "content": head + "<think>" + mark + "</think>" + rest.split("</think>", 1)[1]}
        else:
            copy = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
            copy["reasoning_content"] = mark
        out.append(copy)
    return out, where


def reasoning_spans(text: str, marked: str, where: dict[str, tuple[int, str]]) -> list[tuple[int, int]]:
    """Character spans of the reasoning in `text`, found by lining it up with `marked` (the same
    conversation rendered with sentinels): outside the reasoning the two are equal, so each sentinel
    stands exactly where its reasoning was printed. A template may trim the reasoning; the printed form
    is the candidate followed by the next literal piece. A template that does not print a message's
    reasoning (GPT-OSS leaves out analysis of finished turns) has no sentinel for it."""
    pattern = re.compile("|".join(re.escape(m) for m in where)) if where else None
    spans: list[tuple[int, int]] = []
    at_marked, at_text = 0, 0
    for match in pattern.finditer(marked) if pattern else ():
        literal = marked[at_marked : match.start()]
        if text[at_text : at_text + len(literal)] != literal:
            raise ValueError("thinking_drop: the template renders the conversation differently each time")
        at_text += len(literal)
        at_marked = match.end()
        nxt = pattern.search(marked, at_marked)
        following = marked[at_marked : nxt.start() if nxt else len(marked)]
        reasoning = where[match.group()][1]
        for printed in dict.fromkeys((reasoning, reasoning.strip(), reasoning.strip("\n"))):
            if text.startswith(printed, at_text) and text.startswith(following, at_text + len(printed)):
                spans.append((at_text, at_text + len(printed)))
                at_text += len(printed)
                break
        else:
            raise ValueError("thinking_drop: cannot find where the template printed the reasoning")
    return spans


def reasoning_flags(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: does its first character lie inside a reasoning span? The markup around the reasoning
    (`<think>`, the harmony analysis header) is not reasoning and stays."""
    starts = [a for a, _ in spans]
    flags = []
    for start, _ in offsets:
        k = bisect.bisect_right(starts, start) - 1
        flags.append(k >= 0 and start < spans[k][1])
    return flags
