"""Mixture-of-experts in plain torch: routing and the expert feed-forward.

Weight layout, shared by both families (the loader converts checkpoints into it):
  gate_up [E, 2I, H]  rows 0..I-1 are the gate projection, rows I..2I-1 the up projection ("halves";
                      GPT-OSS checkpoints interleave gate/up rows, the loader de-interleaves them),
  down    [E, H, I],
  optional biases gate_up_bias [E, 2I] (same row order) and down_bias [E, H] (GPT-OSS).
All weights are (out, in), like nn.Linear, so `x @ w.T` is a projection.

`moe` picks one of four ways to compute the same function, none of which loops over tokens:
- `moe_fused` (CUDA, up to FUSED_MAX_PAIRS (token, expert) pairs: decode): two Triton kernels that read each
  chosen expert's weights once, with bias and activation fused (minakv/ops/fused_moe.py). Few pairs scan the
  id list, more are counting-sorted by expert on the device first. Sync-free, any dtype.
- `moe_loop` (the reference, CPU): group the (token, expert) pairs by expert and run one matmul per expert
  that got tokens, then scatter the weighted outputs back with index_add in fp32. Reading the group sizes
  is a host sync, which is free on CPU and costly on a GPU.
- `moe_grouped` (CUDA, bf16/fp16): the same grouping, but one grouped GEMM (`F.grouped_mm`) per projection
  over all experts at once. No host sync (so a decode step can be captured in a CUDA graph), and only the
  weights of experts that got tokens are read, which is what decode at small batch is bound by. On the GPU
  the bias, activation and weighted sum around the two GEMMs are one Triton pass each (grouped_epilogue.py).
- `moe_dense` (CUDA, other dtypes, few tokens): every token through every expert with a batched matmul,
  combined with a [T, E] weight matrix that is zero off the chosen experts. Wasteful in bytes, but sync-free
  and exact in fp32, so small fp32 models can be graph-captured too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minakv.ops.fused_moe import moe_fused
from minakv.ops.grouped_epilogue import activate_rows, sum_rows
from minakv.ops.triton_util import use_triton

DENSE_MAX_PAIRS = 4096  # moe_dense only while tokens * experts stays small (it computes every pair)
# moe_fused up to this many (token, slot) pairs (decode batch 512 at top-4: its BLOCK_M reaches 128 rows per
# expert there); then the grouped GEMM, tiled for prefill's hundreds of rows per expert.
# bench/moe_variants.py measures both sides of this line.
FUSED_MAX_PAIRS = 2048


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
    """[..., 2I] (gate halves | up halves) -> [..., I]."""
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
    sum_k: bool = True,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype. sum_k=False lets the
    fused (decode) kernel return the k weighted parts [T, k, H] fp32 instead, for the residual add's norm
    to sum (minakv/ops/norm.py add_rms_norm): two launches per layer fewer; the other paths sum anyway."""
    args = (x, gate_up, down, topk_weights, topk_ids, gate_up_bias, down_bias, activation, limit, alpha)
    if use_triton(x) and topk_ids.numel() <= FUSED_MAX_PAIRS:
        return moe_fused(*args, sum_k=sum_k)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and hasattr(F, "grouped_mm"):
        return moe_grouped(*args)
    if x.is_cuda and x.shape[0] * gate_up.shape[0] <= DENSE_MAX_PAIRS:
        return moe_dense(*args)
    return moe_loop(*args)


def moe_loop(x, gate_up, down, topk_weights, topk_ids, gate_up_bias=None, down_bias=None,
             activation="silu", limit=7.0, alpha=1.702) -> torch.Tensor:  # fmt: skip
    """The reference: one matmul per expert that got tokens (syncs once to read the group sizes)."""
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


def moe_grouped(x, gate_up, down, topk_weights, topk_ids, gate_up_bias=None, down_bias=None,
                activation="silu", limit=7.0, alpha=1.702) -> torch.Tensor:  # fmt: skip
    """One grouped GEMM per projection over the pairs sorted by expert; no host sync.

    The k outputs of each token are put back in (token, slot) order and summed in fp32 by a plain
    reduction, so the result is deterministic (no atomics)."""
    num_tokens, k = topk_ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    expert_of, order = torch.sort(flat_ids, stable=True)
    # group ends for grouped_mm; a scatter-add counts without the host sync that bincount's sizing needs
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids.to(torch.int64), torch.ones_like(flat_ids, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)
    h = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    if use_triton(h):  # the bias, activation and the sum over slots in one pass each (grouped_epilogue.py)
        a = activate_rows(h, gate_up_bias, expert_of, activation, limit, alpha)
        y = F.grouped_mm(a, down.transpose(1, 2), offs=offs)
        return sum_rows(y, down_bias, order, topk_weights, topk_ids, x.dtype)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, expert_of)
    h = activate(h, activation, limit, alpha)
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offs)
    if down_bias is not None:
        y = y + down_bias.index_select(0, expert_of)
    pairs = torch.empty_like(y)
    pairs[order] = y  # back to (token, slot) order
    out = (pairs.view(num_tokens, k, -1).float() * topk_weights.float()[:, :, None]).sum(1)
    return out.to(x.dtype)


def moe_dense(x, gate_up, down, topk_weights, topk_ids, gate_up_bias=None, down_bias=None,
              activation="silu", limit=7.0, alpha=1.702) -> torch.Tensor:  # fmt: skip
    """Every token through every expert (batched matmuls), then a weighted sum over the chosen ones."""
    num_tokens = x.shape[0]
    num_experts = gate_up.shape[0]
    xe = x.unsqueeze(0).expand(num_experts, num_tokens, x.shape[1])
    h = torch.bmm(xe, gate_up.transpose(1, 2))  # [E, T, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[:, None, :]
    h = activate(h, activation, limit, alpha)
    y = torch.bmm(h, down.transpose(1, 2))  # [E, T, H]
    if down_bias is not None:
        y = y + down_bias[:, None, :]
    combine = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    combine.scatter_(1, topk_ids.to(torch.int64), topk_weights.float())
    out = torch.einsum("te,eth->th", combine, y.float())
    return out.to(x.dtype)
