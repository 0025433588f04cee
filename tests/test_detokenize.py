"""Incremental detokenization (minakv/text/detokenize.py) and the stop checks built on it
(minakv/scheduler/stops.py), on the real o200k_harmony tokenizer and the tiny MiniMax-M2 one.

The reference is always the full decode: after every token, emitted text + held-back text must equal
`tokenizer.decode(ids so far)`, the held-back part being only the trailing U+FFFD of a partial character.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from minakv.params import SamplingParams
from minakv.prompt import make_request
from minakv.scheduler.stops import apply_token
from minakv.text.bpe import byte_to_unicode
from minakv.text.detokenize import CONTEXT, MAX_PENDING, IncrementalDetokenizer
from minakv.text.tokenizer import Tokenizer

FFFD = "\ufffd"
PRESETS = ["tiny-gpt-oss", "tiny-minimax-m2"]
PIECES = [
    "Hello", " world", ",", " the", " quick", "  ", "\n", "\n\n", "\t", " 42", "3.14", "don't", " ",
    "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "日本語", "中文", "한국어", " é", "e\u0301", "Ελλάδα", "Русский",
    "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "]~b]", "[e~[", "<think>", "</think>", "\ufffd",
]  # fmt: skip


@pytest.fixture(scope="module", params=PRESETS)
def tok(request, tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir(request.param))


def byte_tokens(tok: Tokenizer) -> dict[int, int]:
    """byte -> id of the token that is exactly that byte (both vocabularies have all 256)."""
    table = {b: tok.token_to_id(c) for b, c in byte_to_unicode().items()}
    assert None not in table.values()
    return table  # type: ignore[return-value]


def token_bytes(tok: Tokenizer, token_id: int) -> bytes | None:
    """The bytes of an ordinary (byte-level) token; None for added/special tokens."""
    inverse = {c: b for b, c in byte_to_unicode().items()}
    name = tok.id_to_token(token_id)
    if (
        name is None
        or any(c not in inverse for c in name)
        or tok.tok.decode([token_id]) != _lossy(name, inverse)
    ):
        return None
    return bytes(inverse[c] for c in name)


def _lossy(name: str, inverse: dict[str, int]) -> str:
    return bytes(inverse[c] for c in name).decode("utf-8", errors="replace")


def random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Text-like token sequences: random pieces encoded, some tokens split into their single bytes (so
    multi-byte characters arrive over several tokens), and a few random vocabulary ids."""
    bytes_ = byte_tokens(tok)
    text = "".join(rng.choice(PIECES) for _ in range(n))
    ids: list[int] = []
    for t in tok.encode(text):
        raw = token_bytes(tok, t)
        if raw is not None and len(raw) > 1 and rng.random() < 0.3:
            ids += [bytes_[b] for b in raw]
        else:
            ids.append(t)
        if rng.random() < 0.05:
            ids.append(rng.randrange(tok.vocab_size))
    return ids


def check_stream(tok: Tokenizer, ids: list[int]) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok)
    out = ""
    for i, t in enumerate(ids):
        out += detok.push(t)
        full = tok.decode(ids[: i + 1])
        assert out == detok.text
        assert out + detok.held_back == full, (i, ids[: i + 1])
        assert detok.held_back == FFFD * len(detok.held_back)
        if not full.endswith(FFFD):
            assert detok.held_back == "" and out == full
    out += detok.flush()
    assert out == detok.text == tok.decode(ids)
    return detok


def test_matches_full_decode_at_every_step(tok):
    rng = random.Random(0)
    for _ in range(40):
        check_stream(tok, random_ids(tok, rng, rng.randrange(1, 30)))


def test_multibyte_characters_split_across_tokens(tok):
    bytes_ = byte_tokens(tok)
    for text in ["a😀b", "日本語", "é", "👨‍👩‍👧 x", "😀😀", " 한", "€\n"]:
        raw = text.encode()
        ids = [bytes_[b] for b in raw]
        detok = check_stream(tok, ids)
        assert detok.text == text
        # one byte at a time: nothing of a character appears before its last byte
        detok, seen = IncrementalDetokenizer(tok), ""
        for k, t in enumerate(ids):
            seen += detok.push(t)
            assert seen == raw[: k + 1].decode("utf-8", errors="ignore")


def test_special_tokens_and_leading_spaces(tok):
    text = "<|start|>assistant<|channel|>final<|message|> Hi  there 😀 ]~b]ai\n<think> ok</think>"
    ids = tok.encode(text)
    assert check_stream(tok, ids).text == tok.decode(ids)


def test_invalid_bytes_keep_the_window_bounded(tok):
    """Garbage that never forms characters (lone continuation bytes, truncated sequences) keeps the text
    ending in U+FFFD; the window must still stay short, and the text exact."""
    bytes_ = byte_tokens(tok)
    rng = random.Random(1)
    streams = [
        [bytes_[rng.randrange(0x80, 0xC0)] for _ in range(300)],  # continuation bytes only
        [bytes_[rng.choice([0xE2, 0x82, 0xF0, 0x9F, 0xFF, 0xC3])] for _ in range(300)],
        [bytes_[rng.randrange(0x80, 0x100)] if rng.random() < 0.9 else bytes_[0x61] for _ in range(300)],
    ]
    for ids in streams:
        detok = IncrementalDetokenizer(tok)
        for k, t in enumerate(ids):
            detok.push(t)
            assert len(detok._ids) <= CONTEXT + MAX_PENDING + 1
            assert detok.text + detok.held_back == tok.decode(ids[: k + 1])


class CountingTokenizer:
    """Wraps a tokenizer and records the ids and characters each decode call handles."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.chars, self.calls = tok, 0, 0, 0

    def decode(self, ids: list[int]) -> str:
        text = self.tok.decode(ids)
        self.calls, self.ids, self.chars = self.calls + 1, self.ids + len(ids), self.chars + len(text)
        return text


def test_work_per_token_is_bounded(tok):
    rng = random.Random(2)
    ids: list[int] = []
    while len(ids) < 2000:
        ids += random_ids(tok, rng, 50)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    per_push = []
    for t in ids[:2000]:
        before = (counting.calls, counting.ids, counting.chars)
        detok.push(t)
        per_push.append((counting.calls - before[0], counting.ids - before[1], counting.chars - before[2]))
    assert detok.text + detok.held_back == tok.decode(ids[:2000])
    calls, n_ids, chars = (max(p[i] for p in per_push) for i in range(3))
    # Bounded by constants (a window is at most CONTEXT + MAX_PENDING + 1 tokens, a token a few dozen
    # characters), whatever the output length; and the late pushes are no costlier than the early ones.
    assert calls <= 2 + 3 * MAX_PENDING and n_ids <= 64 * (CONTEXT + MAX_PENDING + 1) and chars <= 4000
    early = sum(p[2] for p in per_push[:500]) / 500
    late = sum(p[2] for p in per_push[-500:]) / 500
    assert late < 3 * early + 20, (early, late)
    assert sum(p[0] for p in per_push) <= 2.5 * len(per_push)  # about two short decodes per token


# ---------------------------------------------------------------------------------------------------------
# apply_token: stops on top of the incremental text


def request_for(tok: Tokenizer, prompt_ids: list[int], params: SamplingParams, max_pos: int = 4096):
    config = SimpleNamespace(vocab_size=tok.vocab_size, max_position_embeddings=max_pos, eos_token_ids=[])
    return make_request(prompt_ids, params, tok, config, max_model_len=4096)


def run(tok: Tokenizer, r, outputs: list[int], max_model_len: int = 4096) -> tuple[int, str]:
    """Apply tokens until the request finishes; (tokens applied, streamed text)."""
    streamed = ""
    for k, t in enumerate(outputs):
        done = apply_token(r, t, None, tok, max_model_len)
        streamed += r.output(incremental=True).text
        if done:
            return k + 1, streamed
    return len(outputs), streamed


def test_stop_string_across_a_token_boundary(tok):
    ids = tok.encode("Hello world, this is a test of stopping")
    stop = "lo wor"
    # the stop string ends in the token that completes it
    need = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert stop not in tok.decode(ids[: need - 1]) and tok.decode(ids[need - 1 : need]) not in ("", stop)
    r = request_for(tok, tok.encode("Say hi"), SamplingParams(max_tokens=100, stop=[stop]))
    n, streamed = run(tok, r, ids)
    assert (n, r.finish_reason, str(r.text)) == (need, "stop", "Hel")
    assert r.output(incremental=False).text == "Hel" and streamed == "Hel"
    assert r.output_ids.tolist() == ids[:need]


def test_stop_string_inside_a_split_character(tok):
    bytes_ = byte_tokens(tok)
    ids = [bytes_[b] for b in "ab😀cd".encode()]
    r = request_for(tok, tok.encode("x"), SamplingParams(max_tokens=100, stop=["b😀"]))
    n, streamed = run(tok, r, ids)
    assert (n, r.finish_reason, str(r.text), streamed) == (
        6,
        "stop",
        "a",
        "a",
    )  # a, b, then the 4 emoji bytes


def test_stop_string_only_in_the_prompt_is_not_matched(tok):
    prompt = tok.encode("Please STOP now. Answer:")
    outputs = tok.encode(" fine, continuing without the word")
    r = request_for(tok, prompt, SamplingParams(max_tokens=100, stop=["STOP", "Answer"]))
    n, streamed = run(tok, r, outputs)
    assert n == len(outputs) and r.finish_reason is None
    assert str(r.text) == tok.decode(outputs)
    assert streamed == tok.decode(outputs)[: len(streamed)]  # held back: could start "STOP"/"Answer"


def test_streamed_text_equals_final_text(tok):
    rng = random.Random(3)
    for _ in range(10):
        outputs = [t for t in random_ids(tok, rng, 20) if t not in tok.eos_token_ids]
        r = request_for(tok, tok.encode("hi"), SamplingParams(max_tokens=len(outputs), stop=["zzz"]))
        n, streamed = run(tok, r, outputs)
        assert n == len(outputs) and r.finish_reason == "length"
        assert str(r.text) == tok.decode(outputs)  # a trailing partial character included, as U+FFFD
        assert streamed == str(r.text)


@pytest.mark.parametrize("every", [1, 37, 10_000])
def test_long_outputs_stream_and_stop_past_the_settled_text(tok, every):
    """Outputs long enough that the text settles into chunks many times (minakv/text/output_text.py): a
    stream reading every token, one reading every 37th (its slices reach into the chunks), one reading only
    at the end; a stop string that first matches after ~3,000 characters is still found and cut, and the
    streamed text equals the final text equals the decode."""
    rng = random.Random(every)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "😀", "日本", "x"]) for _ in range(600))
    outputs = tok.encode(words + " STOPWORD and more")
    r = request_for(tok, tok.encode("hi"), SamplingParams(max_tokens=4000, stop=["STOPWORD", "never-seen"]))
    streamed = ""
    for k, t in enumerate(outputs):
        done = apply_token(r, t, None, tok, 8192)
        if done or k % every == 0:
            streamed += r.output(incremental=True).text
        if done:
            break
    assert r.finish_reason == "stop" and len(r.text.chunks) > 5
    assert str(r.text) == streamed == words + " " == r.output(incremental=False).text


def test_length_with_a_partial_character_keeps_its_replacement(tok):
    bytes_ = byte_tokens(tok)
    outputs = [bytes_[b] for b in "ok😀".encode()][:4]  # o, k, and 2 of the emoji's 4 bytes
    r = request_for(tok, tok.encode("hi"), SamplingParams(max_tokens=4))
    run(tok, r, outputs)
    assert r.finish_reason == "length" and str(r.text) == tok.decode(outputs) and str(r.text).endswith(FFFD)


def test_stop_token_and_eos(tok):
    outputs = tok.encode("one two three four")
    r = request_for(tok, tok.encode("hi"), SamplingParams(max_tokens=100, stop_token_ids=[outputs[2]]))
    n, _ = run(tok, r, outputs)
    assert (n, r.finish_reason, str(r.text)) == (
        3,
        "stop",
        tok.decode(outputs[:2]),
    )  # the stop token's text left out
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else outputs[1]
    for ignore in (False, True):
        r = request_for(tok, tok.encode("hi"), SamplingParams(max_tokens=3, ignore_eos=ignore))
        r.eos_token_ids = [eos]
        n, _ = run(tok, r, [outputs[0], eos, outputs[2], outputs[3]])
        assert (n, r.finish_reason) == ((3, "length") if ignore else (2, "stop"))


def test_length_limits_match_birth_positions(tok):
    """The O(1) position arithmetic agrees with Program.birth_positions, also when cache operations move
    the first generated token's position away from the prompt length."""
    segs = [tok.encode("first message"), tok.encode(" second one"), tok.encode(" third")]
    flat = [t for seg in segs for t in seg]
    prompts = [
        flat,
        {"message_tokens": segs, "cache": {"drop": {"2": [0]}}},
        {"message_tokens": segs, "cache": {"drop": {"2": [0]}, "reposition": [2]}},
    ]
    outputs = tok.encode(" and then the model keeps on talking for quite a while longer" * 4)
    for prompt in prompts:
        base = request_for(tok, prompt, SamplingParams(max_tokens=100))
        limit = max(base.program.next_pos, int(base.program.birth_pos.max()) + 1) + 5
        r = request_for(tok, prompt, SamplingParams(max_tokens=100), max_pos=limit)
        n, _ = run(tok, r, outputs)
        assert r.finish_reason == "length"
        assert int(r.program.birth_positions([r.num_prompt + n - 1])[0]) == limit
        assert int(r.program.birth_positions([r.num_prompt + n - 2])[0]) < limit
    # max_model_len counts prompt + output
    r = request_for(tok, flat, SamplingParams(max_tokens=100))
    n, _ = run(tok, r, outputs, max_model_len=r.num_prompt + 4)
    assert (n, r.finish_reason) == (4, "length")
