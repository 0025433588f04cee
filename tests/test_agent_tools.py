"""Cache-as-Tool (`drop_messages`, `reposition` -> cumulative operations) and the token counter of
minakv.agent. Operations are judged by the engine's own compiler (`compile_request`)."""

from __future__ import annotations

import json

import pytest
from helpers.agent import compile_request, history

from minakv.agent import CACHE_TOOLS, CachePolicy, TokenCounter, calls_of, numbered, ops_from_tool_calls
from minakv.server.protocol import Tool


def cache_call(name: str, call_id: str, **args) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def turn(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


def answer(call: dict, text: str) -> dict:
    return {"role": "tool", "tool_call_id": call["id"], "content": text}


def test_schemas_are_openai_tools() -> None:
    import msgspec

    tools = msgspec.convert(CACHE_TOOLS, list[Tool])  # the server's own type for `tools`
    assert [t.function.name for t in tools] == ["drop_messages", "reposition"]
    assert CACHE_TOOLS[0]["function"]["parameters"]["required"] == ["message_ids"]
    assert numbered("hello", 7) == "[message 7] hello"


def test_calls_become_cumulative_operations() -> None:
    messages = history([1, 1, 1])  # 0 system, 1 user, 2 3, 4 5, 6 7 (assistant, tool)
    drop = cache_call("drop_messages", "d1", message_ids=[3, 5])
    messages.append(turn(drop, cache_call("reposition", "r1")))  # message 8
    ops, calls = ops_from_tool_calls(messages)
    assert ops == {"drop": {"8": [3, 5]}, "reposition": [8]}
    assert [(c.name, c.ids, c.error) for c in calls] == [
        ("drop_messages", (3, 5), None),
        ("reposition", (), None),
    ]
    assert [c.reply() for c in calls_of(calls, 8)] == ["dropped messages 3, 5", "repositioned"]
    messages += [answer(drop, calls[0].reply()), answer(messages[8]["tool_calls"][1], "repositioned")]
    # the next round: more messages, a second drop; the earlier operations stay as they were
    later = cache_call("drop_messages", "d2", message_ids=[7, 6])
    messages.append(turn(later))  # message 11
    ops2, calls2 = ops_from_tool_calls(messages)
    assert ops2 == {"drop": {"8": [3, 5], "11": [6, 7]}, "reposition": [8]}
    assert calls2[:2] == calls
    req = compile_request([3] * len(messages), ops2)
    active = set(req.program.owners[req.program.final_active].tolist())
    assert active == set(range(len(messages))) - {3, 5, 6, 7}


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"message_ids": [9]}, "not an earlier message"),
        ({"message_ids": [-1]}, "not an earlier message"),
        ({"message_ids": [1]}, "user message"),
        ({"message_ids": [3, 3, 0]}, "system message"),
        ({"message_ids": []}, "non-empty list"),
        ({"message_ids": [3.0]}, "non-empty list"),
        ({"message_ids": [True]}, "non-empty list"),
        ({"ids": [3]}, "non-empty list"),
    ],
)
def test_invalid_calls_are_refused_whole(args: dict, error: str) -> None:
    messages = [*history([1, 1]), turn(cache_call("drop_messages", "x", **args))]  # the call is message 6
    ops, calls = ops_from_tool_calls(messages)
    assert ops == {"drop": {}, "reposition": []}
    assert error in calls[0].error and calls[0].reply().startswith("error: ")


def test_bad_arguments_and_other_tools() -> None:
    broken = {"id": "b", "type": "function", "function": {"name": "drop_messages", "arguments": "{oops"}}
    other = {"id": "o", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages = [*history([1]), turn(broken, other)]
    ops, calls = ops_from_tool_calls(messages)
    assert ops == {"drop": {}, "reposition": []}
    assert len(calls) == 1 and "not valid JSON" in calls[0].error


def test_merged_with_a_policy() -> None:
    """The model's calls join a policy's operations; a message the policy already dropped is refused."""
    messages = history([1, 1, 1])
    policy = CachePolicy(keep_tool_results=2, reposition_every_calls=3)
    base = policy.ops(messages)
    assert base == {"drop": {"7": [3]}, "reposition": [7]}
    messages.append(turn(cache_call("drop_messages", "d", message_ids=[3])))
    _, calls = ops_from_tool_calls(messages, base)
    assert "already dropped" in calls[0].error
    messages[-1] = turn(cache_call("drop_messages", "d", message_ids=[4, 5]), cache_call("reposition", "r"))
    ops, _ = ops_from_tool_calls(messages, policy.ops(messages))
    assert ops == {"drop": {"7": [3], "8": [4, 5]}, "reposition": [7, 8]}
    assert base == {"drop": {"7": [3]}, "reposition": [7]}  # not modified
    compile_request([2] * len(messages), ops)


# ----- the token counter -----


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_model("tiny-gpt-oss")


def test_counter_counts_what_the_renderer_owns(counter: TokenCounter) -> None:
    from minakv.text.chat import render

    messages = history([2, 1])
    for tools in (None, TOOLS):
        counts = counter.count(messages, tools=tools)
        rendered = render(messages, counter.tokenizer, tools=tools)
        assert len(counts) == len(messages) + 1 and sum(counts) == len(rendered.token_ids)
        assert counts == [rendered.owners.count(m) for m in range(len(messages) + 1)]
        assert all(c > 0 for c in counts)
    # the counts feed the token-based schedule as they are (N + 1 numbers: the generation prompt last)
    policy = CachePolicy(keep_tool_results=1, reposition_after_tokens=10)
    assert policy.ops(messages, counter.count(messages))["reposition"] == [4, 6]


def test_counter_needs_a_template() -> None:
    class Bare:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        TokenCounter(Bare())
