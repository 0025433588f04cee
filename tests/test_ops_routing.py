"""The fused GPT-OSS router (minakv/ops/routing.py) against the torch form it replaces: F.linear, top-k,
softmax over the k. Runs the Triton kernels (H cut into splits, then the finishing top-k) in the CPU
interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.triton import interpreted

from minakv.ops.moe import route_softmax_topk
from minakv.ops.routing import route_softmax_topk_fused


@pytest.mark.parametrize(
    "tokens,hidden,experts,k,dtype",
    [(1, 64, 32, 4, torch.float32), (5, 200, 32, 4, torch.float32), (33, 96, 128, 4, torch.float32),
     (7, 128, 8, 2, torch.float32), (20, 64, 32, 4, torch.bfloat16), (3, 64, 32, 1, torch.float32),
     (2, 1000, 128, 4, torch.float32), (17, 2880, 32, 4, torch.bfloat16)],
)  # fmt: skip  (the last two: H cut into 16 and 23 splits, the last slice ragged; two token blocks)
@interpreted
def test_fused_routing_matches_torch(tokens, hidden, experts, k, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    b = torch.randn(experts, generator=g).to(dtype)
    weights, ids = route_softmax_topk_fused(x, w, b, k)
    # reference: logits in float64, rounded to the activations' dtype as the GEMM's output is
    logits = F.linear(x.double(), w.double(), b.double()).to(dtype)
    ref_w, ref_ids = route_softmax_topk(logits, k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    # bf16: the kernel's fp32 sum may round a logit to the neighbouring bf16 value (one ulp, 0.4%)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights, ref_w, rtol=tol, atol=tol)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))


@interpreted
def test_fused_routing_no_bias_and_empty():
    x = torch.randn(4, 64)
    w = torch.randn(32, 64)
    weights, ids = route_softmax_topk_fused(x, w, None, 4)
    ref_w, ref_ids = route_softmax_topk(F.linear(x.double(), w.double()).float(), 4)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    empty_w, empty_ids = route_softmax_topk_fused(x[:0], w, None, 4)
    assert empty_w.shape == (0, 4) and empty_ids.shape == (0, 4)
