"""Applying a sampled token to a request: detokenize, and decide whether generation ends here.

Ends with "stop" on an end-of-sequence token (unless ignore_eos), a stop token id, a stop string (the text
is cut before it), or when the request's grammar is complete (structured outputs: nothing may follow); with
"length" at max_tokens, when the positions used reach the engine's max_model_len (positions, not raw tokens:
drops and repositions keep an agent's positions compact), or when the next position would reach the model's
limit; with "error" if the grammar refuses the token (its mask makes that impossible).

This runs for every request in every engine step, so its work per token is O(1), whatever the output's
length: the text grows by what an incremental detokenizer (minakv/text/detokenize.py) says the token
completes (appended to an `OutputText`, minakv/text/output_text.py: no copy of the text so far), and a
stop string is looked for only where the new text could complete one.

`str(r.text)` is what `tokenizer.decode(r.output_ids)` gives, less a trailing partial character (U+FFFD) while
running; when the request finishes, that held-back U+FFFD is appended too, so the final text is exactly the
full decode (cut before a stop string; a stop token's own text is never added). A request that asked for
token ids only (`detokenize=False`) has no text.
"""

from __future__ import annotations

from minakv.outputs import TokenLogprob
from minakv.scheduler.request import Request
from minakv.text.detokenize import IncrementalDetokenizer


def apply_token(r: Request, token: int, logprob: TokenLogprob | None, tokenizer, max_model_len: int) -> bool:
    """Append `token` to r's output; set r.finish_reason and return True if r is done."""
    r.output_ids.append(token)
    if logprob is not None:
        r.logprobs.append(logprob)
    p = r.params
    if (not p.ignore_eos and token in r.eos_set) or token in r.stop_set:
        return _finish(r, "stop")
    if tokenizer is not None and p.detokenize:
        if r.detok is None:  # made at the request's first output token
            r.detok = IncrementalDetokenizer(tokenizer)
        new = r.detok.push(token)
        if new:
            start = len(r.text)
            r.text.append(new, keep=r.hold_back)  # (the tail keeps the last len(s) - 1 characters)
            for s in r.stop_strings:
                # A match not found before must end in the new text: start at most len(s) - 1 before it.
                at = r.text.find(s, max(0, start - len(s) + 1))
                if at >= 0:
                    r.text.cut(at)
                    r.finish_reason = "stop"
                    return True
    if r.grammar is not None:
        if not r.grammar.accept(token):
            r.error = f"token {token} breaks the request's grammar: {r.grammar.error}"
            return _finish(r, "error")
        if r.grammar.done:
            return _finish(r, "stop")
    n = len(r.output_ids)
    limit = r.program.max_positions
    if (
        n >= p.max_tokens
        or r.program.next_pos + n >= max_model_len  # positions used, as vLLM counts prompt + output tokens
        # generated token j is born at program.next_pos + j (Program.birth_positions); this one is j = n - 1
        or (limit is not None and r.program.next_pos + n - 1 >= limit)
    ):
        return _finish(r, "length")
    return False


def _finish(r: Request, reason: str) -> bool:
    """End r: the text held back as an incomplete character (U+FFFD) is final now."""
    r.finish_reason = reason
    if r.detok is not None:
        r.text.append(r.detok.flush())
    return True
