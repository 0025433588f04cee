"""MoE routing in two launches: router logits, then the top-k and the chosen experts' weights.

The torch form is four kernels per layer (the router's GEMM with its bias, `topk`, a cast, `softmax`); at
decode batch 1 each of them is a few microseconds of a launch and almost no bytes, 24 or 36 layers over.
Here the router ([E, H], a few hundred KB) is cut along H into slices spread over programs, so that even
one token keeps many SMs reading:

    _route_partial  program (block of 16 tokens, split s): fp32 logits of its slices of H -> partial[s]
                    (and, asked for `pair_out`, those slices of x as the tensor-core MXFP4 GEMV reads
                    them, mxfp4_order.py: every input is loaded here anyway, and it saves that launch)
    _route_finish   program (one token): sum its splits (one load), add the bias, round to the
                    activations' dtype exactly as the GEMM's output is rounded, pick the k largest by k
                    rounds of (max, first index of it, mask it out), then the weights of those k:
                    GPT-OSS  a softmax over the k logits (`route_softmax_topk_fused`)
                    MiniMax  sigmoid scores; the k largest of score + correction bias are chosen, their
                             unbiased scores renormalised to sum to 1 (`route_sigmoid_bias_fused`)

Up to FINISH_IN_PLACE_MAX tokens (decode at batch 1-4) there is no second launch: each split program
counts itself in with an atomic add on the block's counter once its partial sums are stored, and the
last to arrive (it sees every other one's stores: acquire-release) finishes the block's tokens and sets
the counter back to 0 for the next call. The counter is the caller's (`counts`, one int32 per block,
zeros; the MoE blocks make theirs in `fuse`), so no launch clears it.

One program looping over all of H took 17 us a layer at gpt-oss-120b's batch 1 on the H200 (0.6 ms of a
3.8 ms step: the loop's latency, not bytes). For prefill batches the GEMM is better left to cuBLAS, so
`route_softmax_topk_fused` is used up to `FUSED_MAX_TOKENS` tokens (a decode batch), the torch form above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.mxfp4_order import pair_position, saturate_f16
from minakv.ops.triton_util import check, interpreting, pdl_options

FUSED_MAX_TOKENS = 512
BLOCK_T = 16  # tokens per program: the smallest tensor-core tile
TARGET_PROGRAMS = 128  # about one per SM of the H200 (132): enough to keep its reads in flight
FINISH_IN_PLACE_MAX = 4  # tokens: the last split program finishes them (beyond, a program per token)


def route_softmax_topk_fused(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [E, H]
    bias: torch.Tensor | None,  # [E]
    k: int,
    pair_out: torch.Tensor | None = None,  # [T, H] fp16
    counts: torch.Tensor | None = None,  # int32 zeros, one per block of BLOCK_T tokens (module docstring)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] f32, ids [T, k] int64), as `route_softmax_topk(F.linear(x, weight, bias), k)`. With
    `pair_out`, also writes `mxfp4_order.pair_order(x)` into it (no extra launch)."""
    return _route(x, weight, bias, k, sigmoid=False, pair_out=pair_out, counts=counts)


def route_sigmoid_bias_fused(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [E, H]
    correction_bias: torch.Tensor,  # [E] fp32
    k: int,
    counts: torch.Tensor | None = None,  # as in route_softmax_topk_fused
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] f32, ids [T, k] int64), as `route_sigmoid_bias(F.linear(x, weight), correction_bias, k)`."""
    return _route(x, weight, correction_bias, k, sigmoid=True, counts=counts)


def block_counters(device: torch.device) -> torch.Tensor:
    """The `counts` a router keeps for its one-launch finish (zeros; every call leaves them zero)."""
    return torch.zeros(triton.cdiv(FINISH_IN_PLACE_MAX, BLOCK_T), dtype=torch.int32, device=device)


def _route(x, weight, bias, k: int, sigmoid: bool, pair_out: torch.Tensor | None = None,
           counts: torch.Tensor | None = None):  # fmt: skip
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    check(weight.shape == (num_experts, hidden), f"router weight {tuple(weight.shape)}, x {tuple(x.shape)}")
    check(0 < k <= num_experts, f"top-k {k} of {num_experts} experts")
    check(
        pair_out is None
        or (pair_out.shape == x.shape and pair_out.dtype == torch.float16 and pair_out.is_contiguous())
        and hidden % 8 == 0,
        f"pair_out: a contiguous fp16 tensor of x's shape {tuple(x.shape)}, a multiple of 8 wide",
    )
    x, weight = x.contiguous(), weight.contiguous()
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = max(16, triton.next_power_of_2(num_experts))
    block_h = max(32, min(128, 8192 // e_pad))
    blocks = triton.cdiv(num_tokens, BLOCK_T)
    slices = triton.cdiv(hidden, block_h)
    per_split = triton.cdiv(slices, max(1, min(slices, TARGET_PROGRAMS // blocks)))
    splits = triton.cdiv(slices, per_split)
    partial = torch.empty(splits, blocks * BLOCK_T, e_pad, dtype=torch.float32, device=x.device)
    in_place = num_tokens <= FINISH_IN_PLACE_MAX
    if in_place and counts is None:
        counts = block_counters(x.device)
    check(
        not in_place
        or (counts.dtype == torch.int32 and counts.numel() >= blocks and counts.device == x.device),
        f"counts: int32 zeros on {x.device}, at least {blocks}",
    )
    finish = {
        "HAS_BIAS": bias is not None, "SIGMOID": sigmoid, "E_PAD": e_pad,
        "K_PAD": max(2, triton.next_power_of_2(k)), "S_PAD": max(2, triton.next_power_of_2(splits)),
        "num_warps": 4, **pdl_options(),
    }  # fmt: skip
    tail = (bias if bias is not None else weight, weights, ids, k, blocks * BLOCK_T)
    _route_partial[(blocks, splits)](
        x, weight, partial, pair_out if pair_out is not None else partial, counts if in_place else ids,
        num_tokens, hidden, num_experts, per_split * block_h, *tail, BLOCK_T=BLOCK_T, BLOCK_H=block_h,
        F32_DOT=x.dtype == torch.float32 or interpreting(), PAIR=pair_out is not None, IN_PLACE=in_place,
        **finish,
    )  # fmt: skip
    if not in_place:
        _route_finish[(num_tokens,)](partial, x, num_experts, splits, *tail, **finish)
    return weights, ids


@triton.jit
def _route_partial(
    x_ptr, w_ptr, partial_ptr, pair_ptr, count_ptr, num_tokens, hidden, num_experts, H_SPLIT,
    b_ptr, weights_ptr, ids_ptr, k, rows,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, F32_DOT: tl.constexpr, PAIR: tl.constexpr,
    IN_PLACE: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, E_PAD: tl.constexpr,
    K_PAD: tl.constexpr, S_PAD: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    if USE_GDC:  # (triton_util.PDL) the kernel before may still be writing x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # (the kernel after waits for all of this one anyway)
    block = tl.program_id(0)
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    ok_t, ok_e = offs_t < num_tokens, offs_e < num_experts
    acc = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    h_lo = tl.program_id(1) * H_SPLIT
    h_hi = tl.minimum(h_lo + H_SPLIT, hidden)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        ok_h = offs_h < h_hi
        xs = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * hidden + offs_h[None, :],
                     mask=ok_t[:, None] & ok_h[None, :], other=0.0)  # fmt: skip
        if PAIR:  # (block_h is a multiple of 8: a word's 8 inputs stay in one program)
            tl.store(pair_ptr + offs_t[:, None].to(tl.int64) * hidden + pair_position(offs_h)[None, :],
                     saturate_f16(xs), mask=ok_t[:, None] & ok_h[None, :])  # fmt: skip
        ws = tl.load(
            w_ptr + offs_e[None, :] * hidden + offs_h[:, None], mask=ok_e[None, :] & ok_h[:, None], other=0.0
        )  # fmt: skip  [BLOCK_H, E_PAD]
        if F32_DOT:
            acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xs, ws)
    rows_here = tl.program_id(1) * tl.num_programs(0) * BLOCK_T + offs_t
    tl.store(partial_ptr + rows_here[:, None].to(tl.int64) * E_PAD + offs_e[None, :], acc)
    if IN_PLACE:  # the block's last program to count itself in finishes its tokens (module docstring)
        # one thread does the atomic: the barrier puts every thread's stores above before its release
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            tl.store(count_ptr + block, 0)
            for t in range(block * BLOCK_T, tl.minimum(num_tokens, (block + 1) * BLOCK_T)):
                _finish_token(partial_ptr, x_ptr, num_experts, tl.num_programs(1), b_ptr, weights_ptr, ids_ptr,
                              k, rows, t, HAS_BIAS, SIGMOID, E_PAD, K_PAD, S_PAD)  # fmt: skip


@triton.jit
def _route_finish(
    partial_ptr, x_ptr, num_experts, splits, b_ptr, weights_ptr, ids_ptr, k, rows,
    HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    if USE_GDC:  # (triton_util.PDL) the partial sums are the kernel before's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _finish_token(partial_ptr, x_ptr, num_experts, splits, b_ptr, weights_ptr, ids_ptr, k, rows, tl.program_id(0),
                  HAS_BIAS, SIGMOID, E_PAD, K_PAD, S_PAD)  # fmt: skip


@triton.jit
def _finish_token(
    partial_ptr, x_ptr, num_experts, splits, b_ptr, weights_ptr, ids_ptr, k, rows, t,
    HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):  # fmt: skip
    """Token t: its splits' partial logits in one load (a loop over them, one load each, took 8.7 us at
    120b's 23 splits; ".cg": from L2, where the other programs' stores are), then the top-k and the
    weights (SIGMOID: MiniMax's, b_ptr its correction bias)."""
    offs_s, offs_e = tl.arange(0, S_PAD), tl.arange(0, E_PAD)
    ok_e = offs_e < num_experts
    parts = tl.load(partial_ptr + (offs_s[:, None] * rows + t).to(tl.int64) * E_PAD + offs_e[None, :],
                    mask=(offs_s < splits)[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
    acc = tl.sum(parts, 0)  # a fixed order: the same logits whatever the timing
    if HAS_BIAS and not SIGMOID:
        acc += tl.load(b_ptr + offs_e, mask=ok_e, other=0.0).to(tl.float32)
    # the logits the GEMM would hand over, in the activations' dtype (x_ptr: only for it; top-k ties and
    # softmax inputs alike)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    if SIGMOID:  # logits := the choosing key, score + correction bias; the weights come from the scores
        scores = tl.sigmoid(logits)
        logits = scores + tl.load(b_ptr + offs_e, mask=ok_e, other=0.0).to(tl.float32)
    logits = tl.where(ok_e, logits, float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    top = tl.full((K_PAD,), float("-inf"), dtype=tl.float32)
    top_ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in range(k):
        best = tl.max(logits, 0)
        first = tl.min(tl.where(logits == best, offs_e, E_PAD), 0)
        top = tl.where(offs_k == j, best, top)
        top_ids = tl.where(offs_k == j, first, top_ids)
        logits = tl.where(offs_e == first, float("-inf"), logits)
    if SIGMOID:
        p = tl.sum(tl.where(top_ids[:, None] == offs_e[None, :], scores[None, :], 0.0), 1)
        p = tl.where(offs_k < k, p, 0.0)
    else:
        p = tl.exp(top - tl.max(top, 0))  # the padding's -inf gives 0
    p = p / tl.sum(p, 0)
    out = (t * k + offs_k).to(tl.int64)  # (t: a plain int in the interpreter's loop)
    tl.store(weights_ptr + out, p, mask=offs_k < k)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=offs_k < k)
