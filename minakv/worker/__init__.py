"""The worker: owns the model and the KV tensors, and turns one `ForwardBatch` into sampled tokens.

- `batch`: `ForwardBatch`, the contract between the scheduler and the worker.
- `paged`: `PagedContext`, the attention context of a paged step (rotate, store, attend).
- `graphs`: CUDA graphs for decode-only steps.
- `sampler`: logits to tokens (temperature, top-k, top-p, seeds, logprobs).
- `worker`: `Worker.step(batch)`.
"""
