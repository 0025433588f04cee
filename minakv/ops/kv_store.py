"""Rotate and store: RoPE on a forward's new q and k, and their K/V written into the paged pool.

Every attention layer of every forward starts the same way: rotate q and k at the tokens' positions,
then put k and v into the tokens' slots, where the attention kernels read them (a token's own key
included). In torch that is a dozen elementwise kernels plus two scatters per layer; the kernel does it
in one launch, one program per token: q is written rotated to a new tensor, k (rotated) and v go
straight to their slots.

Rotation is the NeoX half split of minakv/ops/rope.py: for d < R/2 (R the rotary dims)
    out[d] = x[d] cos[d] - x[d + R/2] sin[d],   out[d + R/2] = x[d + R/2] cos[d] + x[d] sin[d],
in fp32, dims from R on unchanged. cos/sin ([T, R/2], fp32, amplitude included) come from the caller,
which computes them once per forward for all layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.rope import apply_rope
from minakv.ops.triton_util import check, pdl_options, use_triton


def rotate_and_store(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, R/2] float32
    sin: torch.Tensor,  # [T, R/2] float32
    slots: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [S, Hkv, D], one layer of the pool
    v_cache: torch.Tensor,  # [S, Hkv, D]
) -> torch.Tensor:
    """Store rotated k and v at `slots`; return q rotated [T, Hq, D]. Triton on CUDA, torch otherwise."""
    fn = rotate_and_store_triton if use_triton(q) else rotate_and_store_ref
    return fn(q, k, v, cos, sin, slots, k_cache, v_cache)


def rotate_and_store_ref(q, k, v, cos, sin, slots, k_cache, v_cache) -> torch.Tensor:
    num_heads = q.shape[1]
    qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # one rotation pass for q and k
    k_cache[slots] = qk[:, num_heads:].to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return qk[:, :num_heads]


def rotate_and_store_triton(q, k, v, cos, sin, slots, k_cache, v_cache) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[1]
    check(k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), "k and v must be [T, Hkv, D] like q")
    check(k_cache.shape[1:] == (num_kv_heads, head_dim), f"k_cache is {tuple(k_cache.shape)}")
    check(2 * half <= head_dim and cos.shape == sin.shape == (num_tokens, half), "cos/sin must be [T, R/2]")
    check(slots.shape == (num_tokens,), "one slot per token")
    for t in (q, k, v, k_cache, v_cache):
        check(t.stride(-1) == 1, "the last dim must be contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty_like(q)
    if num_tokens:
        _rotate_and_store_kernel[(num_tokens,)](
            q, k, v, cos, sin, slots, k_cache, v_cache, q_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            q_out.stride(0), q_out.stride(1), half, head_dim,
            HQ_PAD=triton.next_power_of_2(num_heads), HKV_PAD=triton.next_power_of_2(num_kv_heads),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D_PAD=triton.next_power_of_2(head_dim),
            num_warps=4, **pdl_options(),
        )  # fmt: skip
    return q_out


@triton.jit
def _rotate(x_ptr, stride_h, cos, sin, partner_off, sign, rotated,
            H_PAD: tl.constexpr, D_PAD: tl.constexpr, NUM: tl.constexpr, D):  # fmt: skip
    """The NUM heads of one token as rows [H_PAD, D_PAD], rotated, in fp32; and the mask of real ones."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    ok = (offs_h[:, None] < NUM) & (offs_d[None, :] < D)
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(ptrs + partner_off[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
    return tl.where(rotated[None, :], x * cos[None, :] + sign[None, :] * partner * sin[None, :], x), ok


@triton.jit
def _rotate_and_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr, qo_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_qot, stride_qoh, half, D,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    D_PAD: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    if (
        USE_GDC
    ):  # (triton_util.PDL) q, k, v are the projection's output; the pool is read by the kernels before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_d = tl.arange(0, D_PAD)
    rotated = offs_d < 2 * half
    first = offs_d < half
    freq = tl.where(first, offs_d, offs_d - half)  # the (token, frequency) each dim rotates with
    cos = tl.load(cos_ptr + t * half + freq, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + t * half + freq, mask=rotated, other=0.0)
    partner_off = tl.where(first, half, -half)
    sign = tl.where(first, -1.0, 1.0)

    q, q_ok = _rotate(q_ptr + t * stride_qt, stride_qh, cos, sin, partner_off, sign, rotated,
                      HQ_PAD, D_PAD, NUM_HEADS, D)  # fmt: skip
    offs_hq = tl.arange(0, HQ_PAD)
    qo = qo_ptr + t * stride_qot + offs_hq[:, None] * stride_qoh + offs_d[None, :]
    tl.store(qo, q.to(qo_ptr.dtype.element_ty), mask=q_ok)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    k, kv_ok = _rotate(k_ptr + t * stride_kt, stride_kh, cos, sin, partner_off, sign, rotated,
                       HKV_PAD, D_PAD, NUM_KV_HEADS, D)  # fmt: skip
    offs_hk = tl.arange(0, HKV_PAD)
    kc = kc_ptr + slot * stride_kcs + offs_hk[:, None] * stride_kch + offs_d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=kv_ok)
    v = tl.load(v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=kv_ok)
    vc = vc_ptr + slot * stride_vcs + offs_hk[:, None] * stride_vch + offs_d[None, :]
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=kv_ok)
