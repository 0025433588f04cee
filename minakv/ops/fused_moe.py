"""Fused MoE for small batches (decode): two Triton kernels that read each chosen expert's weights once.

At decode the MoE is bound by the bytes of the expert weights it reads: batch 32 with top-4 of 32 experts
touches nearly every expert, but each with only ~4 rows. A general grouped GEMM tiles for large M and
runs far from memory bandwidth there, and the glue around it (bias gathers, the activation as a chain of
elementwise ops, the scatter back) costs a dozen more launches per layer. Here:

  pairs    the T*k (token, slot) pairs, in that order. A program finds its expert's pairs one of two ways:
             scan    (few pairs) it reads the whole id list and numbers its matches by a prefix sum, so
                     nothing runs between the router and the experts; the scan grows with the pair count,
             sorted  (decode batch 32..512) one small kernel counting-sorts the pairs by expert first
                     (one program, stable, no host sync), so a program reads its rows' pair indices
                     directly: order[start[e] : start[e] + count[e]],
  kernel 1 one program per (expert, block of I columns): gate and up tiles of the same columns, so
           bias + activation happen in registers; writes h [T*k, I] (pair rows),
  kernel 2 one program per (expert, block of H columns): h @ down^T + bias, times the pair's routing
           weight, written in fp32 to the pair's row; a plain sum over the k slots (no atomics:
           deterministic) gives the output.

A program loops over its expert's rows in blocks of BLOCK_M; BLOCK_M is sized from the average rows per
expert so that most experts take one pass (a second pass re-reads the weight tile, likely from HBM).
swap_ab computes (W @ x^T) instead of (x @ W^T): the weight rows fill the MMA's M (64+ on Hopper) and the
few token rows its N, so few rows per expert waste no tensor-core work. Experts with no pair return at once.

`moe_fused` has the signature of the references in minakv/ops/moe.py and is checked against them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts, sort_by_expert
from minakv.ops.triton_util import check, interpreting

SCAN_MAX_PAIRS = 64  # up to this many pairs the id scan is cheaper than a sort launch


def moe_fused(x, gate_up, down, topk_weights, topk_ids, gate_up_bias=None, down_bias=None,
              activation="silu", limit=7.0, alpha=1.702, *, sum_k: bool = True, sort: bool | None = None,
              swap_ab: bool = False,
              block_m: int | None = None, block_n: int = 64, block_k: int | None = None,
              num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:  # fmt: skip
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype. The keyword-only knobs
    are for benchmarks and tests (sort None: sort above SCAN_MAX_PAIRS pairs). sum_k=False: the k weighted
    outputs per token unsummed, [T, k, H] fp32."""
    check(
        activation in ACTIVATIONS, f"unknown MoE activation {activation!r} (expected 'silu' or 'swiglu_oai')"
    )
    num_tokens, k = topk_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    check(x.shape == (num_tokens, hidden), f"x is {tuple(x.shape)}, expected ({num_tokens}, {hidden})")
    check(down.shape == (num_experts, hidden, inter), f"down is {tuple(down.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    num_pairs = num_tokens * k
    sort = num_pairs > SCAN_MAX_PAIRS if sort is None else sort
    block_m = block_m or default_block_m(num_pairs, num_experts, sort)
    block_k = block_k or (64 if block_m >= 128 else 128)  # 128 x 128 x-tiles would crowd shared memory

    ids = topk_ids.reshape(-1).contiguous()
    rows, pairs_pad = find_rows(ids, num_experts, sort)
    rows = (*rows, num_pairs)
    meta = {
        "SORTED": sort, "SWAP_AB": swap_ab, "PAIRS_PAD": pairs_pad, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "BLOCK_K": block_k, "F32_DOT": x.dtype == torch.float32 or interpreting(),
        "num_warps": num_warps, "num_stages": num_stages,
    }  # fmt: skip
    dummy = ids  # any pointer, for absent biases

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up_bias if gate_up_bias is not None else dummy, *rows, h,
        hidden, inter, k, float(limit), float(alpha),
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(num_experts, triton.cdiv(hidden, block_n))](
        h, down, down_bias if down_bias is not None else dummy, *rows, weights, y,
        inter, hidden, h.stride(0), down.stride(0), down.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    return k_parts(y, num_tokens, k, x.dtype, sum_k)


def find_rows(ids: torch.Tensor, num_experts: int, sort: bool) -> tuple[tuple[torch.Tensor, ...], int]:
    """How the kernels find an expert's pairs (here and in fp8_moe.py): ((ids, order, counts, starts), the
    scan's PAIRS_PAD). Sorted: the counting sort's order and per-expert runs; else the ids alone (the others
    are unread stand-ins) and the padded length of the id scan."""
    if sort:
        order, counts, starts, _ = sort_by_expert(ids, num_experts)
        return (ids, order, counts, starts), 16  # (PAIRS_PAD unused: no scan)
    return (ids, ids, ids, ids), max(16, triton.next_power_of_2(ids.numel()))


def default_block_m(num_pairs: int, num_experts: int, sort: bool) -> int:
    """Rows per pass. Scan: twice the average rows per expert. Sorted: 1.5x the average, so that under
    near-uniform routing most experts' rows fit one pass (weights read once); >= a tensor-core tile."""
    avg = triton.cdiv((4 if not sort else 3) * num_pairs, 2 * num_experts)
    return min(64 if not sort else 128, max(16, triton.next_power_of_2(avg)))


@triton.jit
def _my_pairs(ids_ptr, num_pairs, expert, PAIRS_PAD: tl.constexpr):
    """This expert's pairs: (is mine [PAIRS_PAD], my running number [PAIRS_PAD], how many)."""
    offs = tl.arange(0, PAIRS_PAD)
    mine = (tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert).to(tl.int32)
    return mine, tl.cumsum(mine, 0) - 1, tl.sum(mine, 0)


@triton.jit
def _pairs_of_rows(mine, number, m0, BLOCK_M: tl.constexpr, PAIRS_PAD: tl.constexpr):
    """Pair index of this expert's rows m0 .. m0 + BLOCK_M - 1 (0 past the last)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    hit = (mine[None, :] == 1) & (number[None, :] == rows[:, None])
    return tl.sum(tl.where(hit, tl.arange(0, PAIRS_PAD)[None, :], 0), 1)


@triton.jit
def _expert_rows(ids_ptr, counts_ptr, starts_ptr, num_pairs, expert,
                 SORTED: tl.constexpr, PAIRS_PAD: tl.constexpr):  # fmt: skip
    """How to find this expert's rows -> (mine, number, count, start): the scan's match vectors, or the
    sorted run order[start : start + count]."""
    if SORTED:
        count = tl.load(counts_ptr + expert)
        start = tl.load(starts_ptr + expert)
        mine = tl.zeros((PAIRS_PAD,), dtype=tl.int32)  # unused
        number = mine
    else:
        mine, number, count = _my_pairs(ids_ptr, num_pairs, expert, PAIRS_PAD)
        start = count * 0
    return mine, number, count, start


@triton.jit
def _row_pairs(order_ptr, mine, number, count, start, m0,
               SORTED: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS_PAD: tl.constexpr):  # fmt: skip
    """Pair indices of this expert's rows m0 .. m0 + BLOCK_M - 1, and which of them are real."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    if SORTED:
        pair = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0)
    else:
        pair = _pairs_of_rows(mine, number, m0, BLOCK_M, PAIRS_PAD)
    return pair, m_ok


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    # One return per static branch here and below: compiled Triton type-checks every return it visits
    # (the interpreter does not), and the two layouts differ in shape.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _dot(a, w, acc, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ w^T (or its transpose, w @ a^T, with SWAP_AB), with w stored (out, in) like nn.Linear."""
    if F32_DOT:  # fp32 weights (or the interpreter): exact fp32 products, not tf32
        if SWAP_AB:
            acc = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _rows_first(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N] (rows, columns) for the epilogue."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _weight_tile(w_ptr, expert, N, stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output columns (block program_id(1) of N) and the pointers to the expert's weight
    rows for them at k = 0..BLOCK_K-1 (weights stored (out, in): a row per output column)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    return offs_n, offs_n < N, offs_k, w_rows


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, ids_ptr, order_ptr, counts_ptr, starts_ptr, num_pairs, h_ptr,
    H, I, TOPK, limit, alpha,
    stride_x, stride_we, stride_wn, stride_be, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SORTED: tl.constexpr, SWAP_AB: tl.constexpr,
    PAIRS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    mine, number, count, start = _expert_rows(ids_ptr, counts_ptr, starts_ptr, num_pairs, expert, SORTED,
                                              PAIRS_PAD)  # fmt: skip
    if count == 0:
        return
    offs_n, n_ok, offs_k, w_gate = _weight_tile(w_ptr, expert, I, stride_we, stride_wn, BLOCK_N, BLOCK_K)
    w_up = w_gate + I * stride_wn  # up rows I + n: the same output columns of h as gate rows n
    if HAS_BIAS:
        b_gate = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_ptr + expert * stride_be + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _row_pairs(order_ptr, mine, number, count, start, m0, SORTED, BLOCK_M, PAIRS_PAD)
        x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        acc_gate = _zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        acc_up = _zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        for k0 in range(0, H, BLOCK_K):
            k_ok = k0 + offs_k < H
            a = tl.load(x_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_gate + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(w_up + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_gate = _dot(a, wg, acc_gate, F32_DOT, SWAP_AB)
            acc_up = _dot(a, wu, acc_up, F32_DOT, SWAP_AB)
        gate = _rows_first(acc_gate, SWAP_AB)
        up = _rows_first(acc_up, SWAP_AB)
        if HAS_BIAS:
            gate += b_gate[None, :]
            up += b_up[None, :]
        act = activate_tile(gate, up, limit, alpha, ACT)
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h + offs_n[None, :]
        tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, order_ptr, counts_ptr, starts_ptr, num_pairs, weights_ptr, y_ptr,
    I, H, stride_h, stride_we, stride_wn, stride_be, stride_y,
    HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, SWAP_AB: tl.constexpr,
    PAIRS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    mine, number, count, start = _expert_rows(ids_ptr, counts_ptr, starts_ptr, num_pairs, expert, SORTED,
                                              PAIRS_PAD)  # fmt: skip
    if count == 0:
        return
    offs_n, n_ok, offs_k, w_rows = _weight_tile(w_ptr, expert, H, stride_we, stride_wn, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _row_pairs(order_ptr, mine, number, count, start, m0, SORTED, BLOCK_M, PAIRS_PAD)
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
        acc = _zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        for k0 in range(0, I, BLOCK_K):
            k_ok = k0 + offs_k < I
            a = tl.load(h_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, F32_DOT, SWAP_AB)
        acc = _rows_first(acc, SWAP_AB)
        if HAS_BIAS:
            acc += bias[None, :]
        acc *= tl.load(weights_ptr + pair, mask=m_ok, other=0.0)[:, None]
        y_rows = y_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(y_rows, acc, mask=m_ok[:, None] & n_ok[None, :])
