"""Rotate-and-store and RMSNorm kernels (run by Triton's CPU interpreter) against float64 references:
full and partial rotary, GQA ratios 1 and 8, head counts and sizes that are not powers of two; K and V
land in their slots and no other slot changes. RMSNorm: both weight placements, rows of odd sizes.

bf16 outputs are compared within one bf16 step: the interpreter converts fp32 to bf16 by truncation
(the GPU rounds to nearest), so only fp32 is compared tightly here; the GPU run compares both."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.kv_store import rotate_and_store, rotate_and_store_ref, rotate_and_store_triton
from minakv.ops.norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from minakv.ops.rope import Rope

BF16_STEP = 2.0**-7  # relative spacing of bf16 numbers (8 significant bits)


def rotate_float64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2, rest = x[..., :half].double(), x[..., half : 2 * half].double(), x[..., 2 * half :].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(ours.double(), ref, rtol=2 * BF16_STEP, atol=1e-3)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rotary_dim",
    [(8, 1, 32, 32), (4, 4, 32, 16), (6, 2, 24, 24), (3, 1, 48, 16)],  # GQA 8 and 1, partial, odd sizes
)
def test_rotate_and_store_matches_float64(num_heads, num_kv_heads, head_dim, rotary_dim, dtype) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    tokens, num_slots = 9, 40
    q, k, v = (
        torch.randn(tokens, h, head_dim, generator=gen).to(dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    cos, sin = Rope(rotary_dim, 10000.0).cos_sin(torch.randint(0, 50_000, (tokens,), generator=gen))
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q_out = rotate_and_store_triton(q, k, v, cos, sin, slots, k_cache, v_cache)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    assert_close(q_out, rotate_float64(q, cos, sin), dtype)
    assert_close(k_cache[slots], rotate_float64(k, cos, sin), dtype)
    assert torch.equal(v_cache[slots], v)
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_cache[others], k0[others]) and torch.equal(v_cache[others], v0[others])
    if dtype == torch.float32:  # the torch reference is the CPU path: same numbers
        kr, vr = k0.clone(), v0.clone()
        torch.testing.assert_close(rotate_and_store_ref(q, k, v, cos, sin, slots, kr, vr), q_out)
        torch.testing.assert_close(kr, k_cache)
        assert torch.equal(vr, v_cache)


def test_rotate_and_store_dispatch_on_cpu_is_the_reference() -> None:
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    cos, sin = Rope(8, 10000.0).cos_sin(torch.tensor([3, 7]))
    caches = [torch.zeros(4, 1, 8) for _ in range(4)]
    a = rotate_and_store(q, k, v, cos, sin, torch.tensor([2, 0]), caches[0], caches[1])
    b = rotate_and_store_ref(q, k, v, cos, sin, torch.tensor([2, 0]), caches[2], caches[3])
    assert torch.equal(a, b) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("size", [64, 90])
def test_rms_norm_kernel_matches_float64(size: int, weight_in_fp32: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(size)
    x = (torch.randn(5, 3, size, generator=gen) * 3).to(dtype)
    weight = 1 + torch.randn(size, generator=gen)
    if not weight_in_fp32:
        weight = weight.to(dtype)
    xd = x.double()
    ref = weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    ours = rms_norm_triton(x, weight, 1e-5, weight_in_fp32)
    assert ours.dtype == dtype and ours.shape == x.shape
    step = 2 * BF16_STEP if dtype == torch.bfloat16 and not weight_in_fp32 else 0  # two roundings there
    assert_close_rel(ours, ref, dtype, step)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, rms_norm_ref(x, weight, 1e-5, weight_in_fp32))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_add_rms_norm_kernel_is_the_add_then_the_norm(weight_in_fp32: bool, dtype: torch.dtype) -> None:
    """Fused, the sum is rounded to x's dtype before the norm, exactly as `x + update` then `rms_norm`."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 90, generator=gen) * 3).to(dtype)
    update = torch.randn(4, 90, generator=gen).to(dtype)
    weight = 1 + torch.randn(90, generator=gen)
    weight = weight if weight_in_fp32 else weight.to(dtype)
    total, normed = add_rms_norm_triton(x, update, weight, 1e-5, weight_in_fp32)
    ref_total, _ = add_rms_norm_ref(x, update, weight, 1e-5, weight_in_fp32)
    assert total.dtype == normed.dtype == dtype
    if dtype == torch.float32:  # exact: the same sum, then the same norm kernel
        assert torch.equal(total, ref_total)
        assert torch.equal(normed, rms_norm_triton(ref_total, weight, 1e-5, weight_in_fp32))
    else:  # the interpreter's fp32 -> bf16 cast may round the other way (the GPU rounds to nearest)
        torch.testing.assert_close(total, ref_total, rtol=BF16_STEP, atol=0)
    td = total.double()
    ref = weight.double() * td * torch.rsqrt(td.pow(2).mean(-1, keepdim=True) + 1e-5)
    step = 2 * BF16_STEP if dtype == torch.bfloat16 and not weight_in_fp32 else 0
    assert_close_rel(normed, ref, dtype, step)


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, extra: float) -> None:
    rtol = 1e-6 if dtype == torch.float32 else 2 * BF16_STEP + extra
    torch.testing.assert_close(ours.double(), ref, rtol=rtol, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_cuda(dtype: torch.dtype) -> None:
    """Compiled, at gpt-oss-20b's attention shape (64 / 8 heads of 64) and MiniMax-M2's (48 / 8 of 128,
    half rotary): within one bf16 step of float64, RMSNorm over 2880, and MiniMax-M2's q and k norms."""
    for num_heads, num_kv_heads, head_dim, rotary_dim in [(64, 8, 64, 64), (48, 8, 128, 64)]:
        gen = torch.Generator(device="cuda").manual_seed(head_dim)
        tokens, num_slots = 300, 1000
        q, k, v = (
            torch.randn(tokens, h, head_dim, generator=gen, device="cuda").to(dtype)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )
        cos, sin = Rope(rotary_dim, 10000.0).cos_sin(torch.randint(0, 50_000, (tokens,), device="cuda"))
        slots = torch.randperm(num_slots, device="cuda")[:tokens]
        k_cache = torch.zeros(num_slots, num_kv_heads, head_dim, device="cuda", dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q_out = rotate_and_store(q, k, v, cos, sin, slots, k_cache, v_cache)
        rtol = 1e-6 if dtype == torch.float32 else BF16_STEP
        for ours, ref in [
            (q_out, rotate_float64(q, cos, sin)),
            (k_cache[slots], rotate_float64(k, cos, sin)),
        ]:
            torch.testing.assert_close(ours.double().cpu(), ref.cpu(), rtol=rtol, atol=1e-6)
        assert torch.equal(v_cache[slots], v)
    x = (torch.randn(77, 2880, device="cuda") * 3).to(dtype)
    weight = 1 + torch.randn(2880, device="cuda")
    xd = x.double()
    ref = weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(
        rms_norm_triton(x, weight, 1e-5, True).double(),
        ref,
        rtol=1e-5 if dtype == torch.float32 else BF16_STEP,
        atol=1e-5,
    )
    # MiniMax-M2's q and k norms in one launch, on views of its q/k/v product (weights in the model dtype)
    from minakv.ops.norm import rms_norm_two_triton

    q, k, _ = (torch.randn(5, 8192, device="cuda") * 3).to(dtype).split([6144, 1024, 1024], dim=-1)
    wq, wk = (
        (1 + torch.randn(6144, device="cuda")).to(dtype),
        (1 + torch.randn(1024, device="cuda")).to(dtype),
    )
    for ours, x, w in zip(rms_norm_two_triton(q, wq, k, wk, 1e-6, False), (q, k), (wq, wk)):
        xd = x.double()
        ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
        rtol = 1e-5 if dtype == torch.float32 else 3 * BF16_STEP  # (bf16: the normed value rounded, then w x)
        torch.testing.assert_close(ours.double(), ref, rtol=rtol, atol=1e-5)


@interpreted
@pytest.mark.parametrize("weight_in_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_two_is_two_norms(weight_in_fp32: bool, dtype: torch.dtype) -> None:
    """rms_norm_two's kernel (MiniMax-M2's q and k norms, one launch) on strided views of one q/k/v
    product: each output against float64 as above, with its own weight and size (k's sums run over q's
    wider block, masked)."""
    from minakv.ops.norm import rms_norm_two_triton

    gen = torch.Generator().manual_seed(3)
    q, k, _ = (torch.randn(3, 96 + 2 * 40, generator=gen) * 4).to(dtype).split([96, 40, 40], dim=-1)
    wq, wk = 1 + torch.randn(96, generator=gen), 1 + torch.randn(40, generator=gen)
    wq, wk = (wq, wk) if weight_in_fp32 else (wq.to(dtype), wk.to(dtype))
    qn, kn = rms_norm_two_triton(q, wq, k, wk, 1e-6, weight_in_fp32)
    step = 2 * BF16_STEP if dtype == torch.bfloat16 and not weight_in_fp32 else 0
    for ours, x, w in ((qn, q, wq), (kn, k, wk)):
        xd = x.double()
        assert ours.shape == x.shape and ours.dtype == dtype
        assert_close_rel(
            ours, w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6), dtype, step
        )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_sums_moe_parts(dtype: torch.dtype) -> None:
    """A MoE block's k fp32 parts [T, k, D] are summed in fp32 and rounded to x's dtype before the add, as
    the block's own `sum(1).to(dtype)` would; the fused MoE's sum_k=False hands exactly those parts over."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 72, generator=gen) * 3).to(dtype)
    parts = torch.randn(3, 4, 72, generator=gen, dtype=torch.float64)
    weight = 1 + torch.randn(72, generator=gen)
    total, normed = add_rms_norm_triton(x, parts.float(), weight, 1e-5, True)
    update = parts.sum(1).to(dtype)  # the float64 sum, rounded as the MoE's output is
    ref_total = (x.double() + update.double()).to(dtype)
    if dtype == torch.float32:  # the kernel's fp32 sum of the parts is within an fp32 ulp of float64's
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-6)
    else:  # two roundings to bf16 (the sum, then x + it), each may go the other way in the interpreter
        bound = 2 * BF16_STEP * (x.double().abs() + update.double().abs())
        assert bool(((total.double() - ref_total.double()).abs() <= bound).all())
    td = total.double()
    ref = weight.double() * td * torch.rsqrt(td.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_close_rel(normed, ref, dtype, 0)
    with pytest.raises(ValueError, match="update is"):
        add_rms_norm_triton(x, parts.float()[:, :, :10], weight, 1e-5, True)
