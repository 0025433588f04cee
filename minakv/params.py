"""What a caller asks for: `SamplingParams`, shared by the `Engine`, the scheduler and the server.

Validation lives in `SamplingParams.check()` so every entry point rejects bad values with the same message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Grammar:
    """Structured outputs: what the whole output must match, as plain data. Exactly one of
    - `json_schema`: the output is one JSON value valid under this schema (`{"type": "object"}`: any object);
    - `lark`: an llguidance Lark grammar (special tokens as `<|name|>` or `<[id]>`; `%json {...}` inlines
      a schema; minakv/grammar/formats.py builds the chat-format ones: harmony, MiniMax tool calls);
    - `regex`: the output matches this regular expression (Rust `regex` syntax).
    It is compiled for the model's tokenizer when the request is made (minakv/grammar/compiler.py)."""

    json_schema: dict[str, Any] | None = None
    lark: str | None = None
    regex: str | None = None

    def check(self) -> None:
        given = [name for name in ("json_schema", "lark", "regex") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"grammar needs exactly one of json_schema, lark, regex; got {given or 'none'}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"grammar json_schema must be an object, got {type(self.json_schema).__name__}")
        for name in ("lark", "regex"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"grammar {name} must be a non-empty string")

    def key(self) -> tuple[str, str]:
        """(kind, text): the cache key. Key order is kept: it is the order the properties are written in."""
        if self.json_schema is not None:
            return "json_schema", json.dumps(self.json_schema)
        return ("lark", self.lark) if self.lark is not None else ("regex", str(self.regex))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: also the top k
    min_p: float = 0.0  # keep tokens with p >= min_p * (the most likely token's p)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # logits of prompt and output tokens: / r if positive, * r if not
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    grammar: Grammar | None = None  # structured outputs: the output must match it
    # False: token ids only, no text (as vLLM's `detokenize`): what a token-in / token-out caller needs, and
    # ~4.5 us a token less on the engine thread (bench/RESULTS.md); stop strings need the text
    detokenize: bool = True

    def check(self) -> None:
        """Raise ValueError naming the field for any value the engine cannot honour."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not isinstance(rep, (int, float)) or not 0 < rep <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {rep!r}")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or len(bias) > 1024:
            raise ValueError("logit_bias must map at most 1024 token ids to numbers")
        for token, value in bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for {token}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if type(self.detokenize) is not bool:  # (a ValueError like the rest: the server answers 400)
            raise ValueError(f"detokenize must be true or false, got {self.detokenize!r}")
        if stops and not self.detokenize:
            raise ValueError("stop strings need the text: they cannot be used with detokenize=False")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")
            self.grammar.check()

    @property
    def penalized(self) -> bool:
        """Does sampling need the request's token counts (minakv/worker/penalties.py)?"""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
