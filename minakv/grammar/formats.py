"""Grammars for a chat turn in each model family's own output format.

A grammar constrains the whole output, from the first generated token, so structured outputs on a chat
model must also spell the family's markup around the JSON (minakv/text/parsers.py reads it back):

    GPT-OSS (harmony), the generation prompt ends with `<|start|>assistant`:
      answer     <|channel|>final<|message|>{...}<|return|>
      tool call  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    MiniMax-M2, the generation prompt opens `<think>\\n`:
      answer     </think>\\n\\n{...}[e~[
      tool call  </think>\\n\\n<minimax:tool_call>\\n<invoke name="NAME">\\n
                 <parameter name="K">V</parameter>\\n...</invoke>\\n</minimax:tool_call>[e~[

The turn has **no reasoning**: the grammar closes the reasoning section at once (MiniMax) or goes straight
to the final/commentary channel (GPT-OSS). Allowing an analysis message first is easy to write
(`<|channel|>analysis<|message|> TEXT <|end|><|start|>assistant ...`), but only the model can end free
text, and a model that does not (a random-weight one never picks `<|end|>`) would run to max_tokens
without ever writing the JSON. So a constrained turn trades the model's reasoning for a guaranteed form.

Special tokens appear by name (`<|channel|>`: llguidance looks them up in the tokenizer; `[e~[` by id).
Harmony arguments are JSON; MiniMax parameters are written as its template writes them: strings raw (not
containing `<`, no newline at either end: the parser strips those), every other type as JSON (`%json`),
in the schema's property order, required ones always.
"""

from __future__ import annotations

import json
from typing import Any

from minakv.grammar.compiler import JSON_OPTIONS
from minakv.params import Grammar

ANY_OBJECT: dict[str, Any] = {"type": "object"}

# `start` picks the answer, the tool calls, or either (tools on "auto" with a response_format)
HARMONY_START = "start: <|channel|> ({choices})"
HARMONY_ANSWER = 'answer: "final" <|message|> {json} <|return|>'
HARMONY_CALLS = 'calls: "commentary to=functions." ({calls})'
HARMONY_CALL = """call{i}: {name} <|constrain|> "json" <|message|> args{i} <|call|>
args{i}: {json}"""
MINIMAX_START = 'start: </think> "\\n\\n" ({choices}) {end}'
MINIMAX_ANSWER = "answer: {json}"
MINIMAX_CALLS = 'calls: <minimax:tool_call> "\\n" ({calls})+ </minimax:tool_call>'
MINIMAX_INVOKE = 'invoke{i}: {head} {params} "</invoke>\\n"'
MINIMAX_PARAM = """p{i}_{j}: {head} v{i}_{j} "</parameter>\\n"
v{i}_{j}: {value}"""


def chat_output(
    arch: str, tokenizer: Any, answer: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
) -> Grammar:
    """A chat turn in the family's markup that answers with one JSON value valid under the `answer` schema,
    or calls one of `tools` (OpenAI form; only the named one for a named tool_choice) with arguments valid
    under its schema (MiniMax: one or more calls), or does either when both are given."""
    if answer is None and not tools:
        raise ValueError("a chat grammar needs an answer schema or tools")
    if arch not in ("gpt_oss", "minimax_m2"):
        if tools:
            raise ValueError(f"no tool-call format is known for model family {arch!r}")
        return Grammar(json_schema=answer)  # no chat markup known: the JSON alone
    harmony = arch == "gpt_oss"
    choices = " | ".join(["answer"] * (answer is not None) + ["calls"] * bool(tools))
    if harmony:
        lines = [HARMONY_START.format(choices=choices)]
    else:
        lines = [MINIMAX_START.format(choices=choices, end=minimax_end(tokenizer))]
    if answer is not None:
        lines.append((HARMONY_ANSWER if harmony else MINIMAX_ANSWER).format(json=inline_json(answer)))
    if tools:
        calls = " | ".join(f"{'call' if harmony else 'invoke'}{i}" for i in range(len(tools)))
        lines.append((HARMONY_CALLS if harmony else MINIMAX_CALLS).format(calls=calls))
    for i, tool in enumerate(tools or []):
        name, schema = tool["function"]["name"], tool["function"].get("parameters") or ANY_OBJECT
        if harmony:
            lines.append(HARMONY_CALL.format(i=i, name=lark_string(name + " "), json=inline_json(schema)))
        else:
            lines += minimax_invoke(i, name, schema)
    return Grammar(lark="\n".join(lines))


def minimax_invoke(i: int, name: str, schema: dict[str, Any]) -> list[str]:
    """Lark rules for one `<invoke>` block of tool i: its parameters in property order, written as the
    template writes them (names unescaped)."""
    required = set(schema.get("required") or [])
    params, rules = [], []
    for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
        params.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
        head = lark_string(f'<parameter name="{key}">')
        value = minimax_value(sub if isinstance(sub, dict) else {})
        rules.append(MINIMAX_PARAM.format(i=i, j=j, head=head, value=value))
    head = lark_string(f'<invoke name="{name}">\n')
    return [MINIMAX_INVOKE.format(i=i, head=head, params=" ".join(params)), *rules]


def minimax_value(schema: dict[str, Any]) -> str:
    """A MiniMax parameter value: raw text for strings (string enums: one of them), JSON for the rest. The
    parser types a value by the schema's `type` (parsers.convert), so an untyped schema gets text."""
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if choices is not None:
        if all(isinstance(c, str) for c in choices):
            return " | ".join(lark_string(c) for c in choices)
        return inline_json(schema)
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" not in types and types != [None]:
        return inline_json(schema)
    text = raw_string(schema.get("minLength", 0), schema.get("maxLength"))
    others = [t for t in types if t not in ("string", None)]
    return f"{inline_json({**schema, 'type': others})} | {text}" if others else text


def raw_string(low: int, high: int | None) -> str:
    """A lark regex for text of low..high characters without `<` and with no newline at either end."""
    inner, edge = "[^<]", "[^<\\n]"
    forms = []
    if low == 0:
        forms.append("")
    if low <= 1 and (high is None or high >= 1):
        forms.append(edge)
    if high is None or high >= 2:
        upper = "" if high is None else str(high - 2)
        forms.append(f"{edge}{inner}{{{max(low, 2) - 2},{upper}}}{edge}")
    return "/(" + "|".join(forms) + ")/"


def inline_json(schema: dict[str, Any]) -> str:
    """`%json {...}`: the schema as a lark non-terminal, with the compile options inside (x-guidance)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string literal is a valid lark string literal


def minimax_end(tokenizer: Any) -> str:
    """MiniMax's end of turn `[e~[`, by id: `<[e~[>` would read as lark's token-id syntax."""
    token = tokenizer.token_to_id("[e~[")
    if token is None:
        raise ValueError("the tokenizer has no [e~[ token (MiniMax-M2's end of turn)")
    return f"<[{token}]>"
