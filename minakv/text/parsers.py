"""Model output -> (reasoning_content, content, tool_calls), streaming and not.

Each family writes reasoning and tool calls in its own markup:
- GPT-OSS (harmony): messages `<|channel|>analysis<|message|>...<|end|>`, then
  `<|start|>assistant<|channel|>final<|message|>...<|return|>`; a tool call is a message addressed to a
  function, `to=functions.NAME` (before or after the channel) whose body is the JSON arguments, ended by
  `<|call|>`. analysis -> reasoning, final (and commentary without recipient) -> content.
- MiniMax-M2: the generation prompt already opened `<think>`, so output starts inside the reasoning, up to
  `</think>`; then content; tool calls are XML:
  `<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke></minimax:tool_call>`,
  parameter values converted by the tool's JSON schema types.

One parser serves both uses: `feed(text)` returns the pieces that are certain so far, `finish()` flushes.
A parser never emits text that may still turn out to be part of a tag: it holds back a buffer tail that is
a prefix of a tag. Every decision depends only on the text seen, never on how it was split, so the
concatenated pieces equal the one-shot parse for every split (`parse` = one feed + finish). The text must
keep special tokens (decode without skipping them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Piece:
    """A piece of output: kind "reasoning" or "content" with `text`, or "tool_call" with `index`; a tool
    call's first delta carries `id` and `name`, its `text` pieces concatenate to the JSON arguments."""

    kind: str
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI's API sends it


@dataclass
class ParsedOutput:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)


def collect(pieces: list[Piece]) -> ParsedOutput:
    """Assemble pieces into the message they describe (what a streaming client does)."""
    reasoning, content = [], []
    calls: dict[int, ParsedCall] = {}
    for d in pieces:
        if d.kind == "reasoning":
            reasoning.append(d.text)
        elif d.kind == "content":
            content.append(d.text)
        else:
            call = calls.setdefault(d.index, ParsedCall(d.id or "", d.name or "", ""))
            call.arguments += d.text
    return ParsedOutput(
        "".join(reasoning) or None, "".join(content) or None, [calls[i] for i in sorted(calls)]
    )


def merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbouring pieces of the same kind (and tool call) into one."""
    out: list[Piece] = []
    for d in pieces:
        last = out[-1] if out else None
        if last and last.kind == d.kind and last.index == d.index and d.id is None:
            last.text += d.text
        elif d.text or d.kind == "tool_call":
            out.append(Piece(d.kind, d.text, d.index, d.id, d.name))
    return out


def held_tail(text: str, tags: tuple[str, ...]) -> int:
    """Index from which `text` might be the start of one of `tags` (len(text) if nowhere)."""
    longest = max(len(t) for t in tags)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if any(t.startswith(text[i:]) for t in tags):
            return i
    return len(text)


class OutputParser:
    """Base: `self.buf` holds text not yet consumed; subclasses implement `step(final)`, which consumes
    what it can and returns False when it needs more text."""

    def __init__(self, id_prefix: str | None = None) -> None:
        self.buf = ""
        self.out: list[Piece] = []
        self.num_calls = 0
        self.id_prefix = id_prefix if id_prefix is not None else f"call_{uuid.uuid4().hex[:16]}_"

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while self.step(final=False):
            pass
        out, self.out = merge(self.out), []
        return out

    def finish(self) -> list[Piece]:
        while self.step(final=True):
            pass
        out, self.out = merge(self.out), []
        return out

    def parse(self, text: str) -> ParsedOutput:
        return collect(self.feed(text) + self.finish())

    def step(self, final: bool) -> bool:
        raise NotImplementedError

    def emit(self, kind: str, text: str) -> None:
        if text:
            self.out.append(Piece(kind, text))

    def start_call(self, name: str) -> int:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        self.out.append(Piece("tool_call", "", index, f"{self.id_prefix}{index}", name))
        return index


class PlainParser(OutputParser):
    """Everything is content (models without a known format)."""

    def step(self, final: bool) -> bool:
        self.emit("content", self.buf)
        self.buf = ""
        return False


# ---------------------------------------------------------------------------------------------------------
# GPT-OSS (harmony)

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
HEADER_LIMIT = 256  # a header longer than this means the output is not harmony: pass it on as content


class HarmonyParser(OutputParser):
    def __init__(self, id_prefix: str | None = None) -> None:
        super().__init__(id_prefix)
        self.state = "header"  # header -> body -> header ...; or raw (not harmony: all content)
        self.kind, self.call = "content", 0  # where the current body goes
        self.seen_message = False

    def step(self, final: bool) -> bool:
        if self.state == "raw":
            self.emit("content", self.buf)
            self.buf = ""
            return False
        if self.state == "header":
            at = self.buf.find(MESSAGE, 0, HEADER_LIMIT + len(MESSAGE))
            if at >= 0:
                self.open_message(self.buf[:at])
                self.buf = self.buf[at + len(MESSAGE) :]
                return True
            if len(self.buf) >= HEADER_LIMIT + len(MESSAGE) or (final and not self.seen_message):
                self.state = "raw"  # never a harmony header: the model wrote plain text
                return True
            if final:
                self.buf = ""  # an unfinished header at the very end (e.g. cut by max_tokens)
            return False
        ends = [(i, tag) for tag in ENDS if (i := self.buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self.emit_body(self.buf[:at])
            self.buf = self.buf[at + len(tag) :]
            self.state = "header"
            return True
        keep = len(self.buf) if final else held_tail(self.buf, ENDS)
        self.emit_body(self.buf[:keep])
        self.buf = self.buf[keep:]
        return False

    def open_message(self, header: str) -> None:
        """`[<|start|>assistant][ to=R]<|channel|>C[ to=R][ [<|constrain|>]json]` -> where the body goes."""
        self.seen_message, self.state = True, "body"
        channel = re.search(r"<\|channel\|>([^\s<]+)", header)
        recipient = re.search(r"to=([^\s<]+)", header)
        if recipient:
            name = recipient.group(1).removeprefix("functions.")
            self.kind, self.call = "tool_call", self.start_call(name)
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def emit_body(self, text: str) -> None:
        if self.kind == "tool_call":
            if text:
                self.out.append(Piece("tool_call", text, self.call))
        else:
            self.emit(self.kind, text)


# ---------------------------------------------------------------------------------------------------------
# MiniMax-M2

THINK, END_THINK, EOS = "<think>", "</think>", "[e~["
CALLS, END_CALLS, END_INVOKE = "<minimax:tool_call>", "</minimax:tool_call>", "</invoke>"
INVOKE = re.compile(r'<invoke name="([^"]*)">')
PARAMETER = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


class MiniMaxParser(OutputParser):
    """`tools`: the request's tools (OpenAI form), used to type parameter values. With `start_in_think`
    (the template's generation prompt opens `<think>`) output begins as reasoning."""

    def __init__(
        self, tools: list[dict] | None = None, start_in_think: bool = True, id_prefix: str | None = None
    ):
        super().__init__(id_prefix)
        self.schemas: dict[str, dict] = {}  # tool name -> {parameter: JSON schema}
        for tool in tools or []:
            fn = tool.get("function") if isinstance(tool, dict) else None
            params = fn.get("parameters") if isinstance(fn, dict) else None
            if isinstance(params, dict) and isinstance(params.get("properties"), dict):
                self.schemas[str(fn.get("name"))] = params["properties"]
        self.state = "start"
        self.start_in_think = start_in_think
        self.at_start = True  # strip newlines that open a reasoning/content section

    def step(self, final: bool) -> bool:
        if self.state == "done":
            self.buf = ""
            return False
        if self.state == "start":
            if THINK.startswith(self.buf) and not final:
                return False  # might still become <think>
            think = self.buf.startswith(THINK)
            self.buf = self.buf.removeprefix(THINK)
            self.state = "think" if think or self.start_in_think else "content"
            return True
        if self.state == "calls":
            return self.step_calls(final)
        tags = (END_THINK, EOS) if self.state == "think" else (CALLS, EOS)
        kind = "reasoning" if self.state == "think" else "content"
        if self.at_start:
            self.buf = self.buf.lstrip("\n")
            self.at_start = not self.buf
        found = [(i, tag) for tag in tags if (i := self.buf.find(tag)) >= 0]
        if found:
            at, tag = min(found)
            self.emit(kind, self.buf[:at].rstrip("\n"))
            self.buf = self.buf[at + len(tag) :]
            self.state = {END_THINK: "content", CALLS: "calls", EOS: "done"}[tag]
            self.at_start = True
            return True
        # Hold back what may be a tag, and trailing newlines: they are dropped if the section ends there.
        text = (self.buf if final else self.buf[: held_tail(self.buf, tags)]).rstrip("\n")
        self.emit(kind, text)
        self.buf = "" if final else self.buf[len(text) :]
        return False

    def step_calls(self, final: bool) -> bool:
        """Inside <minimax:tool_call>: one tool call per complete <invoke>...</invoke>."""
        end_invoke, end_calls = self.buf.find(END_INVOKE), self.buf.find(END_CALLS)
        if end_calls >= 0 and (end_invoke < 0 or end_calls < end_invoke):
            self.buf = self.buf[end_calls + len(END_CALLS) :]
            self.state, self.at_start = "content", True
            return True
        if end_invoke >= 0:
            self.emit_invoke(self.buf[:end_invoke])
            self.buf = self.buf[end_invoke + len(END_INVOKE) :]
            return True
        if final:  # cut off: keep a call whose name arrived, with the parameters that are complete
            self.emit_invoke(self.buf)
            self.buf = ""
        return False

    def emit_invoke(self, block: str) -> None:
        head = INVOKE.search(block)
        if head is None:
            return
        name = head.group(1)
        schema = self.schemas.get(name, {})
        args = {k: convert(v.strip("\n"), schema.get(k)) for k, v in PARAMETER.findall(block[head.end() :])}
        index = self.start_call(name)
        self.out.append(Piece("tool_call", json.dumps(args, ensure_ascii=False), index))


TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array", "string")  # most specific first


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON type its schema allows. The template writes strings raw and other
    values as JSON, so text that parses as an allowed non-string type is taken as that type (most specific
    first); otherwise, or without a schema, it stays text."""
    types = schema.get("type") if isinstance(schema, dict) else None
    kinds = sorted(
        (k for k in (types if isinstance(types, list) else [types]) if k in TYPE_ORDER), key=TYPE_ORDER.index
    )
    for kind in kinds:
        if kind == "string":
            return value
        if kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        number = isinstance(parsed, (int, float)) and not isinstance(parsed, bool)
        if kind == "null" and parsed is None:
            return None
        if kind == "integer" and number and float(parsed).is_integer():
            return int(parsed)
        if (kind == "number" and number) or (kind == "object" and isinstance(parsed, dict)):
            return parsed
        if kind == "array" and isinstance(parsed, list):
            return parsed
    return value


def make_parser(
    arch: str | None, tools: list[dict] | None = None, id_prefix: str | None = None
) -> OutputParser:
    """The output parser for a model family (`ModelConfig.arch`: "gpt_oss", "minimax_m2"; else plain)."""
    if arch == "gpt_oss":
        return HarmonyParser(id_prefix)
    if arch == "minimax_m2":
        return MiniMaxParser(tools, id_prefix=id_prefix)
    return PlainParser(id_prefix)


def parse_output(text: str, arch: str | None, tools: list[dict] | None = None) -> ParsedOutput:
    return make_parser(arch, tools).parse(text)
