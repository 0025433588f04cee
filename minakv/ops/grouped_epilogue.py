"""The two elementwise stages around a grouped GEMM's experts (`moe_grouped` in minakv/ops/moe.py), each one
Triton pass over the pairs sorted by expert, instead of a dozen torch ops that each read and write every
pair's row (at a 16,384-token prefill chunk of gpt-oss-20b those rows are 0.4-0.75 GB each):

    h [P, 2I] (gate | up)  -- activate_rows -->  a [P, I]     + the expert's gate/up bias, the activation
    y [P, H] (sorted)      -- sum_rows      -->  out [T, H]   + the expert's down bias, x the pair's weight,
                                                               summed over the token's k slots

Both compute in fp32 and round once. `sum_rows` reads each token's k rows where the sort put them
(`position`, the inverse of the sort's order), so nothing is scattered back first, and it sums a token's
slots in slot order: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile

BLOCK = 1024  # columns a program: rows are 2,880 (gpt-oss) to 3,072 (MiniMax-M2) wide


def activate_rows(
    h: torch.Tensor,  # [P, 2I] gate halves | up halves, pairs sorted by expert
    bias: torch.Tensor | None,  # [E, 2I]
    expert_of: torch.Tensor,  # [P] the expert of each sorted row
    activation: str,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """-> [P, I] in h's dtype: activation(gate + bias, up + bias) of each row."""
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows:
        _activate_kernel[(rows, triton.cdiv(inter, BLOCK))](
            h, bias if bias is not None else h, expert_of, out, inter, h.stride(0),
            bias.stride(0) if bias is not None else 0, float(limit), float(alpha),
            HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation], BLOCK=BLOCK,
        )  # fmt: skip
    return out


@triton.jit
def _activate_kernel(h_ptr, b_ptr, e_ptr, out_ptr, I, stride_h, stride_b, limit, alpha,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < I
    gate = tl.load(h_ptr + row * stride_h + n, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + I + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = tl.load(e_ptr + row).to(tl.int64)
        gate += tl.load(b_ptr + e * stride_b + n, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + e * stride_b + I + n, mask=ok, other=0.0).to(tl.float32)
    a = activate_tile(gate, up, limit, alpha, ACT)
    tl.store(out_ptr + row * I + n, a.to(out_ptr.dtype.element_ty), mask=ok)


def sum_rows(
    y: torch.Tensor,  # [P, H] the pairs' expert outputs, sorted by expert
    bias: torch.Tensor | None,  # [E, H]
    order: torch.Tensor,  # [P] sorted row -> pair (token * k + slot)
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    dtype: torch.dtype,
) -> torch.Tensor:
    """-> [T, H] in `dtype`: out[t] = sum over slots j of weight[t, j] * (y[row of (t, j)] + bias[expert])."""
    num_tokens, k = topk_ids.shape
    hidden = y.shape[1]
    position = torch.empty_like(order)  # pair -> its sorted row
    position[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=y.device)
    if num_tokens:
        weights = topk_weights.float().contiguous()
        _sum_kernel[(num_tokens, triton.cdiv(hidden, BLOCK))](
            y, bias if bias is not None else y, position, weights, topk_ids.contiguous(), out, hidden,
            y.stride(0), bias.stride(0) if bias is not None else 0, K=k, HAS_BIAS=bias is not None,
            BLOCK=BLOCK,
        )  # fmt: skip
    return out


@triton.jit
def _sum_kernel(y_ptr, b_ptr, pos_ptr, w_ptr, ids_ptr, out_ptr, H, stride_y, stride_b, K: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):  # slot order: the same sum whatever the batch
        row = tl.load(pos_ptr + t * K + j).to(tl.int64)
        v = tl.load(y_ptr + row * stride_y + n, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(ids_ptr + t * K + j).to(tl.int64)
            v += tl.load(b_ptr + e * stride_b + n, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + t * K + j) * v
    tl.store(out_ptr + t * H + n, acc.to(out_ptr.dtype.element_ty), mask=ok)
