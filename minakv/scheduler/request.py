"""A request inside the engine: its tokens, its compiled program, and its plan of KV entries.

Every slot a request fills is one *entry*, in a fixed order that depends only on the request's tokens and
operations (never on batching or chunking):

    BORN(t)            token t computed at its birth position
    COPY(t, old->new)  token t's key re-rotated into a fresh slot by a reposition

Entries are laid into pages in that order, so a page's content is a function of the entries before it. Each
entry has a record (events so far, token, position, kind); a page's key hashes its records chained to the
previous page's key. Two requests share a page exactly when their histories agree up to its end.

Tokens no later query reads are never computed (they get no entry): a message dropped right after it ends,
for example, costs nothing. The walk itself (positions, drops, repositions) comes from the compiled program.
"""

from __future__ import annotations

import itertools
import secrets
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from minakv.cache.keys import PageKey
from minakv.cache.plan import Plan
from minakv.cache.program import Program
from minakv.grammar import GrammarMatcher
from minakv.outputs import RequestOutput, TokenLogprob, Usage
from minakv.params import SamplingParams
from minakv.text.output_text import OutputText

_ids = itertools.count()


@dataclass
class Unavailable(RequestOutput):
    """The last output of a request that a worker process's death ended (finish reason "error"): the engine
    is restarting its workers or shutting down, `error` says which. The server answers 503."""

    error: str = ""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two requests with the same prompt and settings are still two (and the
class Request:  # field-wise == would compare numpy arrays, which raises: `running.remove(r)` did)
    prompt_ids: list[int]
    params: SamplingParams
    program: Program
    eos_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # structured outputs: advanced with every output token
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    # int arrays, not lists, for what grows a token at a time: a full garbage collection visits every item
    # of a list (millions at hundreds of long requests: ~0.1 s with the engine stopped), none of an array
    output_ids: array = field(default_factory=lambda: array("q"))
    # the sampler's seed: the caller's, or a random one, so seeded and unseeded rows sample alike
    seed: int = field(default_factory=lambda: secrets.randbits(63))
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # planning and progress (set when the request is admitted; reset when it is preempted)
    plan: Plan | None = None  # the planned entries (arrays); decode entries follow them
    decode_tokens: array = field(default_factory=lambda: array("q"))  # per decode entry: its token index
    decode_positions: array = field(default_factory=lambda: array("q"))  # per decode entry: its position
    page_keys: list[PageKey] = field(default_factory=list)  # key of each full page of planned entries
    pages: list[int] = field(default_factory=list)  # physical pages holding the entries, in order (-1: none)
    todo: Any = None  # numpy int64: planned entries to compute (not cached), in order
    cursor: int = 0  # todo[:cursor] are computed
    incomplete: set[int] = field(default_factory=set)  # pages with entries nobody reads, left uncomputed
    missing: list[int] = field(default_factory=list)  # indices of r.pages still to allocate (-1 there)
    fresh: list[int] = field(default_factory=list)  # indices of r.pages r allocated (the rest: cached)
    row: int = -1  # the request's row of the worker's key table (its decode keys on the device), or -1
    row_len: int = 0  # keys in that row: the plan's final keys, then one per decode entry
    suspect: bool = False  # it was in a step that raised: it runs alone until one step of it succeeds
    shared: bool = False  # its computed prompt pages are in the cache already (published at its first token)
    penalty_row: int = -1  # the request's row of the worker's penalty tables (penalised requests), or -1
    next_pos: int = 0  # position of the next generated token
    pending: int = 0  # sampled tokens still on the device (steps launched but not yet applied)
    sample_row: int = -1  # the sample row of r's latest pending token in its batch
    error: str | None = None
    lost: bool = False  # ended because a worker process died (its output is then `Unavailable`)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    text: OutputText = field(default_factory=OutputText)  # str(r.text): the output's text so far
    sent_tokens: int = 0  # how many output tokens a stream has already delivered
    sent_text: int = 0
    detok: Any = None  # incremental detokenizer state (minakv/text/detokenize.py), made on first use

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed
        # the ids that end generation, as sets: checked for every sampled token (a stop list may be long)
        self.eos_set = frozenset(self.eos_token_ids)
        self.stop_set = frozenset(self.params.stop_token_ids or ())
        # stop strings, and how much text a running stream holds back (it could still start one): every token
        self.stop_strings = tuple(self.params.stop_strings)
        self.hold_back = max((len(s) - 1 for s in self.stop_strings), default=0)

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output as one new list: O(length), for planning only (never per token)."""
        return self.prompt_ids + self.output_ids.tolist()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_entries(self) -> int:
        return self.plan.size + len(self.decode_tokens)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    def output(self, incremental: bool) -> RequestOutput:
        """All output so far, or (for streams) what is new since the last call. While running, text that
        could still turn out to start a stop string is held back."""
        text_end = len(self.text)
        if not self.finish_reason:
            text_end -= self.hold_back
            while (
                text_end > 0 and self.text.char(text_end - 1) == "\ufffd"
            ):  # a character still being decoded
                text_end -= 1
        text_end = max(self.sent_text, text_end)
        if incremental:
            ids, text = (
                self.output_ids[self.sent_tokens :].tolist(),
                self.text.slice(self.sent_text, text_end),
            )
            lps = self.logprobs[self.sent_tokens :] if self.params.logprobs is not None else None
            self.sent_tokens, self.sent_text = len(self.output_ids), text_end
        else:
            ids, text = self.output_ids.tolist(), str(self.text)
            lps = list(self.logprobs) if self.params.logprobs is not None else None
        usage = Usage(**vars(self.usage))
        if self.lost and self.finish_reason == "error":
            return Unavailable(
                self.request_id, ids, text, self.finish_reason, usage, lps, error=self.error or ""
            )
        return RequestOutput(self.request_id, ids, text, self.finish_reason, usage, lps)
