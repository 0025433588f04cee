"""Turning logits into tokens: temperature, top-k, top-p, per-request seeds, logprobs.

Each request owns a `torch.Generator`, so a fixed seed reproduces its output whatever else is in the batch.
Logprobs are those of the model's own distribution (log-softmax of the raw logits), as OpenAI reports them.
"""

from __future__ import annotations

import torch

from minakv.outputs import TokenLogprob
from minakv.params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # keep a token if the mass strictly before it is < top_p (so the first token always stays)
        before = probs.cumsum(dim=-1) - probs
        remove = before >= top_p
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits float32 [R, V], one row per request -> one token id and optional logprob record per row."""
    tokens: list[int] = []
    records: list[TokenLogprob | None] = []
    logprobs = (
        torch.log_softmax(logits.float(), dim=-1) if any(p.logprobs is not None for p in params) else None
    )
    for row, (p, gen) in enumerate(zip(params, generators)):
        x = logits[row].float()
        if p.temperature == 0:
            token = int(torch.argmax(x))
        else:
            x = filter_logits(x / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(x, dim=-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=gen))
        tokens.append(token)
        if p.logprobs is None or logprobs is None:
            records.append(None)
            continue
        lp = logprobs[row]
        top: list[tuple[int, float]] = []
        if p.logprobs > 0:
            values, ids = torch.topk(lp, p.logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values)]
        records.append(TokenLogprob(token, float(lp[token]), top))
    return tokens, records
