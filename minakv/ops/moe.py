"""Mixture-of-experts in plain torch: routing and the expert feed-forward.

Weight layout, shared by both families (the loader converts checkpoints into it):
  gate_up [E, 2I, H]  rows 0..I-1 are the gate projection, rows I..2I-1 the up projection ("halves";
                      GPT-OSS checkpoints interleave gate/up rows, the loader de-interleaves them),
  down    [E, H, I],
  optional biases gate_up_bias [E, 2I] (same row order) and down_bias [E, H] (GPT-OSS).
All weights are (out, in), like nn.Linear, so `x @ w.T` is a projection.

`moe` is the reference a Triton kernel shares its signature with: it groups the (token, expert) pairs by
expert and runs one matmul per expert that got tokens (a loop over experts, never over tokens), then
scatters the weighted outputs back with index_add in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: top-k of the router logits, softmax over only those k -> (weights f32, ids)."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids


def route_sigmoid_bias(
    logits: torch.Tensor, correction_bias: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2 routing: sigmoid scores; the correction bias only *chooses* the experts, the weights are
    the unbiased scores of the chosen ones, renormalised to sum to 1 -> (weights f32, ids)."""
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + correction_bias.float(), k, dim=-1)
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def activate(
    gate_up: torch.Tensor, activation: str, limit: float = 7.0, alpha: float = 1.702
) -> torch.Tensor:
    """[N, 2I] (gate halves | up halves) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        # GPT-OSS: gate clamped from above only, up on both sides, and the "+1" on up.
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    raise ValueError(f"unknown MoE activation {activation!r} (expected 'silu' or 'swiglu_oai')")


def moe(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype."""
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = tokens[start : start + count]
        w = weights[start : start + count]
        start += count
        h = F.linear(
            x.index_select(0, idx), gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert]
        )
        h = activate(h, activation, limit, alpha)
        y = F.linear(h, down[expert], None if down_bias is None else down_bias[expert])
        out.index_add_(0, idx, y.float() * w[:, None])
    return out.to(x.dtype)
