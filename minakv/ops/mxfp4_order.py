"""The order the tensor-core MXFP4 kernels (mxfp4_mma.py, mxfp4_mma_grouped.py) read activations in.

A lane of their MMAs turns one packed word (8 FP4 codes, inputs 8j .. 8j + 7 of a row) into fp16 pairs
(0, 2) (4, 6) (1, 3) (5, 7): two A fragments of two `mma.sync`. The sum over k does not care about the
order of k, so the activations only have to follow it: within each 8 inputs they are stored as

    input   0 1 2 3 4 5 6 7        fp16, pair order:  x0 x2 x4 x6 | x1 x3 x5 x7
                                                        MMA 1        MMA 2

and a lane's one 16-byte load is its B fragments. `pair_order` writes x that way (one launch, also
gathering the rows of pairs sorted by expert for the grouped kernels), or the router's first kernel does
on the way (routing.py, `pair_out`); gate/up writes h straight in it (`pair_position`), so down reads h as
it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import pdl_options


def pair_order(
    x: torch.Tensor, order: torch.Tensor | None = None, topk: int = 1, pad: int = 0
) -> torch.Tensor:
    """[T, K] activations -> fp16 [T, K] in the order the MMA's B fragments read them: within each 8 inputs
    (one packed word) 0 2 4 6 1 3 5 7. Values beyond fp16's range saturate at +-65504 (one launch). With
    `order` (pairs sorted by expert, mxfp4_mma_grouped.py): row r is token order[r] // topk's, then `pad`
    rows of zeros."""
    t, k = x.shape
    rows = t if order is None else order.numel() + pad
    out = torch.empty(rows, k, dtype=torch.float16, device=x.device)
    src = order if order is not None else out  # (unread without an order)
    _pair_order_kernel[(rows, triton.cdiv(k, 1024))](
        x,
        src,
        out,
        k,
        x.stride(0),
        rows - pad,
        topk,
        HAS_ORDER=order is not None,
        BLOCK=1024,
        **pdl_options(),
    )
    return out


@triton.jit
def _pair_order_kernel(x_ptr, order_ptr, out_ptr, K, stride_x, num_rows, TOPK, HAS_ORDER: tl.constexpr,
                       BLOCK: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    if USE_GDC:  # (triton_util.PDL) x and the order are the kernels' before
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # destination: input 8j + m comes from 8j + src
    m = offs % 8
    src = offs - m + (m % 4) * 2 + m // 4
    ok = offs < K
    if HAS_ORDER:
        x_row = tl.load(order_ptr + tl.minimum(row, num_rows - 1)) // TOPK  # pad rows: any row, masked
        ok = ok & (offs * 0 + row < num_rows)  # (a vector: the interpreter rejects scalar & vector masks)
    else:
        x_row = row
    v = tl.load(x_ptr + x_row.to(tl.int64) * stride_x + src, mask=ok, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row.to(tl.int64) * K + offs, saturate_f16(v), mask=offs < K)


@triton.jit
def saturate_f16(v):
    """v as fp16, values beyond its range held at +-65504 (not inf: a bf16 activation may exceed it)."""
    return tl.minimum(tl.maximum(v.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def pair_position(n):
    """Where input n of a row sits in pair order (`pair_order`): 8j + m goes to 8j + m // 2 + 4 (m % 2)."""
    return (n // 8) * 8 + (n % 8) // 2 + 4 * (n % 2)
