"""Structured outputs: grammars compiled for the model's tokenizer (llguidance), per-request matchers, the
step's token masks, and the chat-format grammars of each model family."""

from minakv.grammar.compiler import compile_grammar
from minakv.grammar.formats import chat_output
from minakv.grammar.matcher import GrammarMatcher, fill_masks

__all__ = ["GrammarMatcher", "chat_output", "compile_grammar", "fill_masks"]
