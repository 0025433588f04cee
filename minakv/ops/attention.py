"""Attention in plain torch: the reference every attention path is checked against.

`masked_attention` takes an explicit boolean mask [T, S] (query t may read key s) and optional sinks:
one learned logit per head that joins the softmax denominator with no value, so a query that may read
nothing outputs exactly 0. GQA: query head h reads KV head h // (Hq / Hkv).
"""

from __future__ import annotations

import torch


def masked_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, D]
    mask: torch.Tensor,  # [T, S] bool
    scale: float,
    sinks: torch.Tensor | None = None,  # [Hq] logits
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", qf, kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    else:
        sink = torch.full((scores.shape[0], scores.shape[1], 1), float("-inf"), dtype=dtype, device=q.device)
    logits = torch.cat([scores, sink], dim=-1)
    top = logits.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(dtype).min)  # all -inf -> finite
    weights = (logits - top).exp()
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights[..., :-1] / denom.clamp(min=torch.finfo(dtype).tiny)
    out = torch.einsum("hts,shd->thd", probs, vf)
    return out.to(q.dtype)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal-by-position mask with an optional sliding window: key at k visible to query at p iff
    k <= p and p - k < window (docs/design.md 2.4; the window counts the query itself)."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask
