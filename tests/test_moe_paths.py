"""The four MoE paths (per-expert loop, grouped GEMM, dense over all experts, fused Triton kernels) compute
the same function: each against the float64 one-token-one-expert reference, on CPU (F.grouped_mm has a CPU
kernel; the Triton kernels run interpreted), including experts that get no token and a single-token batch.
On CUDA they also run in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import moe_reference
from helpers.triton import interpreted

from minakv.ops.fused_moe import moe_fused
from minakv.ops.moe import moe_dense, moe_grouped, moe_loop, route_sigmoid_bias, route_softmax_topk

PATHS = {"loop": moe_loop, "grouped": moe_grouped, "dense": moe_dense}


def case(activation: str, t: int, e: int, k: int, seed: int, device: str = "cpu", unused=()):
    gen = torch.Generator().manual_seed(seed)
    h, i = 32, 16
    x = torch.randn(t, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen) / 3, torch.randn(e, h, i, generator=gen) / 3
    biases = (torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen))
    gate_up_bias, down_bias = biases if activation == "swiglu_oai" else (None, None)
    logits = torch.randn(t, e, generator=gen)
    logits[:, list(unused)] = -30.0  # experts no token picks
    if activation == "silu":
        bias = torch.randn(e, generator=gen)
        bias[list(unused)] = -30.0
        weights, ids = route_sigmoid_bias(logits, bias, k)
    else:
        weights, ids = route_softmax_topk(logits, k)
    args = [x, gate_up, down, weights, ids, gate_up_bias, down_bias]
    return [a.to(device) if a is not None else None for a in args]


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (13, 6, 3), (40, 16, 4)])
def test_paths_match_reference(path: str, activation: str, t: int, e: int, k: int) -> None:
    unused = (0, 5) if t == 40 else ()  # experts without tokens: empty groups must be skipped cleanly
    args = case(activation, t, e, k, seed=t * 100 + e, unused=unused)
    assert not bool(torch.isin(args[4], torch.tensor(unused, dtype=torch.long)).any())
    ours = PATHS[path](*args, activation, 1.0, 1.702)
    ref = moe_reference(*args, activation, 1.0, 1.702)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_paths_match_reference(dtype: torch.dtype) -> None:
    from minakv.ops.moe import moe

    paths = {"moe": moe, "fused": moe_fused, "dense": moe_dense}
    if dtype == torch.bfloat16:
        paths["grouped"] = moe_grouped
    for t in (1, 7, 64, 300):
        args = case("swiglu_oai", t, 16, 4, seed=t, device="cuda")
        args = [
            a.to(dtype) if a is not None and a.is_floating_point() and j != 3 else a
            for j, a in enumerate(args)
        ]
        ref = moe_reference(*[a.cpu() if a is not None else None for a in args], "swiglu_oai", 1.0, 1.702)
        for name, fn in paths.items():
            ours = fn(*args, "swiglu_oai", 1.0, 1.702).cpu().double()
            err = float((ours - ref).norm() / ref.norm())
            assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (name, t, err)


@interpreted
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize(
    "t,e,k,block_m", [(1, 8, 2, None), (13, 6, 3, None), (40, 16, 4, None), (40, 4, 2, 16)]
)
def test_fused_kernels_match_reference(activation: str, t: int, e: int, k: int, block_m: int | None) -> None:
    """The Triton path (interpreted on CPU): experts without rows, a single token, and (last case: ~20 rows
    per expert in blocks of 16) an expert whose rows take several blocks. Block sizes smaller than the
    dimensions too, so the masked edges of every loop run."""
    unused = (0, 5) if (t, e) == (40, 16) else ()
    args = case(activation, t, e, k, seed=t * 100 + e, unused=unused)
    ref = moe_reference(*args, activation, 1.0, 1.702)
    for blocks in ({}, {"block_n": 16, "block_k": 16}, {"block_n": 32, "block_k": 32}):
        ours = moe_fused(*args, activation, 1.0, 1.702, block_m=block_m, **blocks)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (40, 16, 4)])
def test_grouped_epilogue_kernels_match_reference(
    monkeypatch, activation: str, t: int, e: int, k: int
) -> None:
    """`moe_grouped` with its bias + activation and weighted-sum passes in Triton (grouped_epilogue.py, run
    interpreted): the same function as the float64 reference, with and without biases, experts unused."""
    from minakv.ops import triton_util

    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    args = case(activation, t, e, k, seed=t * 100 + e, unused=(0, 5) if t == 40 else ())
    ref = moe_reference(*args, activation, 1.0, 1.702)
    ours = moe_grouped(*args, activation, 1.0, 1.702)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
