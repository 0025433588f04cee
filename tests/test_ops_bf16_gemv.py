"""The one-row bf16 GEMV (minakv/ops/bf16_gemv.py) against a float64 reference, in Triton's CPU interpreter:
strips that end inside the weight (N not a multiple of BN), steps past K, with and without the bias."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.bf16_gemv import linear_gemv


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
