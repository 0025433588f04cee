"""Random MXFP4 MoE layers and their float64 reference, for the MXFP4 kernel tests."""

from __future__ import annotations

import torch

from helpers.models import moe_reference
from minakv.ops.moe import route_softmax_topk
from minakv.ops.mxfp4_layout import tile_rows
from minakv.ops.quant import dequantize_mxfp4, quantize_mxfp4

LIMIT, ALPHA = 1.0, 1.702  # a small limit so the clamps of swiglu_oai bite


def packed(e: int, out: int, inp: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights [e, out, inp] quantized to MXFP4, group magnitudes spread over a few octaves."""
    w = torch.randn(e, out, inp, generator=gen) * torch.exp2(torch.randint(-4, 1, (e, out, 1), generator=gen))
    return quantize_mxfp4(w)


def case(activation: str, t: int, e: int = 4, h: int = 64, i: int = 64, k: int = 2, seed: int = 0,
         biases: bool = True):  # fmt: skip
    """Inputs of moe_mxfp4 (the packed weights in tiles, as the model holds them: mxfp4_layout.py), and the
    float64 reference output on the dequantized weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w = {}
    w["gate_up_blocks"], w["gate_up_scales"] = packed(e, 2 * i, h, gen)
    w["down_blocks"], w["down_scales"] = packed(e, h, i, gen)
    gate_up_bias = torch.randn(e, 2 * i, generator=gen) if biases else None
    down_bias = torch.randn(e, h, generator=gen) if biases else None
    weights, ids = route_softmax_topk(torch.randn(t, e, generator=gen), k)
    args = [x, tile_rows(w), weights, ids, gate_up_bias, down_bias, activation, LIMIT, ALPHA]
    gate_up = dequantize_mxfp4(w["gate_up_blocks"], w["gate_up_scales"])  # of the rows quantize_mxfp4 wrote
    down = dequantize_mxfp4(w["down_blocks"], w["down_scales"])
    ref = moe_reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation, LIMIT, ALPHA)
    return args, ref


def assert_matches(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
