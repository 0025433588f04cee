"""What a caller gets back: `RequestOutput` (tokens, text, finish reason), its `Usage` and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    repos_tokens: int = 0  # tokens whose keys were re-rotated by a reposition
    drop_skipped_tokens: int = 0  # prompt tokens no query reads any more, so never computed


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # in a stream: the new tokens of this increment; from generate: all of them
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
