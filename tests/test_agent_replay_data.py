"""The replay's inputs: the JSONL trajectory format, the filler text, the synthetic generator (heavy tail,
determinism) and how a task folds the model's answer and the tool results into its history."""

from __future__ import annotations

import json
import statistics

import pytest

from minakv.agent.replay.session import Reply, Task
from minakv.agent.replay.synthetic import SyntheticSpec, synthetic_trajectories, tool_length
from minakv.agent.replay.trajectory import (
    DEFAULT_TOOLS,
    ToolResult,
    filler,
    parse_trajectory,
    read_jsonl,
    to_json,
    write_jsonl,
)

LINE = {
    "id": "fix-42",
    "system": {"tokens": 12},
    "user": "Fix the failing test.",
    "turns": [
        {"output_tokens": 32, "tool_results": [{"text": "FAILED test_x"}, {"tokens": 50, "name": "cat",
                                                                           "arguments": {"path": "x.py"}}]},
        {"tool_results": [{"tokens": 7}]},
        {"output_tokens": 16},
    ],
}  # fmt: skip


def test_parse_a_line() -> None:
    t = parse_trajectory(LINE)
    assert (t.id, t.system, t.user, t.tools) == ("fix-42", 12, "Fix the failing test.", DEFAULT_TOOLS)
    assert [len(turn.tool_results) for turn in t.turns] == [2, 1, 0]
    assert [turn.output_tokens for turn in t.turns] == [32, None, 16]
    first, second = t.turns[0].tool_results
    assert first == ToolResult("FAILED test_x", "run", "{}")
    assert second == ToolResult(50, "cat", '{"path": "x.py"}')  # arguments as JSON text, as OpenAI sends
    assert t.result_text(0, 0) == "FAILED test_x"
    assert len(t.result_text(0, 1).split()) == 50 and len(t.system_text().split()) == 12


def test_jsonl_round_trip(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(LINE) + "\n\n" + json.dumps({**LINE, "id": "b", "tools": []}) + "\n")
    found = read_jsonl(path)
    assert [t.id for t in found] == ["fix-42", "b"] and found[1].tools == []
    again = read_jsonl(write_jsonl(found, tmp_path / "again.jsonl"))
    assert again == found
    assert parse_trajectory(to_json(found[0])) == found[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({"turns": [{"tool_results": [{"text": "a", "tokens": 3}]}]}, "exactly one of 'text' and 'tokens'"),
        ({"turns": [{"tool_results": [{"tokens": -1}]}]}, "integer >= 0"),
        ({"turns": [{"tool_results": [{"tokens": 2.5}]}]}, "integer >= 0"),
        ({"turns": [{"output_tokens": 0}]}, "integer >= 1"),
        ({"turns": [{"outputs": 3}]}, "turns[0]"),
        ({"turns": [{}, {}]}, "every turn but the last needs tool results"),
        ({"user": 3}, "user: expected a string"),
        ({"tools": {"a": 1}}, "'tools' must be a list"),
        ({"extra": 1}, "unknown fields ['extra']"),
    ],
)
def test_parse_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match="trajectory") as e:
        parse_trajectory({**LINE, **change})
    assert message in str(e.value)


def test_read_errors_name_the_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(LINE) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        read_jsonl(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no trajectories"):
        read_jsonl(tmp_path / "empty.jsonl")


def test_filler_is_deterministic_and_exact_in_o200k() -> None:
    from minakv.presets import resolve_model
    from minakv.text.tokenizer import Tokenizer

    assert filler(40, "a/0/0") == filler(40, "a/0/0") != filler(40, "a/0/1")
    tok = Tokenizer.from_dir(resolve_model("tiny-gpt-oss"))  # the real o200k vocabulary
    for n in (1, 17, 300):
        assert len(tok.encode(filler(n, f"k{n}"))) == n


def test_synthetic_is_a_function_of_its_seed() -> None:
    spec = SyntheticSpec(rounds=6, tool_tokens=100)
    a, b = synthetic_trajectories(5, spec, seed=3), synthetic_trajectories(5, spec, seed=3)
    assert a == b and [t.result_text(0, 0) for t in a] == [t.result_text(0, 0) for t in b]
    assert synthetic_trajectories(5, spec, seed=4) != a
    assert len({t.id for t in a}) == 5 and len({t.result_text(0, 0) for t in a}) == 5  # no shared text
    for t in a:
        assert len(t.turns) == 6 and not t.turns[-1].tool_results  # the last turn is the final answer
        assert all(len(turn.tool_results) in (1, 2) for turn in t.turns[:-1])
        assert all(turn.output_tokens == spec.output_tokens for turn in t.turns)


@pytest.mark.parametrize(("distribution", "tail"), [("lognormal", 5.0), ("pareto", 5.0)])
def test_synthetic_lengths_are_heavy_tailed(distribution: str, tail: float) -> None:
    spec = SyntheticSpec(rounds=41, tool_tokens=1000, distribution=distribution, max_tool_tokens=10**6,
                         parallel=0.0)  # fmt: skip
    lengths = sorted(r.content for t in synthetic_trajectories(50, spec, seed=1) for turn in t.turns
                     for r in turn.tool_results)  # fmt: skip
    assert len(lengths) == 50 * 40
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert 850 < median < 1150  # the median is the spec's
    assert p99 > tail * median  # a long tail: the p99 is many medians
    assert statistics.fmean(lengths) > 1.3 * median  # the tail pulls the mean up


def test_synthetic_lengths_are_clipped_and_sigma_zero_is_fixed() -> None:
    import random

    rng = random.Random(0)
    spec = SyntheticSpec(tool_tokens=100, min_tool_tokens=50, max_tool_tokens=150, sigma=3.0)
    assert {50, 150} <= {tool_length(rng, spec) for _ in range(500)} <= set(range(50, 151))
    assert {tool_length(rng, SyntheticSpec(tool_tokens=77, sigma=0.0)) for _ in range(20)} == {77}
    with pytest.raises(ValueError):
        SyntheticSpec(distribution="zipf")
    with pytest.raises(ValueError):
        SyntheticSpec(tool_tokens=10, min_tool_tokens=20)


def test_fold_keeps_the_models_calls_when_they_match() -> None:
    t = parse_trajectory(LINE)
    task = Task(t, system_prefix="[replay 1.0]\n")
    assert task.history[0]["content"] == "[replay 1.0]\n" + t.system_text()
    calls = [{"id": "m1", "name": "grep", "arguments": "{}"}, {"id": "m2", "name": "cat", "arguments": "{}"}]
    task.fold(Reply(content="looking", reasoning="think", tool_calls=calls), 0)
    a = task.history[2]
    assert a["content"] == "looking" and a["reasoning_content"] == "think"
    assert [c["id"] for c in a["tool_calls"]] == ["m1", "m2"]
    assert [c["function"]["name"] for c in a["tool_calls"]] == ["grep", "cat"]
    assert [(m["role"], m["tool_call_id"]) for m in task.history[3:]] == [("tool", "m1"), ("tool", "m2")]
    assert task.history[4]["content"] == t.result_text(0, 1) and task.known == {4: 50}
    # one call for a turn with one result... but the model made two: the recorded call answers it
    task.fold(Reply(content="", tool_calls=calls), 1)
    assert task.history[5]["tool_calls"] == [
        {"id": "call_1_0", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    ]
    assert task.history[6] == {"role": "tool", "tool_call_id": "call_1_0", "content": t.result_text(1, 0)}
    assert task.estimate(6) == 7 and task.estimate(3) == len("FAILED test_x") // 4
