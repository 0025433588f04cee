"""RMSNorm: a torch reference and a one-launch Triton kernel for CUDA.

Both families normalise in fp32, but they differ in *where* the weight is applied: GPT-OSS multiplies by
the (fp32) weight before casting back to the input dtype; MiniMax-M2 (Llama style) casts back first and
then multiplies. In fp32 the two are identical; in bf16 they round differently, so the flag matters for
matching transformers bit for bit.

The torch form is seven elementwise and reduction kernels per call; a decode step calls it twice per
layer, so on the GPU those launches cost more than the bytes (a few KB per token). The kernel does the
same arithmetic, one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import check, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True) -> torch.Tensor:
    """Normalise x [..., D] over its last dim and scale by weight [D]; returns x's dtype."""
    fn = rms_norm_triton if use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, weight_in_fp32)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True
) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * xf).to(x.dtype)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True
) -> torch.Tensor:
    size = x.shape[-1]
    check(weight.shape == (size,), f"weight is {tuple(weight.shape)}, expected ({size},)")
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(size)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, size, rows.stride(0), float(eps),
            BLOCK=block, WEIGHT_IN_FP32=weight_in_fp32, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, size, stride, eps, BLOCK: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < size
    x = tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / size + eps)
    out_ty = out_ptr.dtype.element_ty
    if WEIGHT_IN_FP32:
        y = w.to(tl.float32) * normed
    else:  # round to the output dtype first, then multiply in it (as a bf16 tensor product does)
        y = w.to(out_ty).to(tl.float32) * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * size + offs, y.to(out_ty), mask=ok)
