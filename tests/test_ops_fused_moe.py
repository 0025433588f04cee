"""The fused MoE's sorted and swap_ab modes (minakv/ops/fused_moe.py), run in Triton's CPU interpreter
against the float64 one-token-one-expert reference: several rows per expert (more than one BLOCK_M pass),
experts that get no row, hidden and intermediate sizes that are not multiples of BLOCK_K or BLOCK_N, and
the counting sort itself against torch's stable argsort (several chunks, empty experts)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import moe_reference
from helpers.triton import interpreted

from minakv.ops import moe_groups, triton_util
from minakv.ops.fused_moe import SCAN_MAX_PAIRS, moe_fused
from minakv.ops.moe import route_softmax_topk
from minakv.ops.moe_groups import sort_by_expert


def layer(t: int, e: int, k: int, h: int, i: int, seed: int, unused=(), biases: bool = True):
    """Random inputs; experts in `unused` get no token (their logits are far below the rest)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen) / 4, torch.randn(e, h, i, generator=gen) / 4
    gate_up_bias = torch.randn(e, 2 * i, generator=gen) if biases else None
    down_bias = torch.randn(e, h, generator=gen) if biases else None
    logits = torch.randn(t, e, generator=gen)
    logits[:, list(unused)] = -30.0
    weights, ids = route_softmax_topk(logits, k)
    assert not bool(torch.isin(ids, torch.tensor(list(unused), dtype=torch.long)).any())
    return [x, gate_up, down, weights, ids, gate_up_bias, down_bias]


@interpreted
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("num_pairs,num_experts", [(1, 4), (37, 7), (100, 200), (513, 16), (2100, 256)])
def test_sort_by_expert_matches_stable_argsort(num_pairs: int, num_experts: int, parallel: bool) -> None:
    """(100, 200): 32-pair chunks, so the running slots carry across four chunks; most experts empty.
    parallel: a program per chunk (two launches); (2100, 256): 66 chunks, their counts summed in 32-row
    steps, the last chunk ragged."""
    gen = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(0, max(1, num_experts - 2), (num_pairs,), generator=gen)  # the last two: empty
    order, counts, starts, tile_ends = sort_by_expert(ids, num_experts, block_m=8, parallel=parallel)
    expected = torch.bincount(ids, minlength=num_experts)
    assert order.tolist() == torch.argsort(ids, stable=True).tolist()
    assert counts.tolist() == expected.tolist()
    assert starts.tolist() == (torch.cumsum(expected, 0) - expected).tolist()
    assert tile_ends.tolist() == torch.cumsum((expected + 7) // 8, 0).tolist()


@interpreted
@pytest.mark.parametrize("num_pairs", [37, 2048])
def test_group_by_expert_sort_matches_torch_path(num_pairs: int, monkeypatch) -> None:
    """The grouped kernels' plan from the counting sort (Triton) equals the one from torch's argsort."""
    ids = torch.randint(0, 30, (num_pairs // 4, 4), generator=torch.Generator().manual_seed(num_pairs))
    torch_plan = moe_groups.group_by_expert(ids, 32, 16)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    triton_plan = moe_groups.group_by_expert(ids, 32, 16)
    assert triton_plan[0].dtype == torch.int32  # (the sort's own order, not argsort's)
    for ours, ref in zip(triton_plan, torch_plan):
        assert (ours.tolist() if isinstance(ours, torch.Tensor) else ours) == (
            ref.tolist() if isinstance(ref, torch.Tensor) else ref
        )


VARIANTS = [
    {"sort": True},
    {"sort": True, "swap_ab": True},
    {"sort": True, "block_m": 16, "block_n": 16, "block_k": 32},  # 2-3 passes per expert, ragged K and N
    {"sort": True, "swap_ab": True, "block_m": 16, "block_n": 32, "block_k": 32},
    {"sort": False, "swap_ab": True, "block_k": 32},  # the scan with the swapped product
]


@interpreted
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v}" for k, v in v.items()))
def test_fused_variants_match_reference(variant: dict) -> None:
    """40 tokens top-4 over 8 experts (2 never chosen): ~27 rows per used expert; H=48 and I=40 are not
    multiples of BLOCK_K=32 or BLOCK_N=32, so every loop's masked edge runs."""
    args = layer(t=40, e=8, k=4, h=48, i=40, seed=1, unused=(2, 5))
    ref = moe_reference(*args, "swiglu_oai", 1.0, 1.702)
    ours = moe_fused(*args, "swiglu_oai", 1.0, 1.702, **variant)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@interpreted
def test_sorted_default_silu_without_biases() -> None:
    """The default mode choice above SCAN_MAX_PAIRS (sorted), with silu and no biases; one token per
    expert on average, so most experts are empty or take a single row."""
    t, k = SCAN_MAX_PAIRS // 2 + 3, 2
    args = layer(t=t, e=64, k=k, h=24, i=16, seed=2, unused=(0, 63), biases=False)
    assert t * k > SCAN_MAX_PAIRS
    ref = moe_reference(*args, "silu", 7.0, 1.702)
    torch.testing.assert_close(moe_fused(*args, "silu").double(), ref, rtol=1e-5, atol=1e-5)
