"""RMSNorm: a torch reference and a one-launch Triton kernel for CUDA.

Both families normalise in fp32, but they differ in *where* the weight is applied: GPT-OSS multiplies by
the (fp32) weight before casting back to the input dtype; MiniMax-M2 (Llama style) casts back first and
then multiplies. In fp32 the two are identical; in bf16 they round differently, so the flag matters for
matching transformers bit for bit.

The torch form is seven elementwise and reduction kernels per call; a decode step calls it twice per
layer, so on the GPU those launches cost more than the bytes (a few KB per token). The kernel does the
same arithmetic, one program per row (`rms_norm_two`: per row of each of two tensors, MiniMax-M2's q and k
norms in one launch). `add_rms_norm` also takes the residual add before it (x + update, then the norm of
that), so a layer's two adds cost no launch of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import check, pdl_options, use_triton


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
    return rms_norm_two_triton(x, weight, None, None, eps, weight_in_fp32)[0]


def rms_norm_two(
    a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor, eps: float,
    weight_in_fp32: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(a, weight_a), rms_norm(b, weight_b)) for a and b of the same rows, in one launch on the GPU
    (MiniMax-M2's q and k norms: one kernel a layer fewer at decode)."""
    if use_triton(a):
        return rms_norm_two_triton(a, weight_a, b, weight_b, eps, weight_in_fp32)
    return rms_norm_ref(a, weight_a, eps, weight_in_fp32), rms_norm_ref(b, weight_b, eps, weight_in_fp32)


def rms_norm_two_triton(a, weight_a, b, weight_b, eps, weight_in_fp32=True) -> tuple[torch.Tensor, ...]:
    """The kernel for one tensor (b None) or two: a program per (row, tensor)."""
    ins = [(a, weight_a)] + ([(b, weight_b)] if b is not None else [])
    rows, outs = [], []
    for x, weight in ins:
        size = x.shape[-1]
        check(weight.shape == (size,), f"weight is {tuple(weight.shape)}, expected ({size},)")
        r = x.reshape(-1, size)
        rows.append(r if r.stride(-1) == 1 else r.contiguous())
        outs.append(torch.empty(rows[-1].shape, dtype=x.dtype, device=x.device))
    check(
        len(ins) == 1 or (b.dtype == a.dtype and rows[1].shape[0] == rows[0].shape[0]), "a and b: same rows"
    )
    if rows[0].shape[0]:
        block = triton.next_power_of_2(max(r.shape[1] for r in rows))
        second = (rows[-1], ins[-1][1], outs[-1], rows[-1].shape[1], rows[-1].stride(0))
        _rms_norm_kernel[(rows[0].shape[0], len(ins))](
            rows[0], ins[0][1], outs[0], rows[0].shape[1], rows[0].stride(0), *second, float(eps),
            BLOCK=block, WEIGHT_IN_FP32=weight_in_fp32, num_warps=min(16, max(1, block // 256)),
            **pdl_options(),
        )  # fmt: skip
    return tuple(out.view(x.shape) for out, (x, _) in zip(outs, ins))


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, size, stride, x2_ptr, w2_ptr, out2_ptr, size2, stride2, eps,
    BLOCK: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """Row program_id(0) of x (program_id(1) == 0) or of x2 (== 1), each with its own weight and size."""
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        x_ptr, w_ptr, out_ptr, size, stride = x2_ptr, w2_ptr, out2_ptr, size2, stride2
    offs = tl.arange(0, BLOCK)
    ok = offs < size
    if USE_GDC:  # (triton_util.PDL) the kernel before may still be writing x
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    y = _normalize(x, w_ptr, offs, ok, size, eps, out_ptr.dtype.element_ty, WEIGHT_IN_FP32)
    tl.store(out_ptr + row * size + offs, y, mask=ok)


@triton.jit
def _normalize(x, w_ptr, offs, ok, size, eps, out_ty: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr):
    """One fp32 row x -> weight * x / rms(x) in out_ty, the weight applied as the family does."""
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / size + eps)
    if WEIGHT_IN_FP32:
        y = w.to(tl.float32) * normed
    else:  # round to the output dtype first, then multiply in it (as a bf16 tensor product does)
        y = w.to(out_ty).to(tl.float32) * normed.to(out_ty).to(tl.float32)
    return y.to(out_ty)


def add_rms_norm(
    x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's step and the next norm in one pass: (s, rms_norm(s)) with s = x + update in x's
    dtype. Fused, the sum is rounded to x's dtype before it is normalised, exactly as the two ops apart.

    `update` may also come as k fp32 parts [..., k, D] (a MoE block's per-expert outputs, already
    weighted): they are summed in fp32 and rounded to x's dtype first, as the MoE would have returned
    them, so the block's own sum and cast cost no launches."""
    fn = add_rms_norm_triton if use_triton(x) else add_rms_norm_ref
    return fn(x, update, weight, eps, weight_in_fp32)


def add_rms_norm_ref(x, update, weight, eps, weight_in_fp32=True) -> tuple[torch.Tensor, torch.Tensor]:
    if update.dim() == x.dim() + 1:
        update = update.float().sum(-2).to(x.dtype)
    total = x + update
    return total, rms_norm_ref(total, weight, eps, weight_in_fp32)


def add_rms_norm_triton(x, update, weight, eps, weight_in_fp32=True) -> tuple[torch.Tensor, torch.Tensor]:
    size = x.shape[-1]
    check(weight.shape == (size,), f"weight is {tuple(weight.shape)}, expected ({size},)")
    parts = update.dim() == x.dim() + 1
    k = update.shape[-2] if parts else 1
    expected = (*x.shape[:-1], k, size) if parts else x.shape
    check(update.shape == expected, f"update is {tuple(update.shape)}, x {tuple(x.shape)}")
    rows, adds = x.reshape(-1, size), update.reshape(-1, k * size)
    if rows.stride(-1) != 1 or adds.stride(-1) != 1 or (parts and not update.is_contiguous()):
        rows, adds = rows.contiguous(), update.contiguous().reshape(-1, k * size)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(size)
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, adds, weight, total, out, size, rows.stride(0), adds.stride(0), float(eps), k,
            BLOCK=block, WEIGHT_IN_FP32=weight_in_fp32, num_warps=min(16, max(1, block // 256)),
            **pdl_options(),
        )  # fmt: skip
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, a_ptr, w_ptr, total_ptr, out_ptr, size, stride_x, stride_a, eps, k,
    BLOCK: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < size
    out_ty = out_ptr.dtype.element_ty
    if USE_GDC:  # (triton_util.PDL) the kernel before may still be writing x or the update
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + offs, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, k):  # k parts: their fp32 sum, rounded to the stream's dtype like the MoE's output
        a += tl.load(a_ptr + row * stride_a + j * size + offs, mask=ok, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if k > 1:
        a = a.to(out_ty).to(tl.float32)
    s = (x + a).to(out_ty)  # the residual stream keeps x's dtype, as `x + update` does
    tl.store(total_ptr + row * size + offs, s, mask=ok)
    y = _normalize(s.to(tl.float32), w_ptr, offs, ok, size, eps, out_ty, WEIGHT_IN_FP32)
    tl.store(out_ptr + row * size + offs, y, mask=ok)
