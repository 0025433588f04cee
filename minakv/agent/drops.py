"""The rolling drop: keep only the last K tool results in attention (AKV's rolling window).

With the tool results numbered TR1, TR2, ... in arrival order, the arrival of TR(K+j) drops TR(j). The
trigger is the new result's message id, so the drop acts just after it (docs/design.md 2.2): the new result
is still computed while seeing the old one, and the model's next turn is not. For K = 2:

    message    2 A1  3 TR1  4 A2  5 TR2  6 A3  7 TR3  8 A4  9 TR4
    drop                                      {7: [3]}       {9: [5]}        TR3 drops TR1, TR4 drops TR2

Targets:
- `tool`: the expired tool results themselves.
- `assistant`: the assistant message that opened a tool batch, once every result of that batch has expired
  (the tool results stay). Its trigger is the one that expires the batch's last result.
- `both`: the two together (an assistant turn leaves with its last result).

Every trigger and every dropped id depends only on messages up to the trigger, so appending messages only
adds new triggers: round r's drops are a sub-dict of round r + 1's.
"""

from __future__ import annotations

from collections.abc import Sequence

from minakv.agent.history import Message, tool_batches, tool_result_ids

TARGETS = ("tool", "assistant", "both")


def rolling_drops(messages: Sequence[Message], keep: int, target: str = "tool") -> dict[int, list[int]]:
    """{trigger: [dropped ids]} in ascending trigger order, each list ascending."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    results = tool_result_ids(messages)
    opener_of = {r: b.opener for b in tool_batches(messages) for r in b.results}
    drops: dict[int, list[int]] = {}
    for j in range(keep, len(results)):
        trigger, expired = results[j], results[j - keep]
        ids = []
        # `expired` is its batch's last result iff the next message is not a tool result. That message
        # exists (it is at most the trigger), so the answer is already final here.
        last_of_batch = not (expired + 1 < len(messages) and messages[expired + 1].get("role") == "tool")
        opener = opener_of[expired]
        if target in ("assistant", "both") and last_of_batch and opener is not None:
            ids.append(opener)
        if target in ("tool", "both"):
            ids.append(expired)
        if ids:
            drops[trigger] = ids
    return drops


def dropped_ids(drops: dict[int, list[int]]) -> set[int]:
    return {i for ids in drops.values() for i in ids}
