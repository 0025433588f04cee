"""Continuous batching: which requests run, which of their tokens are computed in the next forward, and what
happens to the sampled tokens.

- `request`: a request inside the engine (its tokens, program, plan of KV entries, pages, progress).
- `scheduler`: admission, preemption, `schedule()` -> `ForwardBatch` and `update(batch, result)`.
- `stops`: applying a sampled token: detokenize, and decide whether generation ends.
"""
