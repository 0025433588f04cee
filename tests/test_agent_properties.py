"""Property tests of minakv.agent's CachePolicy over long random agent histories.

Each example draws a history (tool batches of 1-3 parallel calls, heavy-tailed tool-result lengths, now
and then a plain answer, a user observation, or an opener that does not declare its calls) and a policy,
and checks, with the engine's own compiler as the judge (`make_request` -> `compile_program`):

- validity: every round's operations are accepted as they are;
- the prefix property: for every cut of the history, the operations extend the shorter history's (same
  list at every earlier trigger, earlier repositions a prefix), so a later round reuses every earlier one;
- what stays in attention: exactly the last K tool results (targets tool, both), and an assistant turn
  while any result of its batch does (assistant, both);
- token-based reposition happens at a boundary exactly when the engine's next position there exceeds T
  and holds a hole, and then positions stay below max(T, the most tokens active at a boundary) + (tokens
  between two boundaries) + generation: with that as the model's limit, every round compiles.
"""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from helpers.agent import assistant, compile_request, tool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv.agent import CachePolicy, call_boundaries, tool_batches
from minakv.server.cache_ops import parse_cache_ops
from minakv.server.protocol import ChatCompletionRequest, decode_request

GENERATED = 16  # tokens each round generates
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@st.composite
def histories(draw, max_steps: int) -> tuple[list[dict], list[int]]:
    """(messages, tokens per message)."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    counts = [draw(st.integers(1, 60)), draw(st.integers(1, 30))]
    tool_len = st.one_of(st.integers(1, 40), st.integers(40, 400))  # mostly short, some long
    for step in range(draw(st.integers(1, max_steps))):
        kind = draw(st.sampled_from(["batch"] * 10 + ["answer", "user", "undeclared"]))
        if kind == "user":
            messages.append({"role": "user", "content": "more"})
            counts.append(draw(st.integers(1, 30)))
            continue
        calls = 0 if kind == "answer" else draw(st.integers(1, 3))
        turn = assistant(calls if kind == "batch" else 0, str(step))
        messages.append(turn)
        counts.append(draw(st.integers(1, 30)))
        for k in range(calls):
            messages.append(tool(f"{step}_{k}"))
            counts.append(draw(tool_len))
    return messages, counts


@st.composite
def policies(draw) -> CachePolicy:
    every = draw(st.none() | st.integers(1, 5))
    return CachePolicy(
        keep_tool_results=draw(st.none() | st.integers(1, 6)),
        target=draw(st.sampled_from(["tool", "assistant", "both"])),
        reposition_every_calls=every,
        reposition_first_call=draw(st.none() | st.integers(1, 5)) if every else None,
    )


def extends(longer: dict, shorter: dict) -> bool:
    same_drops = all(longer["drop"].get(t) == ids for t, ids in shorter["drop"].items())
    return same_drops and longer["reposition"][: len(shorter["reposition"])] == shorter["reposition"]


def rounds(messages: list[dict]) -> list[int]:
    """Where an agent sends a request: after each complete batch, and at the end of the history."""
    return sorted({*(b + 1 for b in call_boundaries(messages)), len(messages)})


def check_attention(messages: list[dict], counts: list[int], policy: CachePolicy, ops: dict) -> None:
    """The messages still in attention after the whole history, read from the compiled program."""
    program = compile_request(counts, ops).program
    active = set(program.owners[program.final_active].tolist())
    if policy.keep_tool_results is None:
        assert active == set(range(len(messages)))
        return
    results = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    kept = set(results[-policy.keep_tool_results :])
    if policy.target in ("tool", "both"):
        assert active & set(results) == kept
    else:
        assert set(results) <= active
    for batch in tool_batches(messages):
        if batch.opener is not None:
            expected = policy.target == "tool" or bool(kept & set(batch.results))
            assert (batch.opener in active) == expected, (batch, sorted(active))


@settings(max_examples=80, **SETTINGS)
@given(histories(max_steps=40), policies())
def test_ops_valid_cumulative_and_keep_the_window(history: tuple, policy: CachePolicy) -> None:
    messages, counts = history
    previous = {"drop": {}, "reposition": []}
    for cut in range(1, len(messages) + 1):
        ops = policy.ops(messages[:cut])
        assert extends(ops, previous), (cut, previous, ops)
        previous = ops
    for cut in rounds(messages):
        compile_request(counts[:cut], policy.ops(messages[:cut]), max_tokens=GENERATED)
    check_attention(messages, counts, policy, previous)
    # the server takes them too, in the request body as sent
    body = json.dumps({"model": "m", "messages": messages, **policy.extra_body(messages)}).encode()
    parse_cache_ops(decode_request(body, ChatCompletionRequest))


def check_token_schedule(history: tuple, keep: int, target: str, every: int | None, scale: float) -> None:
    messages, counts = history
    bounds = call_boundaries(messages)
    plain = CachePolicy(keep_tool_results=keep, target=target)
    # T around the most tokens active at a boundary (measured by the engine on the drops alone): below it
    # positions can pass T with no hole to close, above it they cannot
    most_active = max(
        (
            len(compile_request(counts[: b + 1], plain.ops(messages[: b + 1])).program.final_active)
            for b in bounds
        ),
        default=0,
    )
    threshold = max(1, int(most_active * scale))
    policy = CachePolicy(
        keep_tool_results=keep, target=target, reposition_every_calls=every, reposition_after_tokens=threshold
    )
    full = policy.ops(messages, counts)
    by_calls = set(CachePolicy(reposition_every_calls=every).ops(messages)["reposition"]) if every else set()
    previous = {"drop": {}, "reposition": []}
    for cut in range(1, len(messages) + 1):
        ops = policy.ops(messages[:cut], counts[:cut])
        assert extends(ops, previous), (cut, previous, ops)
        previous = ops
    # reposition at b <=> chosen by calls, or (next position > T and a hole), as the engine sees it
    for b in bounds:
        ops = policy.ops(messages[: b + 1], counts[: b + 1])
        without = {"drop": ops["drop"], "reposition": [m for m in ops["reposition"] if m != b]}
        program = compile_request(counts[: b + 1], without).program
        by_tokens = program.next_pos > threshold and program.next_pos > len(program.final_active)
        assert (b in full["reposition"]) == (b in by_calls or by_tokens), (b, program.next_pos, threshold)
    # so after each boundary the next position is at most max(T, what is active), and no position reaches
    # that + the most tokens between two boundaries + the generation
    cuts = [0, *(b + 1 for b in bounds), len(messages)]
    gap = max(sum(counts[a:c]) for a, c in pairwise(cuts))
    limit = max(threshold, most_active) + gap + GENERATED
    for cut in rounds(messages):
        request = compile_request(counts[:cut], policy.ops(messages[:cut], counts[:cut]), limit, GENERATED)
        assert request.program.next_pos + GENERATED <= limit


@settings(max_examples=50, **SETTINGS)
@given(
    histories(max_steps=40),
    st.integers(1, 6),
    st.sampled_from(["tool", "assistant", "both"]),
    st.none() | st.integers(2, 6),
    st.sampled_from([0.3, 0.7, 1.0, 1.1, 1.5, 3.0]),
)
def test_token_based_reposition(history, keep, target, every, scale) -> None:
    check_token_schedule(history, keep, target, every, scale)


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(histories(max_steps=150), policies())
def test_ops_long_histories(history: tuple, policy: CachePolicy) -> None:
    test_ops_valid_cumulative_and_keep_the_window.hypothesis.inner_test(history, policy)


@pytest.mark.slow
@settings(max_examples=150, **SETTINGS)
@given(
    histories(max_steps=150),
    st.integers(1, 12),
    st.sampled_from(["tool", "assistant", "both"]),
    st.none() | st.integers(2, 8),
    st.floats(0.1, 3.0),
)
def test_token_based_reposition_long(history, keep, target, every, scale) -> None:
    check_token_schedule(history, keep, target, every, scale)
