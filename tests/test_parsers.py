"""Output parsers on REAL rendered assistant text: an assistant message with reasoning and tool calls is
rendered by the real chat template (and, for GPT-OSS, by openai-harmony), the part after the generation
prompt is taken as if the model had produced it, parsed back, and compared with the original message.
GPT-OSS parses are also checked against harmony's own completion parser. Streaming must give the same
result for every way of splitting the text (hypothesis over split points), never emitting text that later
turns out to be a tag."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minakv.text.chat import normalize_message, render_spans
from minakv.text.parsers import (
    HarmonyParser,
    MiniMaxParser,
    ParsedOutput,
    Piece,
    collect,
    convert,
    make_parser,
    parse_output,
)
from minakv.text.tokenizer import o200k_tiktoken_file

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"


def read_template(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    return path.read_text()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "ratio": {"type": "number"},
                "fields": {"type": "array", "items": {"type": "string"}},
                "filters": {"type": "object"},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}
ARGS = {
    "location": "São Paulo <city>",
    "days": 3,
    "hourly": True,
    "ratio": 0.5,
    "fields": ["temp", "wind"],
    "filters": {"max": 30},
    "note": "line1\nline2",
}
USER = {"role": "user", "content": "Weather in São Paulo?"}


def call(name: str, args: dict, id_: str = "c1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def model_output(template: str, history: list[dict], reply: dict, tools: list[dict] | None) -> str:
    """The text the model would have produced for `reply`: render with and without it, take the tail."""
    history = [normalize_message(m, i) for i, m in enumerate(history)]
    prompt, _ = render_spans(history, template, tools, True, strftime_now=lambda f: "2026-11-30")
    full, _ = render_spans(
        [*history, normalize_message(reply, len(history))],
        template,
        tools,
        False,
        strftime_now=lambda f: "2026-11-30",
    )
    assert full.startswith(prompt)
    return full[len(prompt) :]


def check_same(parsed: ParsedOutput, reply: dict) -> None:
    assert parsed.reasoning_content == reply.get("reasoning_content")
    assert parsed.content == (reply.get("content") or None)
    want = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.get("tool_calls", [])
    ]
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == want
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


def stream(parser, text: str, cuts: list[int]) -> list[Piece]:
    pieces, at = [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces += parser.feed(text[at:cut])
        at = cut
    return pieces + parser.finish()


def check_streaming(make, text: str, cuts: list[int]) -> None:
    """Streaming over the given split points equals the one-shot parse, and every emitted prefix of
    reasoning/content stays a prefix of the final value (nothing emitted is later taken back)."""
    whole = make().parse(text)
    pieces = stream(make(), text, cuts)
    assert collect(pieces) == whole
    so_far = {"reasoning": "", "content": ""}
    for d in pieces:
        if d.kind in so_far:
            so_far[d.kind] += d.text
            final = whole.reasoning_content if d.kind == "reasoning" else whole.content
            assert (final or "").startswith(so_far[d.kind])


# ---------------------------------------------------------------------------------------------------------
# GPT-OSS


@pytest.fixture(scope="module")
def gpt_oss_outputs() -> dict[str, tuple[str, dict]]:
    """name -> (model output text, the assistant message it came from)."""
    template = read_template("gpt-oss.jinja")
    tools = [WEATHER]
    tool_reply = {
        "role": "assistant",
        "reasoning_content": "User wants weather; call get_weather.",
        "tool_calls": [call("get_weather", ARGS)],
    }
    final_reply = {
        "role": "assistant",
        "reasoning_content": "Say hello.",
        "content": "Hello! ☀ How can I help?",
    }
    outputs = {
        "template_tool_call": (model_output(template, [USER], tool_reply, tools), tool_reply),
        "template_final": (model_output(template, [USER], final_reply, tools), final_reply),
    }
    outputs.update(harmony_outputs(tool_reply, final_reply))
    return outputs


def harmony_outputs(tool_reply: dict, final_reply: dict) -> dict[str, tuple[str, dict]]:
    """The same replies rendered by openai-harmony itself, in the form the model emits them (recipient after
    the channel, `<|constrain|>json`), two tool calls in a row, and a commentary preamble."""
    H = pytest.importorskip("openai_harmony")
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(o200k_tiktoken_file().parent))
    enc = H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)

    def text(*messages) -> str:
        toks = [t for m in messages for t in enc.render(m)]
        return enc.decode_utf8(toks).removeprefix("<|start|>assistant")

    def assistant(content: str, channel: str):
        return H.Message.from_role_and_content(H.Role.ASSISTANT, content).with_channel(channel)

    second = {"location": "Rome"}
    calls = [
        assistant(json.dumps(args), "commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
        for args in (ARGS, second)
    ]
    two_calls = dict(tool_reply, tool_calls=[call("get_weather", ARGS), call("get_weather", second, "c2")])
    preamble = {"role": "assistant", "content": "Checking now.", "tool_calls": [call("get_weather", second)]}
    harmony_calls = text(assistant(tool_reply["reasoning_content"], "analysis"), *calls)
    # Models also write the recipient after the channel (the form in harmony's docs); both are valid.
    channel_first = harmony_calls.replace(
        " to=functions.get_weather<|channel|>commentary", "<|channel|>commentary to=functions.get_weather"
    )
    assert channel_first != harmony_calls
    return {
        "harmony_channel_first": (channel_first, two_calls),
        "harmony_tool_calls": (
            text(assistant(tool_reply["reasoning_content"], "analysis"), *calls),
            two_calls,
        ),
        "harmony_final": (
            text(
                assistant(final_reply["reasoning_content"], "analysis"),
                assistant(final_reply["content"], "final"),
            ).removesuffix("<|end|>")
            + "<|return|>",
            final_reply,
        ),
        "harmony_preamble": (text(assistant("Checking now.", "commentary"), calls[1]), preamble),
    }


def test_gpt_oss_round_trip(gpt_oss_outputs):
    assert "<|channel|>analysis<|message|>" in gpt_oss_outputs["template_tool_call"][0]
    assert "<|constrain|>json" in gpt_oss_outputs["harmony_tool_calls"][0]
    for text, reply in gpt_oss_outputs.values():
        check_same(parse_output(text, "gpt_oss"), reply)
        check_streaming(
            lambda: HarmonyParser(id_prefix="call_"), text, list(range(len(text)))
        )  # 1 char at a time


def test_gpt_oss_agrees_with_harmony_parser(gpt_oss_outputs):
    """harmony's own parser, on the tokens of each output, finds the same channels, recipients and texts."""
    H = pytest.importorskip("openai_harmony")
    enc = H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)
    for text, _ in gpt_oss_outputs.values():
        tokens = enc.encode(text, allowed_special="all")
        messages = enc.parse_messages_from_completion_tokens(tokens, H.Role.ASSISTANT)
        want, want_calls = ParsedOutput(), []
        for m in messages:
            body = "".join(c.text for c in m.content)
            if m.recipient:
                want_calls.append((m.recipient.removeprefix("functions."), json.loads(body)))
            elif m.channel == "analysis":
                want.reasoning_content = (want.reasoning_content or "") + body
            else:
                want.content = (want.content or "") + body
        got = parse_output(text, "gpt_oss")
        assert (got.reasoning_content, got.content) == (want.reasoning_content, want.content)
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == want_calls


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_gpt_oss_streaming_any_split(gpt_oss_outputs, data):
    text, _ = gpt_oss_outputs[data.draw(st.sampled_from(sorted(gpt_oss_outputs)))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    check_streaming(lambda: HarmonyParser(id_prefix="call_"), text, cuts)


def test_gpt_oss_streaming_deltas_shape(gpt_oss_outputs):
    text, _ = gpt_oss_outputs["template_tool_call"]
    pieces = stream(HarmonyParser(id_prefix="x_"), text, list(range(0, len(text), 7)))
    calls = [d for d in pieces if d.kind == "tool_call"]
    assert calls[0].id == "x_0" and calls[0].name == "get_weather"  # header first, then argument pieces
    assert all(d.id is None and d.name is None for d in calls[1:]) and len(calls) > 2


def test_gpt_oss_plain_text_is_content():
    """A model that does not write harmony (e.g. a random tiny model) gets its text back as content."""
    assert parse_output("just words, no headers", "gpt_oss") == ParsedOutput(content="just words, no headers")
    long = "x" * 1000 + "<|message|>y"
    assert parse_output(long, "gpt_oss").content == long
    cut = "<|channel|>final<|message|>Hi<|end|><|start|>assistant<|chan"  # cut inside the next header
    assert parse_output(cut, "gpt_oss") == ParsedOutput(content="Hi")


# ---------------------------------------------------------------------------------------------------------
# MiniMax-M2


@pytest.fixture(scope="module")
def minimax_outputs() -> dict[str, tuple[str, dict]]:
    template = read_template("minimax-m2.jinja")
    replies = {
        "tool_calls": {
            "role": "assistant",
            "reasoning_content": "Need the weather.\nCall the tool twice.",
            "content": "Let me check.",
            "tool_calls": [call("get_weather", ARGS), call("get_weather", {"location": "Rome"}, "c2")],
        },
        "tool_call_only": {
            "role": "assistant",
            "reasoning_content": "Just call it.",
            "tool_calls": [call("get_weather", {"location": "Oslo", "days": 1})],
        },
        "final": {
            "role": "assistant",
            "reasoning_content": "Answer kindly.",
            "content": "It is sunny ☀ in <b>Rome</b>.",
        },
    }
    return {
        name: (model_output(template, [USER], reply, [WEATHER]), reply) for name, reply in replies.items()
    }


def test_minimax_round_trip(minimax_outputs):
    text = minimax_outputs["tool_calls"][0]
    assert text.startswith("Need the weather.") and "<minimax:tool_call>" in text and text.endswith("[e~[\n")
    for text, reply in minimax_outputs.values():
        check_same(parse_output(text, "minimax_m2", [WEATHER]), reply)
        check_streaming(lambda: MiniMaxParser([WEATHER], id_prefix="call_"), text, list(range(len(text))))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_minimax_streaming_any_split(minimax_outputs, data):
    text, _ = minimax_outputs[data.draw(st.sampled_from(sorted(minimax_outputs)))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    check_streaming(lambda: MiniMaxParser([WEATHER], id_prefix="call_"), text, cuts)


def test_minimax_without_schema_values_stay_strings():
    text = 'r</think>\n<minimax:tool_call>\n<invoke name="f">\n<parameter name="n">2</parameter>\n</invoke>\n</minimax:tool_call>'
    got = parse_output(text, "minimax_m2")
    assert got.reasoning_content == "r" and json.loads(got.tool_calls[0].arguments) == {"n": "2"}


def test_minimax_cut_off_output():
    """max_tokens can cut anywhere: no </think> means all reasoning; a cut tool call keeps what is complete."""
    assert parse_output("thinking...", "minimax_m2") == ParsedOutput(reasoning_content="thinking...")
    cut = 'x</think>ok\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">4</parameter>\n<param'
    got = parse_output(cut, "minimax_m2", [WEATHER])
    assert got.content == "ok" and json.loads(got.tool_calls[0].arguments) == {"days": 4}


def test_convert_by_schema():
    assert convert("3", {"type": "integer"}) == 3
    assert convert("3.5", {"type": "number"}) == 3.5
    assert convert("x", {"type": "integer"}) == "x"  # not convertible: left as text
    assert convert("null", {"type": ["integer", "null"]}) is None
    assert convert("False", {"type": "boolean"}) is False
    assert convert("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert("007", {"type": "string"}) == "007"


# ---------------------------------------------------------------------------------------------------------
# Split invariance on arbitrary mixtures of tag fragments (no crash, same result for every split)

PIECES = {
    "gpt_oss": ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|call|>",
                "<|return|>", "<|start|>assistant", " to=functions.f", " json", "<|", "|>", "<", "hi", " ", "\n", "{}"],
    "minimax_m2": ["<think>", "</think>", "</thi", "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">',
                   '<parameter name="a">', "</parameter>", "</invoke>", "[e~[", "<", "\n", "\n\n", "x", "1"],
}  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_split_invariance_on_fragment_soup(data):
    arch = data.draw(st.sampled_from(sorted(PIECES)))
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[arch]), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    check_streaming(lambda: make_parser(arch, id_prefix="c"), text, cuts)


def test_plain_parser():
    assert parse_output("a<|end|>b", None) == ParsedOutput(content="a<|end|>b")


# ---------------------------------------------------------------------------------------------------------
# Random replies through the real templates: parse(render(reply)) == reply

SPECIALS = ("<|", "]~", "[e~", "<think", "</think", "<minimax", "</minimax", "<invoke", "</invoke", "<parameter",
            "</parameter")  # fmt: skip
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20).filter(
    lambda t: not any(s in t for s in SPECIALS)
)
VALUES = {
    "location": TEXT.filter(lambda t: t == t.strip("\n")),  # MiniMax trims newlines around values
    "days": st.integers(-5, 10**6),
    "hourly": st.booleans(),
    "ratio": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not x.is_integer()),
    "fields": st.lists(TEXT, max_size=3),
    "filters": st.dictionaries(TEXT, st.integers(), max_size=2),
    "note": st.one_of(st.none(), TEXT.filter(lambda t: t not in ("null",) and t == t.strip("\n"))),
}


@st.composite
def replies(draw, family: str) -> dict:
    stripped = TEXT.filter(lambda t: t == t.strip("\n"))  # MiniMax trims newlines around sections
    reply = {"role": "assistant", "reasoning_content": draw(stripped.filter(bool))}
    n_calls = draw(st.integers(0, 1 if family == "gpt_oss" else 3))  # the gpt-oss template renders one call
    if n_calls == 0 or family == "minimax_m2":
        reply["content"] = draw(stripped.filter(bool) if n_calls == 0 else stripped)
    if n_calls:
        keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=4))
        reply["tool_calls"] = [
            call("get_weather", {k: draw(VALUES[k]) for k in keys}, f"c{j}") for j in range(n_calls)
        ]
    return reply


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_replies_round_trip(data):
    family = data.draw(st.sampled_from(["gpt_oss", "minimax_m2"]))
    template = read_template("gpt-oss.jinja" if family == "gpt_oss" else "minimax-m2.jinja")
    reply = data.draw(replies(family))
    text = model_output(template, [USER], reply, [WEATHER])
    check_same(parse_output(text, family, [WEATHER]), reply)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    check_streaming(lambda: make_parser(family, [WEATHER], id_prefix="c"), text, cuts)
