"""Agent trajectories: what a replay sends, minus what the model says.

A trajectory is an agent task recorded (or made up) as the client sees it: a system prompt, a user task,
then one entry per turn. Turn t is one request: the model answers the history so far, and the turn's tool
results are appended after its answer. The model's own words are never stored here: a replay sends what the
model under test actually said (the point of replaying through a live server), so only the tool results,
which the environment produced, come from the trajectory.

Any text can be given literally or as a token length. A length stands for filler text with that many
tokens in the o200k vocabulary of GPT-OSS (one common English word per token; other vocabularies count
differently), drawn from a seed made of the trajectory id and the text's place in it. So the same
trajectory renders to the same text in every policy and every run, and two trajectories never share
tool-result text (which would let the server's prefix cache share it).

The JSONL form, one trajectory per line (docs/agent.md):

    {"id": "task-7", "system": "You are ..." | {"tokens": 512}, "user": ... | {"tokens": 128},
     "tools": [OpenAI tool schemas] (optional),
     "turns": [{"output_tokens": 64 (optional),
                "tool_results": [{"text": "..."} | {"tokens": 1834},
                                 ... each optionally with "name" and "arguments" of the call]},
               ...]}
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Each of these is one token after a space in o200k (GPT-OSS), so n of them make n tokens there.
WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "at", "this", "from", "or", "an", "are", "not", "but", "have", "you", "which", "one", "all",
    "they", "their", "has", "more", "will", "can", "if", "its", "been", "other", "there", "what",
    "about", "when", "some", "these", "into", "only", "time", "two", "new", "so", "may", "no", "also",
    "after", "first", "would", "most", "could", "use", "any", "than", "over", "work", "such", "then",
    "them", "where", "make", "like", "well", "how", "state", "data", "file", "line", "value", "result",
    "error", "test", "code", "name", "list", "type", "user", "path", "item", "page", "form", "case",
    "number", "system", "point", "group", "order", "part"]  # fmt: skip

# The tool the synthetic trajectories call, and the one a trajectory without "tools" is given.
DEFAULT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the task's workspace and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]

Content = str | int  # literal text, or a token length to fill


@dataclass(frozen=True)
class ToolResult:
    content: Content
    name: str = "run"  # the call this result answers (used when the model's own calls cannot be)
    arguments: str = "{}"  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Turn:
    tool_results: tuple[ToolResult, ...] = ()
    output_tokens: int | None = None  # the recorded answer's length; None: the replay's default


@dataclass(frozen=True)
class Trajectory:
    id: str
    system: Content
    user: Content
    turns: tuple[Turn, ...]
    tools: list[dict] = field(default_factory=lambda: DEFAULT_TOOLS)

    def system_text(self) -> str:
        return render(self.system, "system")  # shared by every trajectory, as a deployment's prompt is

    def user_text(self) -> str:
        return render(self.user, f"{self.id}/user")

    def result_text(self, turn: int, k: int) -> str:
        return render(self.turns[turn].tool_results[k].content, f"{self.id}/{turn}/{k}")


def filler(tokens: int, key: str) -> str:
    """`tokens` words drawn from a generator seeded by `key` (str seeds hash with SHA-512, so the text is
    the same in every process)."""
    rng = random.Random(key)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def render(content: Content, key: str) -> str:
    return content if isinstance(content, str) else filler(content, key)


# ----- JSONL -----


def parse_trajectory(obj: Any, where: str = "trajectory") -> Trajectory:
    """One JSONL line (already decoded) -> a Trajectory; ValueError naming the bad field otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")  # noqa: TRY004 (bad input, one error type)
    unknown = set(obj) - {"id", "system", "user", "tools", "turns"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'turns' must be a non-empty list")
    tools = obj.get("tools", DEFAULT_TOOLS)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{where}: 'tools' must be a list of tool schemas")
    parsed = tuple(_turn(t, f"{where}.turns[{i}]") for i, t in enumerate(turns))
    if any(not t.tool_results for t in parsed[:-1]):
        # the next request would follow an assistant answer with nothing new: not an agent loop
        raise ValueError(f"{where}: every turn but the last needs tool results")
    return Trajectory(
        id=str(obj.get("id", where)),
        system=_content(obj.get("system", ""), f"{where}.system"),
        user=_content(obj.get("user"), f"{where}.user"),
        turns=parsed,
        tools=tools,
    )


def _content(value: Any, where: str) -> Content:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"tokens"}:
        return _count(value["tokens"], where)
    if isinstance(value, dict) and set(value) == {"text"} and isinstance(value["text"], str):
        return value["text"]
    raise ValueError(f"{where}: expected a string, {{'text': str}} or {{'tokens': int}}")


def _count(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _turn(obj: Any, where: str) -> Turn:
    if not isinstance(obj, dict) or set(obj) - {"tool_results", "output_tokens"}:
        raise ValueError(f"{where}: expected {{'tool_results': [...], 'output_tokens': n}}")
    results = obj.get("tool_results", [])
    if not isinstance(results, list):
        raise ValueError(f"{where}.tool_results: expected a list")  # noqa: TRY004
    out = obj.get("output_tokens")
    return Turn(
        tool_results=tuple(_result(r, f"{where}.tool_results[{k}]") for k, r in enumerate(results)),
        output_tokens=None if out is None else _count(out, f"{where}.output_tokens", 1),
    )


def _result(obj: Any, where: str) -> ToolResult:
    if not isinstance(obj, dict) or len(set(obj) & {"text", "tokens"}) != 1:
        raise ValueError(f"{where}: expected exactly one of 'text' and 'tokens'")
    if set(obj) - {"text", "tokens", "name", "arguments"}:
        raise ValueError(
            f"{where}: unknown fields {sorted(set(obj) - {'text', 'tokens', 'name', 'arguments'})}"
        )
    content = _content({k: obj[k] for k in ("text", "tokens") if k in obj}, where)
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolResult(content, name=str(obj.get("name", "run")), arguments=arguments)


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Every trajectory in a JSONL file (blank lines skipped); errors name the line."""
    trajectories = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            trajectories.append(parse_trajectory(obj, f"{path}:{n}"))
    if not trajectories:
        raise ValueError(f"{path}: no trajectories")
    return trajectories


def to_json(t: Trajectory) -> dict:
    """The JSONL line of a trajectory (the inverse of parse_trajectory)."""

    def content(c: Content) -> Any:
        return c if isinstance(c, str) else {"tokens": c}

    def result(r: ToolResult) -> dict:
        body = {"text": r.content} if isinstance(r.content, str) else {"tokens": r.content}
        return {**body, "name": r.name, "arguments": r.arguments}

    turns = []
    for turn in t.turns:
        entry: dict[str, Any] = {"tool_results": [result(r) for r in turn.tool_results]}
        if turn.output_tokens is not None:
            entry["output_tokens"] = turn.output_tokens
        turns.append(entry)
    return {
        "id": t.id,
        "system": content(t.system),
        "user": content(t.user),
        "tools": t.tools,
        "turns": turns,
    }


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(to_json(t)) + "\n" for t in trajectories)
    return path
