"""Compiling a `Grammar` for one tokenizer, with llguidance, and caching the result.

llguidance (bench/RESULTS.md, "Grammar libraries", has the measurements that chose it over xgrammar)
needs two things per model:

- an `LLTokenizer`: the vocabulary as byte strings plus a token trie, built from the `tokenizers` JSON. This
  takes seconds for o200k's 201,088 tokens, so it is built once per (tokenizer, vocabulary size, EOS ids)
  and kept;
- per grammar, an `LLMatcher` in its start state. Compiling is cheap (about a millisecond for a JSON
  schema: llguidance builds the lexer lazily and computes masks on demand), but agents send the same
  tool schemas with every round, so compiled matchers are cached by (tokenizer, grammar) and every request
  gets a `deep_copy` of the start state.

This runs in the caller's thread when a request is made (`minakv/prompt.py`), never on the engine's step.
A grammar llguidance refuses raises ValueError with its message.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance as llg

from minakv.grammar.matcher import GrammarMatcher
from minakv.params import Grammar

CACHE_SIZE = 256  # compiled grammars kept per tokenizer (least recently used ones go first)
# Compact JSON: free whitespace between tokens lets a model wander (a random-weight one, or a real one
# looping on newlines) and only costs tokens. So `{"a":1}`, never `{ "a" : 1 }`.
JSON_OPTIONS = {"whitespace_flexible": False}

_lock = threading.Lock()
_compilers: weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCompiler]] = weakref.WeakKeyDictionary()


class GrammarCompiler:
    """Grammars -> matchers for one tokenizer, with an LRU cache of compiled start states."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        # the model's vocabulary size, not the tokenizer's: masks must be as wide as the logits
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
        self.cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()

    def compile(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for `grammar`, at the start of the output."""
        key = grammar.key()
        with self.lock:
            start = self.cache.get(key)
            if start is not None:
                self.cache.move_to_end(key)
        if start is None:
            start = llg.LLMatcher(self.tokenizer, llguidance_text(grammar), log_level=0)
            if start.is_error():  # (a message can list the whole vocabulary's special tokens: cut it)
                raise ValueError(f"grammar: {start.get_error()[:500]}")
            with self.lock:
                self.cache[key] = start
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
        return GrammarMatcher(start.deep_copy(), self.vocab_size)


def llguidance_text(grammar: Grammar) -> str:
    """The grammar in llguidance's own (JSON) form."""
    if grammar.json_schema is not None:
        try:
            return llg.LLMatcher.grammar_from_json_schema(grammar.json_schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"grammar json_schema: {e}") from None
    if grammar.lark is not None:
        return llg.LLMatcher.grammar_from_lark(grammar.lark)
    return llg.LLMatcher.grammar_from_regex(str(grammar.regex))


def compiler_for(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> GrammarCompiler:
    """The compiler of this tokenizer (made on first use, kept while the tokenizer lives)."""
    if tokenizer is None or not hasattr(tokenizer, "tok"):
        raise ValueError("structured outputs (a grammar) need the model's tokenizer")
    key = (vocab_size, tuple(eos_token_ids))
    with _lock:  # one build per tokenizer even when the first constrained requests arrive together
        per_tokenizer = _compilers.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return per_tokenizer[key]


def compile_grammar(
    grammar: Grammar, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> GrammarMatcher:
    """A fresh matcher of `grammar` for this tokenizer; compiled once per (tokenizer, grammar)."""
    return compiler_for(tokenizer, vocab_size, eos_token_ids).compile(grammar)
