"""Re-rotation copy: move cached keys to new positions without recomputing them.

`reposition` gives surviving keys new positions. Keys are stored rotated at their current position, so
each moved key is copied from its source slot to a fresh destination slot (in every layer) and re-rotated
from its old to its new position; values are copied unchanged:

    k_cache[l, dst[i]] = rerotate(k_cache[l, src[i]], rope(old_pos[i]) -> rope(new_pos[i]))
    v_cache[l, dst[i]] = v_cache[l, src[i]]

The rotation is undone exactly in fp32 (dividing by cos^2 + sin^2, so YaRN's amplitude does not change
the key's norm), only the first `rotary_dim` dims rotate, and a key whose position does not change is
copied bit for bit. The Triton kernel does all layers in one launch: a program takes a block of tokens,
composes undo and apply into one rotation per (token, frequency) and uses it for every layer and head
(two divisions per element would make this memory-bound copy compute-bound). The cos/sin tables, one
row per moved token, use the arithmetic of `Rope.cos_sin`, as the torch reference does.

Destination slots must be distinct and must not be the source of another moved token (the kernel reads
and writes in parallel); a token may be re-rotated in place (dst == src).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.rope import Rope, rerotate
from minakv.ops.triton_util import check, use_triton


def rerotate_copy(
    k_cache: torch.Tensor,  # [L, S, Hkv, D]
    v_cache: torch.Tensor,  # [L, S, Hkv, D]
    src_slots: torch.Tensor,  # [N]
    dst_slots: torch.Tensor,  # [N]
    old_pos: torch.Tensor,  # [N]
    new_pos: torch.Tensor,  # [N]
    rope: Rope,
) -> None:
    """Copy-and-re-rotate in place in the caches: Triton on CUDA tensors, the torch reference otherwise."""
    fn = rerotate_copy_triton if use_triton(k_cache) else rerotate_copy_ref
    fn(k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, rope)


def rerotate_copy_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    rope: Rope,
) -> None:
    """Torch reference: `minakv.ops.rope.rerotate` layer by layer."""
    _check_inputs(k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, rope)
    old, new = rope.cos_sin(old_pos), rope.cos_sin(new_pos)
    src, dst = src_slots.long(), dst_slots.long()
    for layer in range(k_cache.shape[0]):
        k_cache[layer, dst] = rerotate(k_cache[layer, src], old, new)
        v_cache[layer, dst] = v_cache[layer, src]


def rerotate_copy_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    rope: Rope,
    *,
    block_t: int = 4,
    num_warps: int = 4,
) -> None:
    """The Triton kernel: one program per block of tokens walks all layers; knobs are for benchmarks."""
    _check_inputs(k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, rope)
    num_layers, _, num_kv_heads, head_dim = k_cache.shape
    n = src_slots.shape[0]
    if n == 0:
        return
    cos_old, sin_old = rope.cos_sin(old_pos)
    cos_new, sin_new = rope.cos_sin(new_pos)
    half = rope.rotary_dim // 2
    rest = head_dim - 2 * half
    _rerotate_kernel[(triton.cdiv(n, block_t),)](
        k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, cos_old, sin_old, cos_new, sin_new, n,
        num_layers, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads), D=head_dim, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), REST_PAD=triton.next_power_of_2(rest) if rest else 0,
        ROW_PAD=triton.next_power_of_2(num_kv_heads * head_dim), BLOCK_T=block_t, num_warps=num_warps,
    )  # fmt: skip


def _check_inputs(k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, rope) -> None:
    check(
        k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache, v_cache must both be [L, S, Hkv, D]"
    )
    check(k_cache.stride(3) == 1 and k_cache.stride(2) == k_cache.shape[3], "cache slots must be contiguous")
    check(v_cache.stride(3) == 1 and v_cache.stride(2) == v_cache.shape[3], "cache slots must be contiguous")
    n = src_slots.shape
    check(
        len(n) == 1 and dst_slots.shape == old_pos.shape == new_pos.shape == n, "slots/positions must be [N]"
    )
    check(rope.rotary_dim % 2 == 0, f"rotary_dim must be even, got {rope.rotary_dim}")
    check(rope.rotary_dim <= k_cache.shape[3], f"rotary_dim {rope.rotary_dim} > head_dim {k_cache.shape[3]}")


@triton.jit
def _rerotate_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr, old_pos_ptr, new_pos_ptr, cos_old_ptr, sin_old_ptr, cos_new_ptr,
    sin_new_ptr, n, num_layers, stride_kl, stride_ks, stride_vl, stride_vs,
    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr, ROW_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n
    src = tl.load(src_ptr + t, mask=t_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + t, mask=t_ok, other=0).to(tl.int64)
    keep = (tl.load(old_pos_ptr + t, mask=t_ok, other=0) == tl.load(new_pos_ptr + t, mask=t_ok, other=0))[
        :, None, None
    ]  # unmoved key: exact copy

    # Undo-then-apply is one rotation per (token, frequency), the same in every layer and head: with
    # norm = oc^2 + os^2 (YaRN's amplitude squared, divided out once here),
    #   out1 = a*y1 + b*y2, out2 = a*y2 - b*y1,  a = (oc*nc + os*ns)/norm, b = (os*nc - oc*ns)/norm.
    i = tl.arange(0, HALF_PAD)
    tab = t[:, None] * HALF + i[None, :]
    tab_ok = t_ok[:, None] & (i < HALF)[None, :]
    oc = tl.load(cos_old_ptr + tab, mask=tab_ok, other=1.0)
    os_ = tl.load(sin_old_ptr + tab, mask=tab_ok, other=0.0)
    nc = tl.load(cos_new_ptr + tab, mask=tab_ok, other=1.0)
    ns = tl.load(sin_new_ptr + tab, mask=tab_ok, other=0.0)
    inv_norm = 1.0 / (oc * oc + os_ * os_)
    a = ((oc * nc + os_ * ns) * inv_norm)[:, None, :]
    b = ((os_ * nc - oc * ns) * inv_norm)[:, None, :]

    # K tiles are [tokens, heads, dims]: the two rotated halves (i, HALF + i) of every head are two
    # tiles; V is the whole slot row (all heads), copied unchanged.
    h = tl.arange(0, H_PAD)
    ok = t_ok[:, None, None] & (h < H)[None, :, None] & (i < HALF)[None, None, :]
    k_src = k_ptr + src[:, None, None] * stride_ks + h[None, :, None] * D + i[None, None, :]
    k_dst = k_ptr + dst[:, None, None] * stride_ks + h[None, :, None] * D + i[None, None, :]
    e = tl.arange(0, ROW_PAD)
    row_ok = t_ok[:, None] & (e < H * D)[None, :]
    v_src = v_ptr + src[:, None] * stride_vs + e[None, :]
    v_dst = v_ptr + dst[:, None] * stride_vs + e[None, :]
    if REST_PAD > 0:  # partial rotary: dims past 2 * HALF pass through
        r = tl.arange(0, REST_PAD)
        rest_ok = t_ok[:, None, None] & (h < H)[None, :, None] & (r < D - 2 * HALF)[None, None, :]
        rest_off = h[None, :, None] * D + 2 * HALF + r[None, None, :]
        rest_src = k_ptr + src[:, None, None] * stride_ks + rest_off
        rest_dst = k_ptr + dst[:, None, None] * stride_ks + rest_off
    for _ in range(num_layers):  # pointers step by one layer (64-bit pointer arithmetic, no overflow)
        v = tl.load(v_src, mask=row_ok)
        y1_raw = tl.load(k_src, mask=ok, other=0.0)
        y2_raw = tl.load(k_src + HALF, mask=ok, other=0.0)
        y1, y2 = y1_raw.to(tl.float32), y2_raw.to(tl.float32)
        tl.store(k_dst, tl.where(keep, y1_raw, (a * y1 + b * y2).to(y1_raw.dtype)), mask=ok)
        tl.store(k_dst + HALF, tl.where(keep, y2_raw, (a * y2 - b * y1).to(y2_raw.dtype)), mask=ok)
        tl.store(v_dst, v, mask=row_ok)
        if REST_PAD > 0:
            tl.store(rest_dst, tl.load(rest_src, mask=rest_ok), mask=rest_ok)
            rest_src += stride_kl
            rest_dst += stride_kl
        k_src += stride_kl
        k_dst += stride_kl
        v_src += stride_vl
        v_dst += stride_vl


__all__ = ["rerotate_copy", "rerotate_copy_ref", "rerotate_copy_triton"]
