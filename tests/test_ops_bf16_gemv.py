"""The one-row bf16 GEMV (minakv/ops/bf16_gemv.py) against a float64 reference, in Triton's CPU interpreter:
strips that end inside the weight (N not a multiple of BN), steps past K, with and without the bias."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.bf16_gemv import linear, linear_gemv

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@interpreted
@pytest.mark.parametrize("out,inp", [(100, 72), (257, 200), (64, 1024)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "config", [{}, {"block_n": 4, "groups": 16}, {"block_n": 16, "groups": 2, "num_warps": 1}]
)
def test_linear_gemv_matches_reference(out: int, inp: int, bias: bool, config: dict) -> None:
    gen = torch.Generator().manual_seed(out + inp)
    weight = torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(1, inp, generator=gen)
    ref = torch.nn.functional.linear(x.double(), weight.double(), b.double() if bias else None)
    y = linear_gemv(x, weight, b, **config)
    assert y.shape == (1, out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@interpreted
def test_linear_gemv_rows_and_bf16() -> None:
    """Two rows (a program per row and strip), bf16 weights and inputs: within bf16's rounding of the output."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 160, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 3, 160, generator=gen).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.double(), weight.double())
    y = linear_gemv(x, weight)
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_linear_leaves_what_it_does_not_take_to_torch() -> None:
    """`linear` (what the model's projections call): on the CPU, and for float32 or several rows, exactly
    F.linear."""
    gen = torch.Generator().manual_seed(1)
    weight, b = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    for x in (torch.randn(1, 64, generator=gen), torch.randn(3, 64, generator=gen)):
        assert torch.equal(linear(x, weight, b), torch.nn.functional.linear(x, weight, b))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out,inp", [(5120, 2880), (2880, 4096)])  # gpt-oss's q/k/v (fused) and o_proj
def test_linear_real_shapes_gpu(out: int, inp: int) -> None:
    """One bf16 row at gpt-oss's attention shapes takes the GEMV: against float64, within what cuBLAS's bf16
    output on the same inputs reaches; several rows go to cuBLAS unchanged."""
    gen = torch.Generator("cuda").manual_seed(out)
    weight = (torch.randn(out, inp, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(out, generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, inp, generator=gen, device="cuda").to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.double(), weight.double(), b.double())
    ours, cublas = linear(x[:1], weight, b), torch.nn.functional.linear(x[:1], weight, b)
    assert not torch.equal(ours, cublas)  # (a different summation order: the GEMV ran)
    err = float((ours.double() - ref[:1]).norm() / ref[:1].norm())
    bar = float((cublas.double() - ref[:1]).norm() / ref[:1].norm())
    assert err < 2 * bar + 1e-4, (err, bar)
    assert torch.equal(linear(x, weight, b), torch.nn.functional.linear(x, weight, b))
