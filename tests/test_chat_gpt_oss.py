"""GPT-OSS chat rendering against openai-harmony, the reference renderer of the harmony format.

The real gpt-oss chat template (test data in shared/data/chat_templates) rendered by minakv, tokenized by
the offline o200k_harmony tokenizer, must give exactly the tokens harmony renders for the same conversation,
and each message must own exactly the tokens harmony renders for its harmony message(s).

What makes the two agree (see docs/ownership.md):
- the same date: the template prints `strftime_now("%Y-%m-%d")`; we pass a fixed `strftime_now` and give
  harmony the same `conversation_start_date`. Model identity and reasoning effort are passed to both.
- the first system/developer message becomes harmony's developer instructions.
Unavoidable differences of the HF template (documented, not hidden):
- a tool result is written `content|tojson`, i.e. as a JSON string literal; harmony writes it raw. We give
  harmony `json.dumps(content)`.
- developer instructions WITHOUT tools end in a blank line in the template ("...\\n\\n<|end|>"), harmony
  writes none. We give harmony the instructions with "\\n\\n" appended in that case.
- tool calls are written `<|start|>assistant to=functions.X<|channel|>commentary json<|message|>`: recipient
  in the header, content type `json` without `<|constrain|>`. We build harmony's message the same way
  (both forms are valid harmony; the model emits either).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from minakv.text.chat import ChatError, count_spanning, normalize_message, render, render_spans
from minakv.text.tokenizer import Tokenizer, gpt_oss_tokenizer_json, o200k_tiktoken_file

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
DATE = "2026-11-30"

harmony = pytest.importorskip("openai_harmony")
H = harmony


@pytest.fixture(scope="module")
def template() -> str:
    path = TEMPLATES / "gpt-oss.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    return path.read_text()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(HFTokenizer.from_file(str(gpt_oss_tokenizer_json())))


@pytest.fixture(scope="module")
def encoding():
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(o200k_tiktoken_file().parent)
    try:
        yield H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city, e.g. San Francisco"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "Days of forecast"},
                "hourly": {"type": "boolean"},
                "fields": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
NO_ARGS = {"type": "function", "function": {"name": "get_time", "description": "Current time."}}


def call(name: str, args: dict, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CONVERSATIONS = {
    "full": (
        [
            {"role": "system", "content": "You are terse. Answer in one line."},
            {"role": "user", "content": "What's the weather in Paris? Ünïcödé ☂"},
            {
                "role": "assistant",
                "reasoning_content": "I should call get_weather for Paris.",
                "content": None,
                "tool_calls": [call("get_weather", {"location": "Paris", "unit": "celsius", "days": 2})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
            {"role": "assistant", "reasoning_content": "Report it.", "content": "21°C and clear in Paris."},
            {"role": "user", "content": "And tomorrow?\n\nThanks!"},
        ],
        [WEATHER, SEARCH, NO_ARGS],
        {"reasoning_effort": "high"},
    ),
    "pending_tool_calls": (
        [
            {"role": "developer", "content": "Use tools when useful."},
            {"role": "user", "content": "Find the docs on caching, then the time."},
            {
                "role": "assistant",
                "reasoning_content": "Search first.",
                "tool_calls": [call("search_docs", {"query": "cache drop ü"}, "c1")],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Drop removes KV of old messages."},
            {"role": "assistant", "content": "", "tool_calls": [call("get_time", {}, "c2")]},
            {"role": "tool", "tool_call_id": "c2", "content": "09:00 ⏰"},
        ],
        [SEARCH, NO_ARGS],
        {"reasoning_effort": "low", "model_identity": "You are Mina, a helpful assistant."},
    ),
    "plain": ([{"role": "user", "content": "Say hi."}], None, {}),
    "multi_turn_no_tools": (
        [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Easy: 4.", "content": "4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
            {"role": "user", "content": "Thanks"},
        ],
        None,
        {"reasoning_effort": "medium"},
    ),
}


def to_harmony(messages: list[dict], tools: list[dict] | None, kwargs: dict) -> list[list]:
    """The same conversation in harmony's own API: per OpenAI message, the harmony messages it becomes
    (message 0 also gets harmony's system message)."""
    system = H.SystemContent.new().with_conversation_start_date(DATE)
    system = system.with_reasoning_effort(H.ReasoningEffort(kwargs.get("reasoning_effort", "medium").title()))
    if "model_identity" in kwargs:
        system = system.with_model_identity(kwargs["model_identity"])
    groups: list[list] = [[H.Message.from_role_and_content(H.Role.SYSTEM, system)]]
    rest = messages
    developer = H.DeveloperContent.new()
    instructions = None
    if messages[0]["role"] in ("system", "developer"):
        instructions, rest = messages[0]["content"], messages[1:]
        if instructions:
            developer = developer.with_instructions(instructions if tools else instructions + "\n\n")
    if tools:
        developer = developer.with_function_tools(
            [
                H.ToolDescription.new(
                    t["function"]["name"], t["function"]["description"], t["function"].get("parameters")
                )
                for t in tools
            ]
        )
    if instructions or tools:
        groups[0].append(H.Message.from_role_and_content(H.Role.DEVELOPER, developer))
    last_call = None
    # Reasoning the model should still see: that of tool calls of the current turn (no final answer after
    # them). Older reasoning is dropped (OpenAI's guidance for harmony; the template does the same).
    final_at = max(
        (j for j, m in enumerate(rest) if m["role"] == "assistant" and not m.get("tool_calls")), default=-1
    )
    for i, m in enumerate(rest):
        group = groups[0] if i == 0 and rest is messages else []
        if m["role"] == "user":
            group.append(H.Message.from_role_and_content(H.Role.USER, m["content"]))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            if m.get("reasoning_content") and i > final_at:
                group.append(
                    H.Message.from_role_and_content(H.Role.ASSISTANT, m["reasoning_content"]).with_channel(
                        "analysis"
                    )
                )
            group.append(
                H.Message.from_role_and_content(
                    H.Role.ASSISTANT, json.dumps(json.loads(fn["arguments"]), ensure_ascii=False)
                )
                .with_channel("commentary")
                .with_recipient("functions." + fn["name"])
                .with_content_type("json")
            )
            last_call = fn["name"]
        elif m["role"] == "assistant":
            group.append(
                H.Message.from_role_and_content(H.Role.ASSISTANT, m["content"]).with_channel("final")
            )
        elif m["role"] == "tool":
            author = H.Author.new(H.Role.TOOL, f"functions.{last_call}")
            group.append(
                H.Message.from_author_and_content(author, json.dumps(m["content"], ensure_ascii=False))
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        if group is not groups[0]:
            groups.append(group)
    return groups


def harmony_owners(groups: list[list], expected: list[int], encoding) -> list[int]:
    """Owner of each of harmony's tokens: message i owns the tokens harmony renders for its harmony
    messages, in order; the generation prompt is owner N. Harmony's system message renders differently alone (it
    mentions tools only inside a conversation), so message 0 owns everything before message 1."""
    at = len(encoding.render_conversation(H.Conversation.from_messages(groups[0])))
    assert expected[:at] == encoding.render_conversation(H.Conversation.from_messages(groups[0]))
    owners = [0] * at
    for i, group in enumerate(groups[1:], start=1):
        for m in group:
            toks = encoding.render(m)
            assert expected[at : at + len(toks)] == toks
            owners += [i] * len(toks)
            at += len(toks)
    prompt = encoding.encode("<|start|>assistant", allowed_special="all")
    assert expected[at:] == prompt
    return owners + [len(groups)] * len(prompt)


# harmony's own auto-drop is a heuristic (drop analysis before the FIRST final message, and only when the last
# assistant message is a final one) that keeps stale reasoning in multi-turn chats; we give harmony exactly
# the messages to render instead.
NO_AUTO_DROP = H.RenderConversationConfig(auto_drop_analysis=False)


def check_against_harmony(messages, tools, kwargs, template, tokenizer, encoding) -> None:
    rendered = render(messages, tokenizer, template, tools=tools, strftime_now=lambda fmt: DATE, **kwargs)
    groups = to_harmony(messages, tools, kwargs)
    convo = H.Conversation.from_messages([m for g in groups for m in g])
    expected = encoding.render_conversation_for_completion(convo, H.Role.ASSISTANT, NO_AUTO_DROP)
    assert rendered.token_ids == expected, (rendered.text, encoding.decode_utf8(expected))
    assert rendered.owners == harmony_owners(groups, expected, encoding)
    assert rendered.num_messages == len(messages)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tokens_and_owners_equal_harmony(name, template, tokenizer, encoding):
    check_against_harmony(*CONVERSATIONS[name], template, tokenizer, encoding)


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24).filter(lambda t: "<|" not in t)
ARGS = st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=5),
    st.one_of(st.integers(), st.booleans(), st.none(), TEXT),
    max_size=3,
)


@st.composite
def conversations(draw) -> tuple[list[dict], list[dict] | None, dict]:
    """Valid conversations: optional system/developer, user turns, tool-call rounds (one call per assistant
    message, as the template assumes) with one or more results, optional final answers."""
    tools = draw(st.sampled_from([None, [WEATHER], [WEATHER, SEARCH, NO_ARGS]]))
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        for _ in range(draw(st.integers(0, 2))):
            name = draw(st.sampled_from(["get_weather", "search_docs", "get_time"]))
            reply = {"role": "assistant", "content": None, "tool_calls": [call(name, draw(ARGS))]}
            if draw(st.booleans()):
                reply["reasoning_content"] = draw(TEXT)
            messages.append(reply)
            messages += [{"role": "tool", "content": draw(TEXT)} for _ in range(draw(st.integers(1, 2)))]
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT)})
            if draw(st.booleans()):
                messages.append({"role": "user", "content": draw(TEXT)})
    kwargs = {"reasoning_effort": draw(st.sampled_from(["low", "medium", "high"]))}
    if draw(st.booleans()):
        kwargs["model_identity"] = draw(TEXT.filter(bool))
    return messages, tools, kwargs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=conversations())
def test_random_conversations_equal_harmony(conversation, template, tokenizer, encoding):
    check_against_harmony(*conversation, template, tokenizer, encoding)


def test_old_analysis_dropped_and_owners_still_right(template, tokenizer):
    """The template drops a tool call's reasoning once a later final answer exists (a rewrite of an earlier
    message that depends on a later one): ownership must follow the full render, not prefixes."""
    messages, tools, kwargs = CONVERSATIONS["full"]
    full = render(messages, tokenizer, template, tools=tools, strftime_now=lambda fmt: DATE, **kwargs)
    prefix = render(messages[:4], tokenizer, template, tools=tools, strftime_now=lambda fmt: DATE, **kwargs)
    reasoning = messages[2]["reasoning_content"]
    assert reasoning in prefix.text and reasoning not in full.text
    assert tokenizer.decode([t for t, o in zip(full.token_ids, full.owners) if o == 2]) == (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"location": "Paris", "unit": "celsius", "days": 2}<|call|>'
    )
    assert tokenizer.decode([t for t, o in zip(prefix.token_ids, prefix.owners) if o == 2]).startswith(
        "<|start|>assistant<|channel|>analysis<|message|>" + reasoning + "<|end|>"
    )


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_each_message_decodes_to_its_text_and_drops_cleanly(name, template, tokenizer):
    messages, tools, kwargs = CONVERSATIONS[name]
    r = render(messages, tokenizer, template, tools=tools, strftime_now=lambda fmt: DATE, **kwargs)
    assert r.owners == sorted(r.owners) and set(r.owners) <= set(range(len(messages) + 1))
    _, runs = render_spans(
        [normalize_message(m, i) for i, m in enumerate(messages)], template, tools, True,
        strftime_now=lambda fmt: DATE, **kwargs,
    )  # fmt: skip
    assert count_spanning(r.offsets, runs) == 0  # every boundary is a special token
    pieces = [
        tokenizer.decode([t for t, o in zip(r.token_ids, r.owners) if o == i])
        for i in range(len(messages) + 1)
    ]
    assert "".join(pieces) == r.text
    for i, piece in enumerate(pieces[:-1]):
        if piece:  # every rendered message starts with its own header
            assert piece.startswith("<|start|>"), (i, piece)
        # Dropping message i leaves exactly the tokens of the text without it (boundaries are clean).
        kept = [t for t, o in zip(r.token_ids, r.owners) if o != i]
        assert kept == tokenizer.encode("".join(pieces[:i] + pieces[i + 1 :]))
    assert pieces[-1] == "<|start|>assistant"


class FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 11, 30)


def test_matches_transformers_jinja_rendering(template, monkeypatch):
    """Our Jinja environment renders the real template exactly as transformers does."""
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    monkeypatch.setattr(chat_utils, "datetime", FixedDatetime)  # transformers' strftime_now reads it
    for messages, tools, kwargs in CONVERSATIONS.values():
        hf_messages = [
            {**m, "content": m.get("content") or ""}
            | (
                {
                    "tool_calls": [
                        {
                            **c,
                            "function": {
                                **c["function"],
                                "arguments": json.loads(c["function"]["arguments"]),
                            },
                        }
                        for c in m["tool_calls"]
                    ]
                }
                if m.get("tool_calls")
                else {}
            )
            for m in messages
        ]
        want = chat_utils.render_jinja_template(
            [hf_messages], tools=tools, chat_template=template, add_generation_prompt=True, **kwargs,
        )  # fmt: skip
        want = want[0][0] if isinstance(want, tuple) else want[0]
        text, _ = render_spans(
            [normalize_message(m, i) for i, m in enumerate(messages)], template, tools, True,
            strftime_now=lambda fmt: DATE, **kwargs,
        )  # fmt: skip
        assert text == want


def test_template_errors_are_clear(template, tokenizer):
    with pytest.raises(ChatError, match="no previous assistant message with a tool call"):
        render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], tokenizer, template)
    with pytest.raises(ChatError, match=r"<\|channel\|> tags in the content field"):
        render([{"role": "assistant", "content": "<|channel|>final<|message|>x"}], tokenizer, template)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=conversations())
def test_random_conversations_equal_harmony_many(conversation, template, tokenizer, encoding):
    check_against_harmony(*conversation, template, tokenizer, encoding)
