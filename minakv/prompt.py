"""From what a caller sends to a `Request`: tokens, their owners, and the compiled cache program.

Prompt forms:
- `str`: tokenized as is (one owner).
- `list[int]`: token ids (one owner).
- `{"message_tokens": [[ids], ...], "cache": {...}}`: pre-tokenized messages, one owner each, no template.
- `{"messages": [...], "tools": [...], "cache": {...}, "chat_template_kwargs": {...}}`: rendered once with
  the model's chat template; every token owned by its message, the generation prompt by owner N.

`cache` is `{"drop": {"<trigger>": [ids]}, "reposition": [ids]}` (docs/design.md 2.2). Everything invalid raises
ValueError (CacheOpError for operations) with a message naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minakv.cache.program import compile_program
from minakv.grammar import compile_grammar
from minakv.model.config import ModelConfig
from minakv.params import SamplingParams
from minakv.scheduler.request import Request
from minakv.text.chat import render


def _token_list(value: Any, field: str, vocab_size: int) -> list[int]:
    """`value` if it is a list of token ids in the vocabulary (checked with C-level passes, not a Python
    loop per token: agent histories are long). The range is checked on an int64 copy: numpy's min and max
    cost next to nothing, where builtin min and max compare Python ints one by one."""
    if not isinstance(value, list) or set(map(type, value)) - {int}:  # bool is not int here
        raise ValueError(f"{field} must be a list of integer token ids")
    if value and not _in_range(value, vocab_size):
        bad = next(t for t in value if not 0 <= t < vocab_size)
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return value


def _in_range(value: list[int], vocab_size: int) -> bool:
    try:
        ids = np.fromiter(value, dtype=np.int64, count=len(value))
    except OverflowError:  # beyond int64: certainly outside the vocabulary
        return False
    return bool(ids.min() >= 0 and ids.max() < vocab_size)


def tokens_and_owners(
    prompt: Any, tokenizer, vocab_size: int
) -> tuple[list[int], list[int] | np.ndarray, int, dict]:
    """(token ids, owners, number of messages N, cache operations) for any prompt form (owners of
    pre-tokenized messages as an int64 array: one `np.repeat`, not a list built token by token)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids instead of text")
        ids = tokenizer.encode(prompt)
        return ids, [0] * len(ids), 1, {}
    if isinstance(prompt, list):
        ids = _token_list(prompt, "prompt", vocab_size)
        return ids, [0] * len(ids), 1, {}
    if not isinstance(prompt, dict):
        # ValueError, not TypeError: every bad-input error the engine raises is a ValueError (HTTP 400)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")  # noqa: TRY004
    cache = prompt.get("cache") or {}
    if not isinstance(cache, dict) or set(cache) - {"drop", "reposition"}:
        raise ValueError(f"cache must be an object with optional 'drop' and 'reposition', got {cache!r}")
    if "message_tokens" in prompt:
        messages = prompt["message_tokens"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("message_tokens must be a non-empty list of token-id lists")
        ids = []
        for i, tokens in enumerate(messages):
            ids += _token_list(tokens, f"message_tokens[{i}]", vocab_size)
        owners = np.repeat(np.arange(len(messages), dtype=np.int64), [len(tokens) for tokens in messages])
        return ids, owners, len(messages), cache
    if "messages" in prompt:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render messages")
        kwargs = prompt.get("chat_template_kwargs") or {}
        rendered = render(prompt["messages"], tokenizer, tools=prompt.get("tools"), **kwargs)
        return rendered.token_ids, rendered.owners, rendered.num_messages, cache
    raise ValueError("a dict prompt needs 'message_tokens' or 'messages'")


def stop_token_ids(tokenizer, config: ModelConfig) -> list[int]:
    """The tokens that end a request: the tokenizer's end-of-sequence tokens, then the model config's."""
    eos = list(tokenizer.eos_token_ids) if tokenizer is not None else []
    return eos + [t for t in config.eos_token_ids if t not in eos]


def make_request(
    prompt: Any, params: SamplingParams, tokenizer, config: ModelConfig, max_model_len: int
) -> Request:
    ids, owners, num_messages, cache = tokens_and_owners(prompt, tokenizer, config.vocab_size)
    if not ids:
        raise ValueError("the prompt is empty")
    if bad := [t for t in params.logit_bias or {} if t >= config.vocab_size]:
        raise ValueError(
            f"logit_bias names token ids {bad[:5]} outside the vocabulary of {config.vocab_size}"
        )
    # The limit is on positions, not on the raw history: drops and repositions keep an agent's positions
    # compact, so its history may grow past max_model_len (docs/design.md 2.2).
    limit = min(config.max_position_embeddings, max_model_len)
    program = compile_program(owners, num_messages, cache.get("drop"), cache.get("reposition"), limit)
    if program.next_pos >= limit:
        raise ValueError(
            f"the first generated token would sit at position {program.next_pos}, past the limit of {limit} "
            f"(max_model_len {max_model_len}; the prompt has {len(ids)} tokens)"
        )
    eos = stop_token_ids(tokenizer, config)
    # structured outputs: compiled here, in the caller's thread (cached per tokenizer and grammar), so the
    # engine's step only advances the matcher and asks it for masks
    grammar = compile_grammar(params.grammar, tokenizer, config.vocab_size, eos) if params.grammar else None
    return Request(ids, params, program, eos_token_ids=eos, grammar=grammar)
