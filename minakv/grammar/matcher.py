"""A request's grammar state, and the token masks of one step.

A `GrammarMatcher` follows one request's output: the scheduler advances it with every token the request
gets (minakv/scheduler/stops.py) and, when building a step, asks every constrained request for the tokens
it may sample next. Those come back as one bitmask for the step:

    mask [rows, ceil(V / 32)] int32       bit j of word w set  <=>  token 32 * w + j is allowed

filled on the host by llguidance (in parallel over the rows, without the GIL), copied to the device once,
and applied to the logits of all constrained rows at once (minakv/worker/sampler.py, `adjust`).

The end-of-sequence tokens are allowed exactly when the grammar accepts the output so far. Once nothing
but EOS may follow (`done`), the request ends (finish reason "stop") without sampling again.
"""

from __future__ import annotations

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

_executor: llg.LLExecutor | None = None


class GrammarMatcher:
    def __init__(self, matcher: llg.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's (the width of the logits the mask applies to)

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (the matcher is then
        in an error state for good)."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more (or failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(matchers: list[GrammarMatcher]) -> np.ndarray:
    """[len(matchers), ceil(V / 32)] int32: row i holds the tokens matchers[i] allows next."""
    global _executor
    if _executor is None:  # a thread pool, made on first use
        _executor = llg.LLExecutor()
    mask = np.zeros((len(matchers), mask_width(matchers[0].vocab_size)), dtype=np.int32)
    llg_np.fill_next_token_bitmask_par(_executor, [(m.matcher, i) for i, m in enumerate(matchers)], mask)
    return mask
