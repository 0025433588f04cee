"""Server pieces that need no engine: request decoding errors, cache-operation forms, segment renumbering."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minakv.cache.program import compile_program
from minakv.server.cache_ops import ops_over_parts, parse_cache_ops, split_parts
from minakv.server.prompts import chat_prompt, completion_prompt, sampling_params
from minakv.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, decode_request

MSGS = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "q"},
]


def chat(**extra) -> ChatCompletionRequest:
    return decode_request(
        json.dumps({"model": "m", "messages": MSGS, **extra}).encode(), ChatCompletionRequest
    )


def prompt_of(body: dict):
    return chat_prompt(decode_request(json.dumps(body).encode(), ChatCompletionRequest), body)


def error_of(fn, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{not json", None, "Invalid JSON"),
        (b"[]", None, "Expected `object`"),
        (b'{"messages": []}', None, "missing required field `model`"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role", "wizard"),
        (b'{"model": "m", "messages": [], "max_tokens": "many"}', "max_tokens", "Expected `int | null`"),
        (b'{"model": "m", "messages": [], "temperature": true}', "temperature", "Expected `float | null`"),
        (b'{"model": "m", "messages": [], "drop_message": {"x": [0]}}', "drop_message", "Expected `int`"),
        (
            b'{"model": "m", "messages": [], "cache": {"drop": {}, "extra": 1}}',
            "cache",
            "unknown field `extra`",
        ),
    ],
)
def test_decode_errors_name_the_field(body: bytes, param: str | None, words: str) -> None:
    err = error_of(decode_request, body, ChatCompletionRequest)
    assert err.status == 400 and err.param == param and words in err.message


def test_both_forms_and_paper_form() -> None:
    ops = parse_cache_ops(chat(cache={"drop": {"2": [0, 1]}, "reposition": [2]}))
    assert ops.engine_form() == {"drop": {2: [0, 1]}, "reposition": [2]}
    ops = parse_cache_ops(chat(drop_message={"3": [1, 2]}, reposition=[3]))
    assert ops.engine_form() == {"drop": {3: [1, 2]}, "reposition": [3]} and ops.drop_param == "drop_message"
    ops = parse_cache_ops(chat(drop_rule={"type": "message_drop", "drop_messages": {"2": [0]}}))
    assert ops.engine_form() == {"drop": {2: [0]}, "reposition": []}
    ops = parse_cache_ops(chat(drop_rule={"type": "thinking_drop"}))
    assert ops.thinking_drop and ops.drop == {}
    assert parse_cache_ops(chat()) is None
    assert parse_cache_ops(chat(drop_message={})) is not None  # present-but-empty is still "context mode"
    # the engine form goes into the prompt as is
    prompt, ops, _ = prompt_of({"model": "m", "messages": MSGS, "drop_message": {"3": [1]}})
    assert prompt["cache"] == {"drop": {3: [1]}, "reposition": []}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"drop_message": {"2": [0]}, "drop_rule": {"type": "thinking_drop"}}, "drop_rule", "give one"),
        ({"cache": {"drop": {"2": [0]}}, "drop_message": {"2": [0]}}, "cache", "not both"),
        ({"cache": {"reposition": [1]}, "reposition": [2]}, "reposition", "not both"),
        ({"drop_message": {"1": [2]}}, "drop_message", "after its trigger"),
        ({"drop_message": {"-1": [0]}}, "drop_message", "negative"),
        ({"cache": {"drop": {"2": [-1]}}}, "cache.drop", "negative"),
        ({"reposition": [2, 2]}, "reposition", "strictly increasing"),
        ({"cache": {"reposition": [3, 1]}}, "cache.reposition", "strictly increasing"),
        ({"drop_rule": {"type": "text_drop"}}, "drop_rule.type", "unknown drop_rule type"),
        ({"drop_message": {str(2**70): [0]}}, "drop_message", "below 2**31"),
        ({"reposition": [1, 2**40]}, "reposition", "below 2**31"),
        ({"drop_rule": {"type": "message_drop"}}, "drop_rule.drop_messages", "needs `drop_messages`"),
    ],
)
def test_invalid_operations(extra: dict, param: str, words: str) -> None:
    err = error_of(parse_cache_ops, chat(**extra))
    assert err.status == 400 and err.param == param and words in err.message


def test_chat_prompt_checks() -> None:
    base = {"model": "m", "messages": MSGS}
    assert error_of(prompt_of, {**base, "tool_choice": "required"}).param == "tool_choice"
    assert error_of(prompt_of, {**base, "reasoning_effort": "max"}).param == "reasoning_effort"
    assert error_of(prompt_of, {**base, "messages": []}).param == "messages"
    parts = [{"role": "user", "content": [{"type": "image_url"}]}]
    assert error_of(prompt_of, {**base, "messages": parts}).param == "messages[0].content[0]"
    # messages and tools reach the template as sent (key order too: templates `tojson` the tools)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "x"}]
    body = {"model": "m", "messages": msgs, "tools": tools, "reasoning_effort": "low"}
    prompt, ops, tools_on = prompt_of(body)
    assert tools_on and ops is None
    assert prompt == {"messages": msgs, "tools": tools, "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert list(prompt["tools"][0]) == ["type", "function"]
    # tool_choice none: the tools are not rendered (and calls are not parsed)
    prompt, _, tools_on = prompt_of({**body, "tool_choice": "none"})
    assert not tools_on and "tools" not in prompt


def test_sampling_params_errors_name_the_field() -> None:
    err = error_of(sampling_params, chat(temperature=-1.0), 8, None)
    assert err.param == "temperature" and "temperature" in err.message
    err = error_of(sampling_params, chat(top_p=0.0), 8, None)
    assert err.param == "top_p"
    assert error_of(sampling_params, chat(seed=2**64), 8, None).param == "seed"
    params = sampling_params(chat(temperature=0.0, seed=3, stop=["x"]), 8, 2)
    assert (params.temperature, params.seed, params.stop, params.max_tokens, params.logprobs) == (
        0.0,
        3,
        ["x"],
        8,
        2,
    )


def test_completion_prompts() -> None:
    def req(prompt):
        return decode_request(json.dumps({"model": "m", "prompt": prompt}).encode(), CompletionRequest)

    assert completion_prompt(req("hi")) == "hi"
    assert completion_prompt(req([1, 2, 3])) == [1, 2, 3]
    assert completion_prompt(req([[1, 2]])) == [1, 2]
    assert "batched" in error_of(completion_prompt, req(["a", "b"])).message
    assert error_of(completion_prompt, req([1, "a"])).param == "prompt"
    assert error_of(completion_prompt, req([])).param == "prompt"
    assert error_of(completion_prompt, req([-1])).param == "prompt"


def walk_visible_until(owners: list[int], num_messages: int, cache: dict) -> np.ndarray:
    return compile_program(owners, num_messages, cache["drop"], cache["reposition"]).visible_until


def test_thinking_drop_segments_drop_reasoning_at_end_of_its_message() -> None:
    # messages: 0 user, 1 assistant (header, reasoning, content), 2 user, 3 assistant (reasoning only at the
    # start), then the generation prompt (owner 4)
    owners = [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4]
    reasoning = [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    tokens = list(range(100, 100 + len(owners)))
    segs = split_parts(tokens, owners, [bool(r) for r in reasoning], 4)
    assert [len(s) for s in segs.token_ids] == [2, 1, 2, 3, 2, 1, 2, 1]
    assert segs.of_message == [[0], [1, 2, 3], [4], [5, 6], [7]]
    assert [t for s in segs.token_ids for t in s] == tokens
    ops = parse_cache_ops(chat(drop_rule={"type": "thinking_drop"}, reposition=[2]))
    cache = ops_over_parts(ops, segs, 4)
    assert cache == {"drop": {3: [2], 6: [5]}, "reposition": [4]}
    seg_owners = [i for i, s in enumerate(segs.token_ids) for _ in s]
    visible = walk_visible_until(seg_owners, len(segs.token_ids) - 1, cache)
    never = np.iinfo(np.int64).max
    # reasoning of message 1 (tokens 3,4) vanishes at the first token after message 1 (token 8); message 3's
    # reasoning (token 10) at the first generation-prompt token (13); nothing else is dropped
    expected = [never] * len(owners)
    expected[3] = expected[4] = 8
    expected[10] = 13
    assert visible.tolist() == expected


def test_message_ops_renumbered_into_segments() -> None:
    owners = [0, 0, 1, 1, 1, 2, 3, 3]
    reasoning = [False, False, False, True, False, False, False, False]
    segs = split_parts(list(range(8)), owners, reasoning, 3)
    req = chat(drop_message={"2": [1], "7": [0]}, reposition=[1, 9])  # 7 and 9: future events, left out
    cache = ops_over_parts(parse_cache_ops(req), segs, 3)
    assert cache == {"drop": {4: [1, 2, 3]}, "reposition": [3]}
    seg_owners = [i for i, s in enumerate(segs.token_ids) for _ in s]
    msg_prog = compile_program(owners, 3, {2: [1]}, [1])
    seg_prog = compile_program(seg_owners, len(segs.token_ids) - 1, cache["drop"], cache["reposition"])
    assert seg_prog.visible_until.tolist() == msg_prog.visible_until.tolist()
    assert seg_prog.birth_pos.tolist() == msg_prog.birth_pos.tolist()


@pytest.mark.parametrize("reasoning", ["a", "think about it", "ai", "\nai\n"])
@pytest.mark.parametrize("inline", [False, True])
def test_thinking_drop_flags_exactly_the_reasoning(reasoning: str, inline: bool) -> None:
    """The reasoning segment is exactly the reasoning as rendered, even when the same text also occurs in
    the header (MiniMax's assistant header is `]~b]ai`), given as reasoning_content or inline <think>."""
    from minakv.presets import resolve_model
    from minakv.server.prompts import thinking_drop_prompt
    from minakv.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model("tiny-minimax-m2"))
    reply = {"role": "assistant", "content": "a reply", "reasoning_content": reasoning}
    if inline:
        reply = {"role": "assistant", "content": f"<think>{reasoning}</think>a reply"}
    msgs = [{"role": "user", "content": "hello"}, reply, {"role": "user", "content": "again"}]
    ops = parse_cache_ops(chat(drop_rule={"type": "thinking_drop"}))
    prompt = thinking_drop_prompt(tok, {"messages": msgs}, ops)
    ((trigger, dropped),) = prompt["cache"]["drop"].items()
    segments = prompt["message_tokens"]
    assert tok.decode(segments[dropped[0]]).strip("\n") == reasoning.strip("\n") and len(dropped) == 1
    assert tok.decode([t for s in segments[: dropped[0]] for t in s]).endswith("<think>")  # not the header
    assert tok.decode(segments[trigger]).endswith("[e~[\n")  # dropped at the end of its own message
