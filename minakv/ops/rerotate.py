"""Re-rotation copy: move cached keys to new positions without recomputing them.

`reposition` gives surviving keys new positions. Keys are stored rotated at their current position, so
each moved key is copied from its source slot to a fresh destination slot (in every layer) and re-rotated
from its old to its new position; values are copied unchanged:

    k_cache[l, dst[i]] = rerotate(k_cache[l, src[i]], rope(old_pos[i]) -> rope(new_pos[i]))
    v_cache[l, dst[i]] = v_cache[l, src[i]]

The rotation is undone exactly in fp32 (dividing by cos^2 + sin^2, so YaRN's amplitude does not change
the key's norm), only the first `rotary_dim` dims rotate, and a key whose position does not change is
copied bit for bit. The Triton kernel does all layers in one launch; the cos/sin tables (one row per
moved token) are computed once by `Rope.cos_sin`, exactly as for the torch reference.

Destination slots must be distinct and must not be the source of another moved token (the kernel reads
and writes in parallel); a token may be re-rotated in place (dst == src).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.rope import Rope, rerotate
from minakv.ops.triton_util import check, lazy_jit, use_triton


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
    block_t: int = 8,
    num_warps: int = 4,
) -> None:
    """The Triton kernel: grid (token blocks, layers); the keyword-only knobs are for benchmarks."""
    _check_inputs(k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos, rope)
    num_layers, _, num_kv_heads, head_dim = k_cache.shape
    n = src_slots.shape[0]
    if n == 0:
        return
    cos_old, sin_old = rope.cos_sin(old_pos)
    cos_new, sin_new = rope.cos_sin(new_pos)
    row = num_kv_heads * head_dim
    _rerotate_kernel[(triton.cdiv(n, block_t), num_layers)](
        k_cache, v_cache, src_slots, dst_slots, old_pos, new_pos,
        cos_old.contiguous(), sin_old.contiguous(), cos_new.contiguous(), sin_new.contiguous(), n,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), D=head_dim, HALF=rope.rotary_dim // 2,
        BLOCK_T=block_t, num_warps=num_warps,
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
    check(rope.rotary_dim <= k_cache.shape[3], f"rotary_dim {rope.rotary_dim} > head_dim {k_cache.shape[3]}")


@lazy_jit
def _rerotate_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr, old_pos_ptr, new_pos_ptr, cos_old_ptr, sin_old_ptr, cos_new_ptr,
    sin_new_ptr, n, stride_kl, stride_ks, stride_vl, stride_vs,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    layer = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n
    src = tl.load(src_ptr + t, mask=t_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + t, mask=t_ok, other=0).to(tl.int64)
    same = tl.load(old_pos_ptr + t, mask=t_ok, other=0) == tl.load(new_pos_ptr + t, mask=t_ok, other=0)

    # One slot row holds all KV heads: element e is dim d = e % D of its head. Rotated dims pair up
    # as (i, i + HALF); `sign` makes one formula serve both halves of a pair.
    e = tl.arange(0, ROW_PAD)
    e_ok = e < ROW
    d = e % D
    first = d < HALF
    rot = (d < 2 * HALF) & e_ok
    partner = tl.where(first, e + HALF, tl.where(rot, e - HALF, e))
    freq = tl.where(first, d, d - HALF)
    sign = tl.where(first, 1.0, -1.0)
    mask = t_ok[:, None] & e_ok[None, :]
    rot_mask = t_ok[:, None] & rot[None, :]

    k_src = k_ptr + layer * stride_kl + src[:, None] * stride_ks
    x_raw = tl.load(k_src + e[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    y = tl.load(k_src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    tab = t[:, None] * HALF + freq[None, :]
    oc = tl.load(cos_old_ptr + tab, mask=rot_mask, other=1.0)
    so = tl.load(sin_old_ptr + tab, mask=rot_mask, other=0.0) * sign[None, :]
    nc = tl.load(cos_new_ptr + tab, mask=rot_mask, other=1.0)
    ns = tl.load(sin_new_ptr + tab, mask=rot_mask, other=0.0) * sign[None, :]
    norm = oc * oc + so * so
    x_self = (x * oc + y * so) / norm  # this dim of the un-rotated key
    x_partner = (y * oc - x * so) / norm  # its pair's
    out = (x_self * nc - x_partner * ns).to(x_raw.dtype)
    out = tl.where(same[:, None] | (~rot)[None, :], x_raw, out)  # exact copy: unmoved key, pass-through dims
    tl.store(k_ptr + layer * stride_kl + dst[:, None] * stride_ks + e[None, :], out, mask=mask)

    v = tl.load(v_ptr + layer * stride_vl + src[:, None] * stride_vs + e[None, :], mask=mask, other=0.0)
    tl.store(v_ptr + layer * stride_vl + dst[:, None] * stride_vs + e[None, :], v, mask=mask)


__all__ = ["rerotate_copy", "rerotate_copy_ref", "rerotate_copy_triton"]
