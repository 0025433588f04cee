"""GPT-OSS routing in one launch: router logits, top-k, and the softmax over the chosen k.

The torch form is four kernels per layer (the router's GEMM with its bias, `topk`, a cast, `softmax`); at
decode batch 1 each of them is a few microseconds of a launch and almost no bytes, 24 layers over. Here
one program takes a block of tokens: it computes their logits against the whole router ([E, H], a few
hundred KB, read from L2 after the first block; wide slices of H, since at batch 1 the loop over H is
the kernel's whole latency: 12.8 us a call with slices of 128 on the H200), rounds them to the activations' dtype exactly as the
GEMM's output is rounded, picks the k largest by k rounds of (max, first index of it, mask it out), and
softmaxes those k in fp32.

For prefill batches the GEMM is better left to cuBLAS, so `route_softmax_topk_fused` is used up to
`FUSED_MAX_TOKENS` tokens (a decode batch), the torch form above that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import check, interpreting

FUSED_MAX_TOKENS = 512
BLOCK_T = 16  # tokens per program: the smallest tensor-core tile


def route_softmax_topk_fused(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [E, H]
    bias: torch.Tensor | None,  # [E]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] f32, ids [T, k] int64), as `route_softmax_topk(F.linear(x, weight, bias), k)`."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    check(weight.shape == (num_experts, hidden), f"router weight {tuple(weight.shape)}, x {tuple(x.shape)}")
    check(0 < k <= num_experts, f"top-k {k} of {num_experts} experts")
    x, weight = x.contiguous(), weight.contiguous()
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = max(16, triton.next_power_of_2(num_experts))
    _route_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        x, weight, bias if bias is not None else weight, weights, ids, num_tokens, hidden, num_experts, k,
        HAS_BIAS=bias is not None, E_PAD=e_pad, K_PAD=max(2, triton.next_power_of_2(k)), BLOCK_T=BLOCK_T,
        BLOCK_H=max(32, min(512, 16384 // e_pad)), F32_DOT=x.dtype == torch.float32 or interpreting(),
        num_warps=8,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, hidden, num_experts, k,
    HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    ok_t, ok_e = offs_t < num_tokens, offs_e < num_experts
    acc = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        ok_h = offs_h < hidden
        xs = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * hidden + offs_h[None, :],
                     mask=ok_t[:, None] & ok_h[None, :], other=0.0)  # fmt: skip
        ws = tl.load(
            w_ptr + offs_e[None, :] * hidden + offs_h[:, None], mask=ok_e[None, :] & ok_h[:, None], other=0.0
        )  # fmt: skip  [BLOCK_H, E_PAD]
        if F32_DOT:
            acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xs, ws)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_e, mask=ok_e, other=0.0).to(tl.float32)[None, :]
    # the logits the GEMM would hand over, in the activations' dtype (top-k ties and softmax inputs alike)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(ok_e[None, :], logits, float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    top = tl.full((BLOCK_T, K_PAD), float("-inf"), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in range(k):
        best = tl.max(logits, 1)
        first = tl.min(tl.where(logits == best[:, None], offs_e[None, :], E_PAD), 1)
        top = tl.where(offs_k[None, :] == j, best[:, None], top)
        top_ids = tl.where(offs_k[None, :] == j, first[:, None], top_ids)
        logits = tl.where(offs_e[None, :] == first[:, None], float("-inf"), logits)
    p = tl.exp(top - tl.max(top, 1)[:, None])  # the padding's -inf gives 0
    p = p / tl.sum(p, 1)[:, None]
    out = offs_t[:, None].to(tl.int64) * k + offs_k[None, :]
    ok = ok_t[:, None] & (offs_k[None, :] < k)
    tl.store(weights_ptr + out, p, mask=ok)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=ok)
