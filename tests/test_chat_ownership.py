"""Token ownership on small templates that stress the loop hooks: look-ahead loops over messages,
`loop.last` (which makes Jinja fetch the next item early), break/continue, macros, tuple targets, and a
token that spans two messages. Each expected owner list is written out by hand."""

from __future__ import annotations

import pytest

from minakv.presets.tiny import GPT_OSS_TEMPLATE, MINIMAX_TEMPLATE, minimax_tokenizer
from minakv.text.chat import ChatError, Rendered, count_spanning, render, render_spans
from minakv.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(minimax_tokenizer())


def owner_runs(messages: list[dict], template: str, agp: bool = True) -> list[tuple[str, int]]:
    text, runs = render_spans(messages, template, None, agp)
    ends = [s for s, _ in runs[1:]] + [len(text)]
    return [(text[s:e], o) for (s, o), e in zip(runs, ends)]


MSGS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def test_preamble_look_ahead_and_generation_prompt():
    template = (
        "<bos>{% set sys = messages[0].content %}[{{ sys }}]"
        "{% for m in messages[1:] %}"
        "{% set ns = namespace(later=0) %}{% for f in messages[loop.index:] %}{% set ns.later = ns.later + 1 %}"
        "{% endfor %}<{{ m.role }}:{{ ns.later }}>{{ m.content }}{% if loop.last %}</last>{% endif %}</>"
        "{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}"
    )
    assert owner_runs(MSGS, template) == [
        ("<bos>[S]", 0),
        ("<user:3>U1</>", 1),
        ("<assistant:2>A1</>", 2),
        ("<user:1>U2</last></>", 3),
        ("<gen>", 4),
    ]
    assert owner_runs(MSGS, template, agp=False)[-1] == ("<user:1>U2</last></>", 3)


def test_break_continue_macros_and_tuple_targets():
    template = (
        "{% macro show(m) %}<{{ m.role }}>{{ m.content }}{% endmacro %}"
        "{% for m in messages %}{% for k, v in m.items() %}{% if k == 'role' %}{% break %}{% endif %}{% endfor %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% for x in messages %}{% if x is sameas m %}{% break %}{% endif %}{% endfor %}"
        "{{ show(m) }}{% endfor %}<gen>"
    )
    assert owner_runs(MSGS, template) == [
        ("<user>U1", 1),
        ("<assistant>A1", 2),
        ("<user>U2", 3),
        ("<gen>", 4),
    ]


def test_only_system_message_gets_generation_prompt_owner():
    template = (
        "{{ messages[0].content }}{% for m in messages[1:] %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    assert owner_runs(MSGS[:1], template) == [("S", 0), ("<gen>", 1)]


def test_out_of_order_template_is_refused():
    template = "{% for m in messages|reverse %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatError, match="renders message 2 after message 3"):
        render_spans(MSGS, template, None, True)


def test_loop_inside_a_macro_is_refused():
    template = "{% macro all() %}{% for m in messages %}{{ m.content }}{% endfor %}{% endmacro %}{{ all() }}"
    with pytest.raises(ChatError, match="renders into a macro"):
        render_spans(MSGS, template, None, True)


def test_token_spanning_a_boundary_goes_to_the_first_message(tokenizer):
    """`hel` + `lo` render as "hello", one token of the synthetic vocabulary: it cannot be split, so it
    belongs to the message its first character came from, and count_spanning reports it."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "hel"}, {"role": "user", "content": "lo world"}]
    r = render(msgs, tokenizer, template, add_generation_prompt=False)
    assert tokenizer.decode(r.token_ids[:1]) == "hello"
    assert r.owners[0] == 0 and set(r.owners[1:]) == {1}
    assert r.offsets[:2] == [(0, 5), (5, 11)]  # "hello", " world"
    _, runs = render_spans(msgs, template, None, False)
    _, offsets = tokenizer.encode_with_offsets(r.text)
    assert count_spanning(offsets, runs) == 1


@pytest.mark.parametrize(
    "template", [GPT_OSS_TEMPLATE, MINIMAX_TEMPLATE], ids=["tiny-gpt-oss", "tiny-minimax"]
)
def test_tiny_preset_templates(template, tokenizer):
    """The tiny presets' own templates: every message owns a block that starts with its header."""
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "name": "f", "content": "ok"},
    ]
    text, runs = render_spans([dict(m, content=m["content"] or "") for m in msgs], template, None, True)
    r = render(msgs, tokenizer, template)
    assert isinstance(r, Rendered) and r.num_messages == 4 and r.owners == sorted(r.owners)
    assert [o for _, o in runs] == [0, 1, 2, 3, 4]
    _, offsets = tokenizer.encode_with_offsets(text)
    assert count_spanning(offsets, runs) == 0


def test_bad_input_errors(tokenizer):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatError, match=r"messages\[1\] must be an object"):
        render([{"role": "user", "content": "a"}, "b"], tokenizer, template)
    with pytest.raises(ChatError, match=r"messages\[0\].role must be a string"):
        render([{"content": "a"}], tokenizer, template)
    with pytest.raises(ChatError, match=r"messages\[0\].content\[0\]: only text parts"):
        render([{"role": "user", "content": [{"type": "image_url"}]}], tokenizer, template)
    with pytest.raises(ChatError, match=r"tool_calls\[0\].function.arguments is not valid JSON"):
        bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
        render([bad], tokenizer, template)
    with pytest.raises(ChatError, match="syntax error at line 1"):
        render([{"role": "user", "content": "a"}], tokenizer, "{% for m in messages %}")
    with pytest.raises(ChatError, match="has no chat template"):
        render([{"role": "user", "content": "a"}], tokenizer)
    with pytest.raises(ChatError, match="boom"):
        render([{"role": "user", "content": "a"}], tokenizer, "{{ raise_exception('boom') }}")
    with pytest.raises(ChatError, match="template failed on these messages: TypeError"):
        render([{"role": "user", "content": "a"}], tokenizer, "{{ messages[0].content + 1 }}")
    with pytest.raises(ChatError, match="unsafe|not safely callable|access to attribute"):
        render([{"role": "user", "content": "a"}], tokenizer, "{{ messages.__class__.__mro__ }}")


def test_text_parts_are_joined(tokenizer):
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(msgs, tokenizer, template).text == "[ab]"
