"""Incremental detokenization: the text of each new token, in O(1) work per token.

Decoding the whole output again after every token costs O(output length) per token. Decoding the new token
alone is wrong, for two reasons:

- Byte-level vocabularies (o200k, MiniMax-M2) split characters: the 4 UTF-8 bytes of an emoji may come in
  2 to 4 tokens, and a token holding only part of a character decodes to U+FFFD. The character exists only
  once all its bytes are there.
- Some decoders treat a token differently by where it sits: SentencePiece's Metaspace decoder drops the
  leading space of the first token of a decode, so a lone " world" token would come out as "world".

So (as vLLM does) we decode a short window: a few *context* tokens whose text is already out, then the
*pending* tokens whose text is not, and keep only what follows the context's text:

    ids:      ... | context (text already emitted) | pending (new)
    new text = decode(context + pending)[len(decode(context)):]

While that text ends with U+FFFD (a character still missing bytes), the pending tokens stay pending and
only the text before the U+FFFD is emitted. Once it ends with a whole character, the boundary after the
last token is *clean*: nothing later can change the text before it. The pending tokens become the new
context and nothing is pending. Windows stay a few tokens long, so each push costs O(1).

Invalid bytes that never complete (a model emitting garbage) would keep the text ending in U+FFFD and the
window growing. Past MAX_PENDING pending tokens we look for a clean boundary inside them: boundary k is
clean when decode(ids[:k+1]) == decode(ids[:k]) + decode([ids[k]]) (token k does not continue a character
left open before it; the U+FFFD before it is then final). A UTF-8 character has at most 4 bytes, so for
byte-level vocabularies one of any 3 consecutive boundaries is clean.

The emitted text always equals `tokenizer.decode(ids)` without its trailing U+FFFD characters (they are
held back); `flush()` emits those too, so after it `text == tokenizer.decode(ids)` exactly. This holds for
decoders where text already decoded does not change when tokens are added after a clean boundary (true of
byte-level BPE and of Metaspace); decoders with clean-up rules that rewrite earlier text (WordPiece's
" ." -> ".") are not supported.
"""

from __future__ import annotations

import weakref
from typing import Protocol

REPLACEMENT = "\ufffd"  # what a partial UTF-8 character decodes to
CONTEXT = 4  # context tokens kept before the pending ones (one is enough for Metaspace's leading space)
MAX_PENDING = 8  # pending tokens tolerated before looking for a clean boundary inside them


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


# tokenizer -> {token id: decode([id])}: the context is one token in the steady state (every token ends on a
# clean boundary), and a decode is a pure function of the ids, so one tokenizer call a token is saved
_ONE_TOKEN: weakref.WeakKeyDictionary[Decoder, dict[int, str]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back the text each one completes."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._decode = tokenizer.decode
        try:
            self._one = _ONE_TOKEN.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that cannot be weakly referenced: no cache
            self._one = {}
        self._ids: list[int] = []  # context tokens, then pending tokens
        self._context = 0  # how many of _ids are context
        self._context_text = ""  # decode(_ids[: _context])
        self._emitted = 0  # characters of the pending tokens' text already emitted
        self._tail = ""  # the pending tokens' text not emitted yet (ends in U+FFFD)
        self._pieces: list[str] = []  # emitted text, joined on demand
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def held_back(self) -> str:
        """Text of the pending tokens not emitted yet: a character still missing bytes, as U+FFFD."""
        return self._tail

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        self._ids.append(token_id)
        self.num_tokens += 1
        text = self._decode(self._ids)[len(self._context_text) :]  # the pending tokens' text
        if not text.endswith(REPLACEMENT):  # the last character is whole: all of it is final
            clean: tuple[int, int] | None = (len(self._ids), len(text))
            end = len(text)
        else:  # emit up to the U+FFFD; look for a clean boundary only if too many tokens are pending
            end = max(self._emitted, len(text.rstrip(REPLACEMENT)))
            clean = self._clean_boundary() if len(self._ids) - self._context > MAX_PENDING else None
            if clean is not None:
                end = max(end, clean[1])  # the U+FFFD before a clean boundary is final
        new = text[self._emitted : end]
        self._emitted, self._tail = end, text[end:]
        if clean is not None:
            self._advance(*clean)
        if new:
            self._pieces.append(new)
        return new

    def push_many(self, token_ids: list[int]) -> str:
        return "".join([self.push(t) for t in token_ids])

    def flush(self) -> str:
        """Emit the held-back text too, at the end of generation: then `text == decode(all ids)`. Push no more
        tokens after it (a character it emitted as U+FFFD could otherwise still complete)."""
        new, self._tail = self._tail, ""
        self._emitted += len(new)
        if new:
            self._pieces.append(new)
        return new

    def _advance(self, k: int, k_len: int) -> None:
        """The boundary before _ids[k] is clean and the pending text up to it (k_len characters) emitted:
        the last tokens before it become the context, the tokens after it stay pending."""
        start = max(self._context, k - CONTEXT)
        self._ids = self._ids[start:]
        self._context = k - start
        if self._context == 1:
            t = self._ids[0]
            if t not in self._one:
                self._one[t] = self._decode([t])
            self._context_text = self._one[t]
        else:
            self._context_text = self._decode(self._ids[: self._context])
        self._emitted -= k_len

    def _clean_boundary(self) -> tuple[int, int] | None:
        """The last clean boundary k among the pending tokens (see the module docstring), with the length
        of the pending text before it; None if there is none."""
        ids, skip = self._ids, len(self._context_text)
        for k in range(len(ids) - 1, self._context, -1):
            before = self._decode(ids[:k])
            if self._decode(ids[: k + 1]) == before + self._decode(ids[k : k + 1]):
                return k, len(before) - skip
        return None
