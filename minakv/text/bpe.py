"""Byte-level BPE tokenizers for the `tokenizers` library, from a rank-ordered token list.

tiktoken's BPE repeatedly merges the adjacent pair whose concatenation has the lowest rank; a Hugging Face
BPE model merges the pair that comes first in its merge list. So listing, for every token in rank order,
each way to split it into two lower-ranked tokens gives an HF tokenizer that produces tiktoken's tokens
(checked against tiktoken in tests/test_tokenizer.py). Bytes are spelled with GPT-2's printable byte
alphabet, as every byte-level `tokenizer.json` does.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def merges_from_ranks(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to rank-ordered merging: for each token (in rank order), every split into two
    tokens of lower rank, the split with the lowest-ranked parts first."""
    rank = {t: r for r, t in enumerate(tokens)}
    merges: list[tuple[bytes, bytes]] = []
    for r, token in enumerate(tokens):
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if rank.get(token[:i], r) < r and rank.get(token[i:], r) < r
        ]
        splits.sort(key=lambda lr: (rank[lr[0]], rank[lr[1]]))
        merges += splits
    return merges


def build_bpe_tokenizer(
    tokens: list[bytes],
    merges: list[tuple[bytes, bytes]],
    pattern: str | None,
    specials: list[str],
    added: list[str] | tuple[str, ...] = (),
) -> HFTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer`: ids of `tokens` by position, then `specials` and `added`
    (matched whole like specials, but kept by decode(skip_special_tokens=True)) in order.
    With `pattern`, text is pre-split by that regex (tiktoken style); else GPT-2's default split."""
    to_unicode = byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {text(t): i for i, t in enumerate(tokens)}
    tok = HFTokenizer(BPE(vocab, [(text(a), text(b)) for a, b in merges], fuse_unk=False, ignore_merges=True))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added])
    for i, s in enumerate(
        [*specials, *added]
    ):  # added tokens take the next free ids; check they landed where meant
        if tok.token_to_id(s) != len(tokens) + i:
            raise ValueError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {len(tokens) + i}")
    return tok
