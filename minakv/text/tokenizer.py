"""Tokenizers: the real GPT-OSS (o200k_harmony) vocabulary offline, and a small wrapper the engine uses.

GPT-OSS uses OpenAI's o200k vocabulary. tiktoken and openai-harmony download it on first use, which fails
offline. The PyPI package `quicktok-v1` ships the same 199998 byte-level BPE ranks in a small binary file;
written out in tiktoken's text form (`base64(token) rank` per line, rank order) it is byte-identical to
`o200k_base.tiktoken`, which we check by sha256. From the ranks we also build a Hugging Face `tokenizers`
JSON (merges recovered from the ranks: minakv/text/bpe.py). Generated files live in the cache dir
($MINAKV_CACHE, else ~/.cache/minakv).

`Tokenizer` wraps a `tokenizers.Tokenizer` plus what `tokenizer_config.json` / `generation_config.json`
say (chat template, eos/bos/pad), with the few calls the engine needs.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import struct
import tempfile
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from minakv.text.bpe import (
    build_bpe_tokenizer,
    byte_to_unicode,  # noqa: F401 (re-exported for minakv.server.output)
    merges_from_ranks,
)
from minakv.text.pieces import PieceCache

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_NUM_RANKS = 199998
O200K_VOCAB_SIZE = 201088  # ranks + <|startoftext|> 199998 ... <|reserved_201087|>
# o200k_base's pre-tokenizer regex (tiktoken's `pat_str`, also used by o200k_harmony).
O200K_PATTERN = "|".join(  # noqa: FLY002 (one alternative per line reads better)
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
TOKENIZER_JSON_VERSION = 1  # bump when the generated tokenizer.json changes


def cache_dir() -> Path:
    """Where minakv keeps generated files (tokenizers, tiny checkpoints)."""
    root = os.environ.get("MINAKV_CACHE") or Path.home() / ".cache" / "minakv"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, then rename: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------
# o200k from quicktok-v1


def quicktok_data_file(name: str) -> Path:
    """Locate `quicktok/data/<name>` of the installed quicktok-v1 package without importing it."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("quicktok-v1")
        candidates.append(Path(str(dist.locate_file(f"quicktok/data/{name}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("quicktok")  # finds the package folder; does not execute it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" / name for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"quicktok/data/{name} not found: the o200k vocabulary comes from the PyPI package quicktok-v1 "
        "(pip install quicktok-v1==0.4.0)"
    )


def read_o200k_ranks() -> list[bytes]:
    """The 199998 BPE tokens of o200k_base as bytes, index = rank."""
    data = quicktok_data_file("o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    tokens: list[bytes | None] = [None] * count
    at = 4
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, at)
        token = data[at + 2 : at + 2 + length]
        (rank,) = struct.unpack_from("<I", data, at + 2 + length)
        at += 2 + length + 4
        if rank >= count or tokens[rank] is not None:
            raise ValueError(f"o200k.vocab: bad or duplicate rank {rank}")
        tokens[rank] = token
    if count != O200K_NUM_RANKS or at != len(data):
        raise ValueError(f"o200k.vocab: expected {O200K_NUM_RANKS} entries filling the file, got {count}")
    return tokens  # type: ignore[return-value]


def read_o200k_harmony_specials() -> dict[int, str]:
    """Special token id -> name for o200k_harmony (199998..201087). Id 200018 is listed twice in the
    file (`<|endofprompt|>` and `<|reserved_200018|>`); we keep the non-reserved name, as tiktoken does."""
    data = quicktok_data_file("o200k_harmony.special").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    specials: dict[int, str] = {}
    at = 4
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, at)
        name = data[at + 6 : at + 6 + length].decode("utf-8")
        at += 6 + length
        if token_id not in specials or specials[token_id].startswith("<|reserved_"):
            specials[token_id] = name
    expected = set(range(O200K_NUM_RANKS, O200K_VOCAB_SIZE))
    if set(specials) != expected:
        raise ValueError("o200k_harmony.special: ids do not cover 199998..201087")
    return dict(sorted(specials.items()))


def tiktoken_text(tokens: list[bytes]) -> bytes:
    return b"".join(base64.b64encode(t) + b" " + str(rank).encode() + b"\n" for rank, t in enumerate(tokens))


@functools.cache
def o200k_tiktoken_file() -> Path:
    """`o200k_base.tiktoken`, regenerated from quicktok-v1 and sha256-checked. Its folder can be used as
    `TIKTOKEN_ENCODINGS_BASE` for openai-harmony."""
    path = cache_dir() / "o200k" / "o200k_base.tiktoken"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
        return path
    text = tiktoken_text(read_o200k_ranks())
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_SHA256:
        raise ValueError(
            f"the o200k vocabulary from quicktok-v1 ({quicktok_data_file('o200k.vocab')}) does not reproduce "
            f"o200k_base.tiktoken: sha256 {digest}, expected {O200K_SHA256}. Install quicktok-v1==0.4.0."
        )
    write_atomic(path, text)
    return path


# ---------------------------------------------------------------------------------------------------------
# tokenizers JSON


@functools.cache
def gpt_oss_tokenizer_json() -> Path:
    """A `tokenizer.json` for GPT-OSS (o200k_harmony, 201088 tokens), built offline and cached."""
    path = cache_dir() / "o200k" / f"o200k_harmony.v{TOKENIZER_JSON_VERSION}.tokenizer.json"
    if path.is_file():
        return path
    o200k_tiktoken_file()  # verifies the vocabulary before we build anything from it
    tokens = read_o200k_ranks()
    specials = read_o200k_harmony_specials()
    tok = build_bpe_tokenizer(tokens, merges_from_ranks(tokens), O200K_PATTERN, list(specials.values()))
    write_atomic(path, tok.to_str().encode())
    return path


# ---------------------------------------------------------------------------------------------------------
# The engine's tokenizer


def _token_name(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: object) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]  # type: ignore[union-attr]


class Tokenizer:
    """Text <-> token ids for one model directory, plus its chat template and stop tokens."""

    def __init__(
        self,
        tok: HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        ids = list(eos_token_ids or [])
        if eos_token is not None and self.token_to_id(eos_token) is not None:
            ids.append(self.token_to_id(eos_token))
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))  # de-duplicated, order kept
        self._plain: HFTokenizer | None = None  # built on first use of allow_special=False

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{model_dir}: no tokenizer.json (minakv reads Hugging Face fast tokenizers)"
            )
        tok = HFTokenizer.from_file(str(tok_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text()
        eos_ids = _as_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        eos_ids += _as_list(_read_json(model_dir / "config.json").get("eos_token_id"))
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_name(config.get("bos_token")),
            eos_token=_token_name(config.get("eos_token")),
            pad_token=_token_name(config.get("pad_token")),
            eos_token_ids=eos_ids,
        )

    @functools.cached_property
    def pieces(self) -> PieceCache | None:
        """The cache of rendered messages' tokens (minakv/text/pieces.py), or None when the vocabulary has no
        added tokens to cut a conversation at."""
        cache = PieceCache(self)
        return cache if cache.markers else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def _encoder(self, allow_special: bool) -> HFTokenizer:
        if allow_special:
            return self.tok
        if self._plain is None:
            # `tokenizers` decides per Tokenizer object whether special-token text is matched as a special
            # token or encoded as ordinary text, so plain encoding needs a second, configured copy.
            self._plain = HFTokenizer.from_str(self.tok.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With allow_special, special-token text (e.g. `<|start|>`) becomes the special
        token; without, it is encoded as ordinary text."""
        return self._encoder(allow_special).encode(text, add_special_tokens=False).ids

    def encode_with_offsets(
        self, text: str, allow_special: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, per token, the (start, end) character span of `text` it came from. A token that
        holds only part of a character's UTF-8 bytes reports that whole character."""
        enc = self._encoder(allow_special).encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(
            ids if type(ids) is list else list(ids), skip_special_tokens=skip_special_tokens
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
