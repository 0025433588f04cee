"""Applying a sampled token to a request: detokenize, and decide whether generation ends here.

Ends with "stop" on an end-of-sequence token (unless ignore_eos), a stop token id, or a stop string (the text
is cut before it); with "length" at max_tokens, at the engine's max_model_len, or when the next position
would reach the model's limit.
"""

from __future__ import annotations

from minakv.outputs import TokenLogprob
from minakv.scheduler.request import Request


def apply_token(r: Request, token: int, logprob: TokenLogprob | None, tokenizer, max_model_len: int) -> bool:
    """Append `token` to r's output; set r.finish_reason and return True if r is done."""
    r.output_ids.append(token)
    if logprob is not None:
        r.logprobs.append(logprob)
    p = r.params
    eos = set(r.eos_token_ids) if not p.ignore_eos else set()
    if token in eos or token in set(p.stop_token_ids or ()):
        r.finish_reason = "stop"
        return True
    if tokenizer is not None:
        r.text = tokenizer.decode(r.output_ids)
        for s in p.stop_strings:
            at = r.text.find(s, max(0, r.sent_text - len(s)))
            if at >= 0:
                r.text = r.text[:at]
                r.finish_reason = "stop"
                return True
    limit = r.program.max_positions
    if (
        len(r.output_ids) >= p.max_tokens
        or len(r.all_ids) >= max_model_len
        or (limit is not None and int(r.program.birth_positions([len(r.all_ids) - 1])[0]) >= limit)
    ):
        r.finish_reason = "length"
        return True
    return False
