"""minakv.agent's CachePolicy, option by option, on small hand-checked histories (docs/agent.md).

Every operation list a test builds also goes through the engine's own validation and walk
(`compile_request`, i.e. `make_request` -> `compile_program`) or the server's parser, so an operation
the engine would refuse fails the test. The random long histories are in test_agent_properties.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.agent import assistant, compile_request, history, tool, tool_ids

from minakv.agent import REPOSITION_AFTER_TOKENS, CachePolicy, call_boundaries, tool_batches
from minakv.server.cache_ops import parse_cache_ops
from minakv.server.protocol import ChatCompletionRequest, decode_request


def test_import_does_not_load_torch() -> None:
    code = "import sys, minakv.agent; assert 'torch' not in sys.modules, 'minakv.agent imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- rolling drop -----


def test_akv_rolling_schedule_k12() -> None:
    """TR13 drops TR1, TR14 drops TR2, ... (tool results numbered from 1 in arrival order)."""
    messages = history([1] * 20)
    tr = tool_ids(messages)  # tr[0] is TR1
    ops = CachePolicy(keep_tool_results=12).ops(messages)
    assert ops["drop"][str(tr[12])] == [tr[0]]  # TR13 drops TR1
    assert ops["drop"][str(tr[13])] == [tr[1]]  # TR14 drops TR2
    assert ops["drop"] == {str(tr[j]): [tr[j - 12]] for j in range(12, 20)}
    assert ops["reposition"] == []
    assert list(ops["drop"]) == sorted(ops["drop"], key=int)
    compile_request([5] * len(messages), ops)
    # twelve results or fewer: nothing to drop yet
    assert CachePolicy(keep_tool_results=12).ops(history([1] * 12))["drop"] == {}


def test_rolling_counts_results_not_batches() -> None:
    """Parallel calls: the window is over tool results, in arrival order, across batches."""
    messages = history([2, 1, 3])  # results: 3 4 | 6 | 8 9 10
    assert tool_ids(messages) == [3, 4, 6, 8, 9, 10]
    ops = CachePolicy(keep_tool_results=3).ops(messages)
    assert ops["drop"] == {"8": [3], "9": [4], "10": [6]}
    compile_request([4] * len(messages), ops)


def test_target_assistant_and_both() -> None:
    """An assistant turn goes once every result of its batch has expired, at the trigger that expires the
    batch's last result; `tool` keeps it, `assistant` keeps the results, `both` drops both."""
    messages = history([2, 1, 1])  # 2: calls, 3 4 results | 5: call, 6 | 7: call, 8
    tool_only = CachePolicy(keep_tool_results=1, target="tool").ops(messages)
    assert tool_only["drop"] == {"4": [3], "6": [4], "8": [6]}
    asst = CachePolicy(keep_tool_results=1, target="assistant").ops(messages)
    assert asst["drop"] == {"6": [2], "8": [5]}  # result 3 expiring alone does not take assistant 2
    both = CachePolicy(keep_tool_results=1, target="both").ops(messages)
    assert both["drop"] == {"4": [3], "6": [2, 4], "8": [5, 6]}
    for ops in (tool_only, asst, both):
        compile_request([3] * len(messages), ops)
    # after the last drop of `both`, only the last batch and the non-tool messages stay in attention
    req = compile_request([1] * len(messages), both)
    assert set(req.program.owners[req.program.final_active].tolist()) == {0, 1, 7, 8}


def test_results_after_a_user_message_have_no_assistant_to_drop() -> None:
    messages = history([1]) + [{"role": "user", "content": "observation"}, tool("x"), tool("y")]
    ops = CachePolicy(keep_tool_results=1, target="both").ops(messages)
    # 5 and 6 follow user message 4: no assistant goes with them
    assert ops["drop"] == {"5": [2, 3], "6": [5]}
    compile_request([2] * len(messages), ops)


# ----- tool batches -----


def test_tool_batches_complete_by_declared_calls_or_by_a_following_message() -> None:
    messages = history([2]) + [assistant(3, "b")] + [tool("b0")]
    batches = tool_batches(messages)
    assert [(b.opener, b.results, b.boundary) for b in batches] == [(2, (3, 4), 4), (5, (6,), None)]
    assert call_boundaries(messages) == [4]  # the second batch waits for two more results
    messages += [tool("b1"), tool("b2")]
    assert call_boundaries(messages) == [4, 8]
    # an opener that does not say how many calls it made: complete once another message follows
    bare = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, tool("t")]
    assert call_boundaries(bare) == []
    assert call_boundaries([*bare, tool("t2")]) == []
    assert call_boundaries([*bare, tool("t2"), {"role": "user", "content": "next"}]) == [3]
    # results beyond the declared calls join the batch but do not move its boundary
    extra = [*history([1]), tool("extra")]
    assert [(b.results, b.boundary) for b in tool_batches(extra)] == [((3, 4), 3)]


# ----- call-based reposition -----


def test_call_based_reposition_every_i_from_a() -> None:
    messages = history([1] * 10)  # the boundary of batch c (from 1) is message 1 + 2c
    assert CachePolicy(reposition_every_calls=4).ops(messages)["reposition"] == [9, 17]
    ops = CachePolicy(keep_tool_results=3, reposition_every_calls=3, reposition_first_call=2).ops(messages)
    assert ops["reposition"] == [5, 11, 17]  # batches 2, 5, 8
    assert CachePolicy(reposition_every_calls=1).ops(messages)["reposition"] == call_boundaries(messages)
    compile_request([7] * len(messages), ops)


def test_bench_replay_kv_drop_is_a_policy() -> None:
    """bench/agent_replay.py's hand-made kv_drop operations (cache_ops: one call per round, tool result j
    is message 3 + 2j) are this policy's."""

    def bench_ops(r: int, keep: int) -> dict:
        drop = {str(3 + 2 * j): [3 + 2 * (j - keep)] for j in range(keep, r)}
        return {"drop": drop, "reposition": [3 + 2 * j for j in range(keep, r)]}

    for keep in (1, 2, 4):
        policy = CachePolicy(keep_tool_results=keep, reposition_every_calls=1, reposition_first_call=keep + 1)
        for r in range(12):
            assert policy.ops(history([1] * r)) == bench_ops(r, keep)


def test_call_based_reposition_sits_after_the_batch_and_its_drops() -> None:
    """With parallel calls the boundary is the batch's last result; a drop at that same message acts
    first, so the reposition compacts its hole too."""
    messages = history([2, 2, 2])  # results 3 4 | 6 7 | 9 10
    ops = CachePolicy(keep_tool_results=2, reposition_every_calls=2).ops(messages)
    assert ops == {"drop": {"6": [3], "7": [4], "9": [6], "10": [7]}, "reposition": [7]}
    req = compile_request([4] * len(messages), ops)
    # after message 7 the survivors 0 1 2 5 6 7 (24 tokens) sit at 0..23: message 8 is born at 24
    first_of_8 = int((req.program.owners == 8).argmax())
    assert req.program.birth_pos[first_of_8] == 24


# ----- token-based reposition -----


def test_token_based_reposition_needs_length_and_a_new_hole() -> None:
    messages = history([1] * 6)  # tool results 3 5 7 9 11 13; boundaries the same
    counts = [10, 10] + [5, 100] * 6
    policy = CachePolicy(keep_tool_results=2, reposition_after_tokens=300)
    ops = policy.ops(messages, counts)
    assert ops["drop"] == {"7": [3], "9": [5], "11": [7], "13": [9]}
    # length at boundary 7: 20 + 3 * 105 = 335 > 300, and 7 drops 3: reposition (survivors: 235 tokens).
    # At 9: 235 + 105 = 340 > 300, 9 drops 5: reposition (240). At 11 and 13 likewise.
    assert ops["reposition"] == [7, 9, 11, 13]
    higher = CachePolicy(keep_tool_results=2, reposition_after_tokens=400).ops(messages, counts)
    # at 9 the length is 20 + 4 * 105 = 440 > 400 (nothing compacted yet): reposition, down to 240; at 11
    # 345 <= 400: none; at 13 450 > 400 with 9's hole new: reposition
    assert higher["reposition"] == [9, 13]
    # no drops, no holes: a long history is never repositioned
    assert CachePolicy(reposition_after_tokens=100).ops(messages, counts)["reposition"] == []
    for o in (ops, higher):
        compile_request(counts, o)


def test_token_length_is_the_engines_next_position() -> None:
    """The length the policy compares with T is where the engine starts the next turn: for a request that
    ends at a boundary, the compiled program's next_pos (message_tokens: no generation prompt)."""
    messages = history([1, 2, 1, 1, 2, 1])
    counts = [30, 12] + [7, 40, 9, 33, 51, 8, 20, 6, 25, 5, 60, 71, 4, 90][: len(messages) - 2]
    assert len(counts) == len(messages)
    for threshold in (50, 150, 200, 250, 400):
        policy = CachePolicy(keep_tool_results=2, target="both", reposition_after_tokens=threshold)
        full = policy.ops(messages, counts)
        for b in call_boundaries(messages):
            cut = messages[: b + 1]
            ops = policy.ops(cut, counts[: b + 1])
            without = {"drop": ops["drop"], "reposition": [m for m in ops["reposition"] if m != b]}
            prog = compile_request(counts[: b + 1], without).program
            hole = prog.next_pos > len(prog.final_active)
            assert (b in full["reposition"]) == (prog.next_pos > threshold and hole), (threshold, b)


def test_token_counts_generation_prompt_and_checks() -> None:
    messages = history([1] * 4)
    counts = [10, 10] + [5, 50] * 4  # 240 tokens
    policy = CachePolicy(keep_tool_results=1, reposition_after_tokens=200)
    assert policy.ops(messages, counts)["reposition"] == [9]  # 240 > 200 at 9 only
    # with a 30-token generation prompt the length at boundary 7 is 185 + 30 > 200; at 9 it is then
    # 240 + 30 - 100 (compacted at 7) = 170
    assert policy.ops(messages, [*counts, 30])["reposition"] == [7]
    with pytest.raises(ValueError, match="token counts"):
        policy.ops(messages)
    with pytest.raises(ValueError, match="entries"):
        policy.ops(messages, counts[:-1])
    with pytest.raises(ValueError, match="non-negative"):
        policy.ops(messages, [*counts[:-1], -1])


def test_call_and_token_based_together() -> None:
    """A boundary chosen by either schedule is repositioned, and both count it as compacted."""
    messages = history([1] * 8)
    counts = [10, 10] + [5, 50] * 8
    both = CachePolicy(keep_tool_results=1, reposition_every_calls=4, reposition_after_tokens=150)
    calls = CachePolicy(keep_tool_results=1, reposition_every_calls=4).ops(messages, counts)["reposition"]
    tokens = CachePolicy(keep_tool_results=1, reposition_after_tokens=150).ops(messages, counts)["reposition"]
    assert calls == [9, 17]
    # lengths 185 at 7 (-> 85), 140 at 9, 195 at 11 (-> 95), 150 at 13, 205 at 15 (-> 105), 160 at 17
    assert tokens == [7, 11, 15, 17]
    # the call-based reposition at 9 compacts 7's drop, so 11 stays at 145 and 13 reaches 200
    assert both.ops(messages, counts)["reposition"] == [7, 9, 13, 15, 17]
    compile_request(counts, both.ops(messages, counts))


def test_default_threshold_is_akvs() -> None:
    assert REPOSITION_AFTER_TOKENS == 98_304


# ----- modes, thinking_drop, the request fields -----


def test_text_drop_deletes_what_kv_drop_drops() -> None:
    messages = history([2, 1, 1])
    kv = CachePolicy(keep_tool_results=1, target="both")
    text = CachePolicy(keep_tool_results=1, target="both", mode="text_drop")
    gone = {i for ids in kv.ops(messages)["drop"].values() for i in ids}
    assert text.messages(messages) == [m for i, m in enumerate(messages) if i not in gone]
    assert text.ops(messages) == {"drop": {}, "reposition": []} and text.extra_body(messages) == {}
    assert kv.messages(messages) == messages


def test_thinking_drop() -> None:
    messages = history([1, 1])
    messages[2] = {**messages[2], "reasoning_content": "let me think"}
    messages[4] = {**messages[4], "content": "<think>hmm</think>answer"}
    text = CachePolicy(keep_tool_results=1, thinking_drop=True, mode="text_drop").messages(messages)
    assert [m["role"] for m in text] == ["system", "user", "assistant", "assistant", "tool"]  # 3 dropped
    assert "reasoning_content" not in text[2] and text[2]["tool_calls"] == messages[2]["tool_calls"]
    assert text[3]["content"] == "answer"
    # kv_drop: the server's drop_rule; reposition stays a top-level field
    kv = CachePolicy(thinking_drop=True, reposition_every_calls=1)
    assert kv.extra_body(messages) == {"drop_rule": {"type": "thinking_drop"}, "reposition": [3, 5]}
    # token-based: reasoning is a hole of unknown size, so a boundary after it may reposition
    counts = [10, 10, 100, 10, 100, 10]
    tokens = CachePolicy(thinking_drop=True, reposition_after_tokens=100)
    assert tokens.ops(messages, counts)["reposition"] == [3, 5]
    assert CachePolicy(reposition_after_tokens=100).ops(messages, counts)["reposition"] == []


def test_extra_body_is_accepted_by_the_server_parser() -> None:
    messages = history([2, 1, 3, 1, 1])
    counts = [20, 8] + [6, 30] * (len(messages) - 2)
    counts = counts[: len(messages)]
    policy = CachePolicy(keep_tool_results=2, target="both", reposition_every_calls=2,
                         reposition_after_tokens=60)  # fmt: skip
    extra = policy.extra_body(messages, counts)
    body = json.dumps({"model": "m", "messages": messages, **extra}).encode()
    parsed = parse_cache_ops(decode_request(body, ChatCompletionRequest))
    ops = extra["cache"]
    assert parsed.engine_form() == {
        "drop": {int(t): ids for t, ids in ops["drop"].items()},
        "reposition": ops["reposition"],
    }
    compile_request(counts, ops)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="keep_tool_results"):
        CachePolicy(keep_tool_results=0)
    with pytest.raises(ValueError, match="target"):
        CachePolicy(keep_tool_results=1, target="user")
    with pytest.raises(ValueError, match="mode"):
        CachePolicy(mode="text")
    with pytest.raises(ValueError, match="reposition"):
        CachePolicy(keep_tool_results=1, mode="text_drop", reposition_every_calls=2)
    with pytest.raises(ValueError, match="thinking_drop"):
        CachePolicy(keep_tool_results=1, thinking_drop=True)
    with pytest.raises(ValueError, match="reposition_first_call"):
        CachePolicy(reposition_first_call=2)
    with pytest.raises(ValueError, match="reposition_after_tokens"):
        CachePolicy(reposition_after_tokens=True)
