"""The offline o200k_harmony tokenizer against tiktoken's own o200k_harmony encoding (same vocabulary file,
placed in tiktoken's cache so tiktoken loads and hash-checks it itself) and against openai-harmony."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest

from minakv.text.tokenizer import (
    O200K_PATTERN,
    O200K_SHA256,
    O200K_VOCAB_SIZE,
    Tokenizer,
    gpt_oss_tokenizer_json,
    o200k_tiktoken_file,
)

TIKTOKEN_URL_SHA1 = "fb374d419588a4632f3f557e76b4b70aebbca790"  # tiktoken's cache name for o200k_base

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done what we'd said; it's HE'S and WE'LL too.",
    "  leading spaces, trailing   \n\n\n   whitespace runs\t\t tabs \r\n crlf   ",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️ and ZWJ sequences",
    "Ελληνικά, Русский текст, עברית, العربية, हिन्दी",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    'for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; } // C++ loop\n{"json": [1, 2, {"k": null}]}',
    "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
    "<|startoftext|>text<|endoftext|> <|endofprompt|> <|reserved_200100|> <|call|><|constrain|>json",
    "combining: e\u0301 a\u0308 Zalgo: Z̷̢a̶l̸g̵o̴ and NBSP\u00a0here, ZWSP\u200bthere",
    "URLs: https://example.com/path/to/file.html?q=1&r=2#frag /usr/local/bin//x",
    "MiXeD CaSe WORDS and camelCaseIdentifiers_with_snake_case and ALLCAPS'S",
    "",
    " ",
    "\n",
    "a" * 300,
    "!!!???...,,,;;;:::---___===+++",
]


@pytest.fixture(scope="module")
def tiktoken_enc(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken import registry

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    (cache / TIKTOKEN_URL_SHA1).write_bytes(o200k_tiktoken_file().read_bytes())
    monkeypatch_module.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    registry.ENCODINGS.pop("o200k_harmony", None)
    registry.ENCODINGS.pop("o200k_base", None)
    return tiktoken.get_encoding("o200k_harmony")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("gpt-oss-tok")
    (d / "tokenizer.json").write_bytes(gpt_oss_tokenizer_json().read_bytes())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|return|>", "bos_token": "<|startoftext|>", "pad_token": "<|endoftext|>"})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    (d / "chat_template.jinja").write_text("{{ messages }}")
    return Tokenizer.from_dir(d)


def corpus() -> list[str]:
    """The handwritten texts plus the project's own docs and sources (lots of prose and code)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.glob("minakv/**/*.py"))[:20] + [root / "pyproject.toml"]
    return TEXTS + [p.read_text() for p in files if p.is_file()]


def test_tiktoken_file_is_verified():
    path = o200k_tiktoken_file()
    assert path.name == "o200k_base.tiktoken"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    assert len(data) == 3_613_922


def test_encodes_like_tiktoken(tok: Tokenizer, tiktoken_enc):
    assert tiktoken_enc._pat_str == O200K_PATTERN
    assert tiktoken_enc.n_vocab == tok.vocab_size == O200K_VOCAB_SIZE
    for text in corpus():
        # The one known difference: tiktoken also matches the second name of id 200018 as a special token.
        text = text.replace("<|reserved_200018|>", "<|endofprompt|>")
        expected = tiktoken_enc.encode(text, allowed_special="all")
        assert tok.encode(text) == expected, text[:80]
        plain = tiktoken_enc.encode(text, disallowed_special=())
        assert tok.encode(text, allow_special=False) == plain, text[:80]
        assert tok.decode(expected) == text


def test_special_tokens_in_id_order(tok: Tokenizer, tiktoken_enc):
    for name, token_id in tiktoken_enc._special_tokens.items():
        if name == "<|reserved_200018|>":
            continue  # tiktoken knows id 200018 under two names; the HF tokenizer uses <|endofprompt|>
        assert tok.token_to_id(name) == token_id, name
    assert tok.id_to_token(200018) == "<|endofprompt|>"
    assert tok.id_to_token(201087) == "<|reserved_201087|>"


def test_wrapper_config(tok: Tokenizer):
    assert tok.eos_token_ids[:3] == [200002, 199999, 200012]
    assert tok.bos_token == "<|startoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == "{{ messages }}"


def test_offsets_cover_the_text(tok: Tokenizer):
    text = "<|start|>user<|message|>héllo 世界 😀 x<|end|>"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert len(offsets) == len(ids)
    assert offsets[0] == (0, len("<|start|>"))
    for (s0, e0), (s1, e1) in itertools.pairwise(offsets):
        assert s0 <= e0 and s1 <= e1 and s0 <= s1 and e0 <= e1  # monotone, possibly sharing a character
    assert offsets[-1][1] == len(text)
    # Concatenating the text spans of the non-overlapping tokens rebuilds the text.
    pieces, end = [], 0
    for s, e in offsets:
        if s >= end:
            pieces.append(text[s:e])
            end = e
    assert "".join(pieces) == text


def test_harmony_renders_offline_with_our_file(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch):
    harmony = pytest.importorskip("openai_harmony")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(o200k_tiktoken_file().parent))
    enc = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    convo = harmony.Conversation.from_messages(
        [
            harmony.Message.from_role_and_content(harmony.Role.USER, "Wie geht's? 你好 🙂"),
        ]
    )
    ids = enc.render_conversation_for_completion(convo, harmony.Role.ASSISTANT)
    text = tok.decode(ids)
    assert text.startswith("<|start|>user<|message|>Wie geht's?") and text.endswith("<|start|>assistant")
    assert tok.encode(text) == ids


def test_wrong_vocabulary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import minakv.text.tokenizer as mt

    tokens = mt.read_o200k_ranks()
    tokens[5], tokens[6] = tokens[6], tokens[5]
    monkeypatch.setenv("MINAKV_CACHE", str(tmp_path))
    monkeypatch.setattr(mt, "read_o200k_ranks", lambda: tokens)
    mt.o200k_tiktoken_file.cache_clear()
    try:
        with pytest.raises(ValueError, match="sha256"):
            mt.o200k_tiktoken_file()
        assert not (tmp_path / "o200k" / "o200k_base.tiktoken").exists()
    finally:
        mt.o200k_tiktoken_file.cache_clear()


def random_text_check(tok: Tokenizer, enc, text: str) -> None:
    assert tok.encode(text, allow_special=False) == enc.encode(text, disallowed_special=())
    assert tok.decode(tok.encode(text)) == text


ALPHABET = "aZé 世界😀\n\t  '’0123456789.,!?-_/\\\"ñß́"


def test_random_text_like_tiktoken(tok: Tokenizer, tiktoken_enc):
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 40)
        random_text_check(tok, tiktoken_enc, "".join(rng.choice(ALPHABET) for _ in range(n)))


@pytest.mark.slow
def test_random_unicode_like_tiktoken(tok: Tokenizer, tiktoken_enc):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=3000, deadline=None)
    @given(st.text(max_size=200))
    def check(text: str) -> None:
        random_text_check(tok, tiktoken_enc, text)

    check()


def test_from_dir_config_forms(tmp_path: Path):
    """tokenizer_config.json variants seen in the wild: special tokens as {"content": ...} dicts, a list of
    named chat templates; a chat_template.jinja file wins over both; a missing tokenizer.json is named."""
    from minakv.presets.tiny_text import minimax_tokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    minimax_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = {
        "eos_token": {"content": "[e~[", "special": True},
        "bos_token": "]~!b[",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "D" and tok.eos_token == "[e~["
    assert tok.eos_token_ids == [tok.token_to_id("[e~[")]
    ids = tok.encode("]~b]ai\n<think>hi</think>[e~[")
    assert tok.decode(ids, skip_special_tokens=True) == "ai\n<think>hi</think>"  # think tags are not control
    assert tok.encode("[e~[", allow_special=False) != [tok.token_to_id("[e~[")]
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"
