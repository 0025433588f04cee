"""The fused routers (minakv/ops/routing.py) against the torch forms they replace: GPT-OSS's F.linear, top-k,
softmax over the k; MiniMax-M2's F.linear, sigmoid, top-k of score + correction bias, renormalised scores. Runs the Triton kernels (H cut into splits, then the finishing top-k) in the CPU
interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.triton import interpreted

from minakv.ops.moe import route_sigmoid_bias, route_softmax_topk
from minakv.ops.routing import route_sigmoid_bias_fused, route_softmax_topk_fused


@pytest.mark.parametrize(
    "tokens,hidden,experts,k,dtype",
    [
        (1, 64, 32, 4, torch.float32),
        (5, 200, 32, 4, torch.float32),
        (33, 96, 128, 4, torch.float32),
        (7, 128, 8, 2, torch.float32),
        (20, 64, 32, 4, torch.bfloat16),
        (3, 64, 32, 1, torch.float32),
        (2, 1000, 128, 4, torch.float32),
        (17, 2880, 32, 4, torch.bfloat16),
    ],
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


@pytest.mark.parametrize(
    "tokens,hidden,dtype", [(1, 64, torch.float32), (17, 2880, torch.bfloat16), (3, 1000, torch.bfloat16)]
)
@interpreted
def test_fused_routing_writes_pair_order(tokens, hidden, dtype):
    """`pair_out`: x as the tensor-core MXFP4 GEMV reads it (within each 8 inputs 0 2 4 6 1 3 5 7, fp16, held
    at +-65504), written by the router's first kernel across its splits; the routing itself unchanged."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    x[0, 5] = 1e6  # beyond fp16: saturates, not inf
    w = (torch.randn(32, hidden, generator=g) / hidden**0.5).to(dtype)
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.float16)
    weights, ids = route_softmax_topk_fused(x, w, None, 4, pair_out=out)
    ref = x.double().clamp(-65504, 65504).view(tokens, hidden // 8, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]
    assert torch.equal(out, ref.reshape(tokens, hidden).to(torch.float16))
    ref_w, ref_ids = route_softmax_topk_fused(x, w, None, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    with pytest.raises(ValueError, match="pair_out"):
        route_softmax_topk_fused(x, w, None, 4, pair_out=out.float())


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


@pytest.mark.parametrize(
    "tokens,hidden,experts,k,dtype",
    [
        (1, 64, 32, 8, torch.float32),
        (5, 200, 256, 8, torch.float32),
        (20, 96, 64, 4, torch.bfloat16),
        (3, 3072, 256, 8, torch.bfloat16),
    ],
)  # fmt: skip  (the last: MiniMax-M2's router, H cut into splits)
@interpreted
def test_fused_sigmoid_routing_matches_torch(tokens, hidden, experts, k, dtype):
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    # a correction bias large enough to change the choice: the weights must still be the unbiased scores
    bias = torch.randn(experts, generator=g) * 0.5
    weights, ids = route_sigmoid_bias_fused(x, w, bias, k)
    logits = F.linear(x.double(), w.double()).to(dtype)  # rounded as the GEMM's output is
    ref_w, ref_ids = route_sigmoid_bias(logits, bias, k)
    unbiased_ids = torch.topk(logits.float(), k, dim=-1).indices
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)  # the bias did choose
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
        return
    # bf16: the kernel's fp32 sum may round a logit to the neighbouring bf16 value (one ulp, 0.4%), which
    # can swap two near-equal choosing keys: the chosen keys must be the top k up to that, and where the
    # choice agrees the weights within it
    scores = torch.sigmoid(logits.float())
    keys = scores + bias
    torch.testing.assert_close(keys.gather(1, ids), keys.topk(k, dim=-1).values, rtol=0, atol=4e-3)
    same = (ids == ref_ids).all(-1)
    assert same.float().mean() > 0.5
    torch.testing.assert_close(weights[same], ref_w[same], rtol=1e-2, atol=1e-3)


@interpreted
def test_one_launch_finish_leaves_its_counter_at_zero(monkeypatch):
    """Up to FINISH_IN_PLACE_MAX tokens the last split program to arrive finishes the block (no second
    kernel): bit for bit the weights and ids of the two-launch path, call after call on one counter,
    which every call leaves at zero; a counter of the wrong kind is refused."""
    from minakv.ops import routing

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2880, generator=g).to(torch.bfloat16)  # 23 splits of H
    w = (torch.randn(128, 2880, generator=g) / 2880**0.5).to(torch.bfloat16)
    b = torch.randn(128, generator=g).to(torch.bfloat16)
    counts = routing.block_counters(x.device)
    for tokens in (1, 3, 1):
        weights, ids = route_softmax_topk_fused(x[:tokens], w, b, 4, counts=counts)
        assert not counts.any()
        monkeypatch.setattr(routing, "FINISH_IN_PLACE_MAX", 0)  # the two-launch path, for reference
        ref_w, ref_ids = route_softmax_topk_fused(x[:tokens], w, b, 4)
        monkeypatch.setattr(routing, "FINISH_IN_PLACE_MAX", 4)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    with pytest.raises(ValueError, match="counts"):
        route_softmax_topk_fused(x[:1], w, b, 4, counts=counts.long())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_launch_finish_on_the_gpu(monkeypatch):
    """The same on the GPU, where the split programs really race (the interpreter runs them one by one):
    gpt-oss-120b's router (128 experts, H = 2880: 23 splits) and MiniMax-M2's (256, 3072), 1-4 tokens,
    many calls on one counter, each bit for bit the two-launch path's."""
    from minakv.ops import routing

    g = torch.Generator("cuda").manual_seed(0)
    for experts, hidden in ((128, 2880), (256, 3072)):
        w = (torch.randn(experts, hidden, generator=g, device="cuda") / hidden**0.5).to(torch.bfloat16)
        b = torch.randn(experts, generator=g, device="cuda").to(torch.bfloat16)
        counts = routing.block_counters(torch.device("cuda"))
        for i in range(200):
            x = torch.randn(1 + i % 4, hidden, generator=g, device="cuda").to(torch.bfloat16)
            weights, ids = route_softmax_topk_fused(x, w, b, 4, counts=counts)
            s_weights, s_ids = route_sigmoid_bias_fused(x, w, b.float(), 8, counts=counts)
            monkeypatch.setattr(routing, "FINISH_IN_PLACE_MAX", 0)  # the two-launch path, for reference
            ref = route_softmax_topk_fused(x, w, b, 4), route_sigmoid_bias_fused(x, w, b.float(), 8)
            monkeypatch.setattr(routing, "FINISH_IN_PLACE_MAX", 4)
            assert torch.equal(ids, ref[0][1]) and torch.equal(weights, ref[0][0]), i
            assert torch.equal(s_ids, ref[1][1]) and torch.equal(s_weights, ref[1][0]), i
        assert not counts.any()
