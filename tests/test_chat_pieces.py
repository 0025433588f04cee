"""Rendering message by message through the piece cache (minakv/text/pieces.py) gives exactly the tokens,
owners and character spans of tokenizing the whole rendered text at once, on the real templates of both
families (shared test data, skipped where absent) and the tiny presets'; an unsafe template falls back to
whole-text encoding; a later round reuses the earlier messages' tokens; the cache stays within budget."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from minakv.presets.tiny import GPT_OSS_TEMPLATE, MINIMAX_TEMPLATE, minimax_tokenizer
from minakv.text.chat import normalize_message, owners_of_tokens, render, render_spans
from minakv.text.pieces import PieceCache, encode_runs
from minakv.text.tokenizer import Tokenizer, gpt_oss_tokenizer_json

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
WORDS = [
    "the",
    "tool",
    "said",
    "ok",
    "error",
    "42",
    "{json}",
    "<b>",
    "café",
    "你好",
    "",
    "\n\t",
    "emoji",
    "😀",
    "]~b",
    "~[",
    "<|x",
]


def gpt_oss() -> Tokenizer:
    return Tokenizer(HFTokenizer.from_file(str(gpt_oss_tokenizer_json())))


def minimax() -> Tokenizer:
    return Tokenizer(minimax_tokenizer())


def template(name: str, tiny: str) -> str:
    if name == "tiny":
        return tiny
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    return path.read_text()


CASES = {
    "gpt-oss": (gpt_oss, "gpt-oss.jinja", GPT_OSS_TEMPLATE),
    "gpt-oss-tiny": (gpt_oss, "tiny", GPT_OSS_TEMPLATE),
    "minimax": (minimax, "minimax-m2.jinja", MINIMAX_TEMPLATE),
    "minimax-tiny": (minimax, "tiny", MINIMAX_TEMPLATE),
}


def conversation(rng: random.Random, rounds: int) -> list[dict]:
    """An agent's history: system, user, then assistant turns (text, reasoning, tool calls) and tool results."""

    def text(n: int) -> str:
        return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n))

    msgs = [{"role": "system", "content": text(8)}, {"role": "user", "content": text(6)}]
    for j in range(rounds):
        call = {"id": f"c{j}", "type": "function", "function": {"name": "run", "arguments": '{"x": 1}'}}
        said = {"content": text(3)} if rng.random() < 0.5 else {"content": "", "reasoning_content": text(4)}
        msgs.append({"role": "assistant", **said, "tool_calls": [call]})  # (gpt-oss refuses both at once)
        msgs.append(
            {"role": "tool", "tool_call_id": f"c{j}", "name": "run", "content": text(rng.randint(0, 30))}
        )
    return msgs


def whole(messages: list[dict], tokenizer: Tokenizer, tmpl: str) -> tuple[list[int], list[int], np.ndarray]:
    """The reference: render, then tokenize the whole text once and give each token its first char's owner."""
    normalized = [normalize_message(m, i) for i, m in enumerate(messages)]
    text, runs = render_spans(normalized, tmpl, None, True)
    ids, offsets = tokenizer.encode_with_offsets(text)
    return list(ids), owners_of_tokens(offsets, runs), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_pieces_equal_the_whole_text(case: str) -> None:
    make, name, tiny = CASES[case]
    tmpl, tok = template(name, tiny), make()
    assert tok.pieces is not None
    rng = random.Random(case)
    for _ in range(12):
        msgs = conversation(rng, rng.randint(0, 5))
        for m in range(1, len(msgs) + 1):  # every prefix, as an agent's rounds send them
            r = render(msgs[:m], tok, tmpl)
            ids, owners, spans = whole(msgs[:m], tok, tmpl)
            assert r.token_ids == ids and r.owners == owners
            np.testing.assert_array_equal(r.spans, spans)
    assert tok.pieces.hits > 0  # later prefixes reused the earlier messages' tokens


def test_a_later_round_encodes_only_what_is_new() -> None:
    tok = gpt_oss()
    msgs = conversation(random.Random(1), 6)
    render(msgs[:-2], tok, GPT_OSS_TEMPLATE)
    misses = tok.pieces.misses
    render(msgs, tok, GPT_OSS_TEMPLATE)
    # the two new messages and the generation prompt (the previous last message's run may change too:
    # the template marks the last assistant turn)
    assert tok.pieces.misses - misses <= 4


def test_an_unsafe_boundary_falls_back_to_the_whole_text() -> None:
    """Messages glued with plain text: a run boundary touches no added token, so no piece is cut."""
    tok = gpt_oss()
    glued = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    msgs = [{"role": "user", "content": "hello wor"}, {"role": "user", "content": "ld again"}]
    text, runs = render_spans([normalize_message(m, i) for i, m in enumerate(msgs)], glued, None, False)
    assert encode_runs(tok.pieces, text, runs) is None
    r = render(msgs, tok, glued, add_generation_prompt=False)
    ids, owners, _ = whole(msgs, tok, glued)
    assert (r.token_ids, r.owners) == (ids, owners)


def test_the_cache_stays_within_its_budget() -> None:
    cache = PieceCache(gpt_oss(), max_tokens=50)
    for i in range(40):
        cache.encode(f"<|start|>user<|message|>number {i} of many<|end|>")
        assert cache.tokens == sum(len(ids) for ids, _ in cache.entries.values()) <= 50
    assert 0 < len(cache.entries) < 40
