"""The model's building blocks against independent references: RMSNorm and RoPE against transformers'
modules (bit for bit, including bf16 rounding order), the MoE op against a float64 per-token loop, and the
MXFP4 / FP8 (de)quantisers against transformers' dequantiser and a per-block loop."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import moe_reference

from minakv.model.config import ModelConfig
from minakv.ops.moe import moe, route_sigmoid_bias, route_softmax_topk
from minakv.ops.norm import rms_norm
from minakv.ops.quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from minakv.ops.rope import Rope

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gpt_oss", "minimax_m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bitwise(family: str, dtype: torch.dtype) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    weight = 1 + torch.randn(96, generator=gen)
    if family == "gpt_oss":  # weight kept in fp32, applied before the cast
        ref_mod, weight_in_fp32 = GptOssRMSNorm(96, eps=1e-5), True
    else:  # weight in the model dtype, applied after the cast
        ref_mod, weight_in_fp32 = MiniMaxM2RMSNorm(96, eps=1e-5).to(dtype), False
        weight = weight.to(dtype)
    with torch.no_grad():
        ref_mod.weight.copy_(weight)
        ref = ref_mod(x)
    ours = rms_norm(x, weight, 1e-5, weight_in_fp32)
    assert ours.dtype == ref.dtype == dtype
    assert torch.equal(ours, ref)


def hf_rope(hf_config) -> tuple[torch.Tensor, float]:
    if hf_config.model_type == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding as Emb
    else:
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding as Emb
    emb = Emb(hf_config)
    return emb.inv_freq, emb.attention_scaling


@pytest.mark.parametrize("family", ["gpt_oss", "minimax_m2"])
def test_rope_tables_match_transformers_at_real_sizes(family: str) -> None:
    """gpt-oss-20b's YaRN (truncate=False, factor 32) and MiniMax-M2's partial rotary (64 of 128)."""
    if family == "gpt_oss":
        hf = transformers.GptOssConfig()  # defaults are gpt-oss-20b's attention/rope settings
    else:
        rope = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}
        hf = transformers.MiniMaxM2Config(head_dim=128, rotary_dim=64, rope_parameters=rope)
    d = hf.to_dict()
    d["architectures"] = [type(hf).__name__.replace("Config", "ForCausalLM")]
    config = ModelConfig.from_hf(d)
    rope = Rope(config.rotary_dim, config.rope_theta, config.rope_scaling)
    inv_freq, scaling = hf_rope(hf)
    assert config.rotary_dim == 64  # all of gpt-oss's 64-dim heads; half of MiniMax-M2's 128
    torch.testing.assert_close(rope.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(scaling, rel=1e-12)
    if family == "gpt_oss":
        assert rope.attention_factor == pytest.approx(0.1 * math.log(32) + 1)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_moe_matches_per_token_reference(activation: str) -> None:
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = 11, 24, 16, 6, 3
    x = torch.randn(t, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen) / 3, torch.randn(e, h, i, generator=gen) / 3
    biases = (torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen))
    gate_up_bias, down_bias = biases if activation == "swiglu_oai" else (None, None)
    logits = torch.randn(t, e, generator=gen)
    if activation == "silu":
        weights, ids = route_sigmoid_bias(logits, torch.randn(e, generator=gen), k)
    else:
        weights, ids = route_softmax_topk(logits, k)
    ours = moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation, limit=1.0, alpha=1.702)
    ref = moe_reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation, 1.0, 1.702)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def test_routing_rules() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    w, ids = route_softmax_topk(logits, 2)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    # the correction bias picks expert 0 over expert 3, but the weights use the unbiased sigmoid scores
    w, ids = route_sigmoid_bias(logits, torch.tensor([10.0, 0.0, 0.0, 0.0]), 2)
    assert sorted(ids[0].tolist()) == [0, 1]
    s = torch.sigmoid(logits[0, ids[0]])
    torch.testing.assert_close(w[0], s / s.sum())


def test_mxfp4_dequantise_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # HF layout [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), ref.transpose(1, 2))


def test_mxfp4_quantise_inverts_dequantise() -> None:
    """Codes whose group maximum is +-6 (so the scale is recoverable) come back byte for byte."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 5, 3, 32), generator=gen)
    codes[codes == 8] = 0  # -0 and +0 are the same value
    codes[..., 7] = 7 + 8 * torch.randint(0, 2, codes.shape[:-1], generator=gen)  # +-6 in every group
    codes = codes.to(torch.uint8).reshape(2, 5, 3, 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    scales = torch.randint(100, 150, (2, 5, 3), generator=gen, dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales)
    b2, s2 = quantize_mxfp4(w)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    # random weights: the error of each element is at most half a step of its group's FP4 grid
    x = torch.randn(4, 64, generator=gen)
    err = (dequantize_mxfp4(*quantize_mxfp4(x)) - x).abs()
    step = torch.exp2(quantize_mxfp4(x)[1].float() - 127).repeat_interleave(32, -1)  # finest grid 0.5*2^e
    assert (err <= step + 1e-7).all()


def test_fp8_block_dequantise_matches_per_block_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(200, 300, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen) + 0.1
    ref = torch.empty(200, 300)
    for r in range(2):
        for c in range(3):
            blk = w[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].float()
            ref[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] = blk * scale[r, c]
    assert torch.equal(dequantize_fp8_block(w, scale), ref)
    with pytest.raises(ValueError, match=r"weight_scale_inv of shape \(2, 3\)"):
        dequantize_fp8_block(w, scale[:1])


def test_fp8_block_quantise_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=gen)
    w[128:, :128] = 0  # an all-zero block
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3) and scale[1, 0] == 1.0
    back = dequantize_fp8_block(q, scale)
    assert float((back - w).norm() / w.norm()) < 0.04  # e4m3 has 3 mantissa bits
    q2, scale2 = quantize_fp8_block(back)
    assert torch.equal(dequantize_fp8_block(q2, scale2), back)
