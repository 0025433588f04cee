"""MiniMax-M2 chat rendering with the real template (shared test data): text equal to transformers' own
Jinja rendering, and each message owning exactly its part of the format, written out by hand below from the
MiniMax-M2 format (`]~b]role\\n...[e~[\\n`, consecutive tool results under one `]~b]tool` header, reasoning
kept only after the last user turn). MiniMax's tokenizer is not on PyPI; we use the synthetic byte-level BPE
with MiniMax's special tokens that the tiny preset uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv.presets.tiny import minimax_tokenizer
from minakv.text.chat import count_spanning, normalize_message, render, render_spans
from minakv.text.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"


@pytest.fixture(scope="module")
def template() -> str:
    path = TEMPLATES / "minimax-m2.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    return path.read_text()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(minimax_tokenizer())


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather.",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["location"],
            },
        },
    }
]


def call(name: str, args: dict, id_: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "reasoning_content": "Call the tool twice.",
        "content": "Checking.",
        "tool_calls": [
            call("get_weather", {"location": "Paris", "days": 2}, "c1"),
            call("get_weather", {"location": "Rome"}, "c2"),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'},
    {"role": "assistant", "reasoning_content": "Summarize.", "content": "Paris 21, Rome 25."},
    {"role": "user", "content": "Thanks ☀"},
]
CALLS = (
    '\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="location">Paris</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_weather">\n'
    '<parameter name="location">Rome</parameter>\n</invoke>\n</minimax:tool_call>\n'
)


def owned_texts(r, tokenizer) -> list[str]:
    return [
        tokenizer.decode([t for t, o in zip(r.token_ids, r.owners) if o == i])
        for i in range(r.num_messages + 1)
    ]


def test_owners_follow_the_format(template, tokenizer):
    r = render(MESSAGES, tokenizer, template, tools=TOOLS)
    texts = owned_texts(r, tokenizer)
    assert texts[0].startswith("]~!b[]~b]system\nBe brief.\n\n# Tools\n")
    assert '<tool>{"name": "get_weather", "description": "Get the weather."' in texts[0]
    assert texts[0].endswith("</minimax:tool_call>[e~[\n")
    assert texts[1:] == [
        "]~b]user\nWeather in Paris and Rome?[e~[\n",
        "]~b]ai\nChecking." + CALLS + "[e~[\n",  # reasoning dropped: a user turn follows
        ']~b]tool\n<response>{"temp": 21}</response>',  # the shared header goes to the first tool result
        '\n<response>{"temp": 25}</response>[e~[\n',  # the shared end marker to the last
        "]~b]ai\nParis 21, Rome 25.[e~[\n",
        "]~b]user\nThanks ☀[e~[\n",
        "]~b]ai\n<think>\n",  # the generation prompt, owner N
    ]
    assert "".join(texts) == r.text and r.owners == sorted(r.owners)


def test_reasoning_after_last_user_is_kept_and_owned(template, tokenizer):
    """Same messages cut after the tool results: now no user turn follows message 2, so the template
    renders its reasoning; the rewrite moves ownership with it."""
    r = render(MESSAGES[:5], tokenizer, template, tools=TOOLS)
    texts = owned_texts(r, tokenizer)
    assert texts[2] == "]~b]ai\n<think>\nCall the tool twice.\n</think>\n\nChecking." + CALLS + "[e~[\n"
    assert texts[5] == "]~b]ai\n<think>\n"


@pytest.mark.parametrize("cut", [2, 5, 7])
def test_dropping_a_message_drops_exactly_its_tokens(template, tokenizer, cut):
    r = render(MESSAGES[:cut], tokenizer, template, tools=TOOLS)
    texts = owned_texts(r, tokenizer)
    for i in range(cut):
        kept = [t for t, o in zip(r.token_ids, r.owners) if o != i]
        assert kept == tokenizer.encode("".join(texts[:i] + texts[i + 1 :]))


def test_no_generation_prompt(template, tokenizer):
    r = render(MESSAGES, tokenizer, template, tools=TOOLS, add_generation_prompt=False)
    assert max(r.owners) == len(MESSAGES) - 1
    assert owned_texts(r, tokenizer)[-2] == "]~b]user\nThanks ☀[e~[\n"


def test_matches_transformers_jinja_rendering(template):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for cut in (2, 5, 7):
        messages = [normalize_message(m, i) for i, m in enumerate(MESSAGES[:cut])]
        for agp in (True, False):
            want = chat_utils.render_jinja_template(
                [messages], tools=TOOLS, chat_template=template, add_generation_prompt=agp
            )
            text, _ = render_spans(messages, template, TOOLS, agp)
            assert text == want[0][0]


BAD = ("]~", "[e~", "<think", "</think", "<minimax", "</minimax")
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20).filter(
    lambda t: not any(b in t for b in BAD)
)


@st.composite
def conversations(draw) -> list[dict]:
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        for _ in range(draw(st.integers(0, 2))):
            args = draw(st.fixed_dictionaries({"location": TEXT}, optional={"days": st.integers(0, 9)}))
            reply = {
                "role": "assistant",
                "content": draw(TEXT),
                "tool_calls": [call("get_weather", args, "c")],
            }
            if draw(st.booleans()):
                reply["reasoning_content"] = draw(TEXT)
            messages.append(reply)
            messages += [{"role": "tool", "content": draw(TEXT)} for _ in range(draw(st.integers(1, 3)))]
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT)})
    return messages


def expected_piece(messages: list[dict], i: int) -> str | None:
    """What message i renders to, from the MiniMax-M2 format (None: only checked loosely)."""
    m = messages[i]
    if m["role"] == "user":
        return f"]~b]user\n{m['content']}[e~[\n"
    if m["role"] == "tool":
        first = messages[i - 1]["role"] != "tool"
        last = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
        return (
            ("]~b]tool" if first else "")
            + f"\n<response>{m['content']}</response>"
            + ("[e~[\n" if last else "")
        )
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), agp=st.booleans())
def test_random_conversations_ownership(messages, agp, template, tokenizer):
    r = render(messages, tokenizer, template, tools=TOOLS, add_generation_prompt=agp)
    texts = owned_texts(r, tokenizer)
    assert r.owners == sorted(r.owners) and "".join(texts) == r.text
    assert texts[0].startswith("]~!b[]~b]system\n")
    _, runs = render_spans([normalize_message(m, i) for i, m in enumerate(messages)], template, TOOLS, agp)
    assert count_spanning(r.offsets, runs) == 0
    for i, m in enumerate(messages):
        if i == 0 and m["role"] == "system":
            continue
        want = expected_piece(messages, i)
        if want is not None and i == 0:  # no system message: the template's system block is message 0's
            assert texts[0].startswith("]~!b[]~b]system\n") and texts[0].endswith(want)
        elif want is not None:
            assert texts[i] == want
        else:  # assistant
            assert (
                texts[i].startswith("]~b]ai\n") and texts[i].endswith("[e~[\n") and m["content"] in texts[i]
            )
        kept = [t for t, o in zip(r.token_ids, r.owners) if o != i]
        assert kept == tokenizer.encode("".join(texts[:i] + texts[i + 1 :]))
    assert texts[-1] == ("]~b]ai\n<think>\n" if agp else "")
