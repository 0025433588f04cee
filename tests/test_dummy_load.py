"""`load_format="dummy"`: real shapes with random weights in the checkpoint's precision (minakv/presets/real.py),
nothing read from disk. The real configs give the published parameter counts; a small config in a folder
runs end to end, with GPT-OSS experts resident as MXFP4 bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.triton import interpreted

from minakv import Engine, SamplingParams
from minakv.model import MODEL_CLASSES, ModelConfig
from minakv.presets.real import REAL_CONFIGS, real_config


def parameters(name: str) -> float:
    """Weights of the real model, counted on the meta device (an MXFP4 byte holds two)."""
    config = ModelConfig.from_hf(REAL_CONFIGS[name])
    with torch.device("meta"):
        model = MODEL_CLASSES[config.arch](config)
    dense = sum(p.numel() for p in model.parameters())
    packed = sum(2 * b.numel() for n, b in model.named_buffers() if n.endswith("_blocks"))
    fp8 = sum(b.numel() for b in model.buffers() if b.dtype == torch.float8_e4m3fn)
    return (dense + packed + fp8) / 1e9


@pytest.mark.parametrize(
    "name,billions", [("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83), ("minimax-m2", 228.7)]
)
def test_real_shapes_have_the_published_sizes(name: str, billions: float) -> None:
    assert parameters(name) == pytest.approx(billions, rel=0.01)  # model cards (MiniMax-M2: without MTP)


def test_hub_ids_name_the_same_shapes() -> None:
    assert real_config("openai/gpt-oss-120b") is REAL_CONFIGS["gpt-oss-120b"]
    assert real_config("no/such-model") is None


def small(tmp_path: Path) -> Path:
    c = dict(REAL_CONFIGS["gpt-oss-20b"])
    c.update(num_hidden_layers=2, num_local_experts=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(c))
    return tmp_path


def test_a_dummy_engine_runs_with_packed_experts(tmp_path: Path) -> None:
    path = small(tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [Engine(str(path), load_format="dummy", kv_cache_tokens=256).generate([[1, 2, 3, 4]], params)[0]
            for _ in range(2)]  # fmt: skip
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 6  # seeded: same weights
    engine = Engine(str(path), load_format="dummy", kv_cache_tokens=256)
    experts = engine.model.layers[0].mlp.experts
    assert experts.packed and experts.gate_up_blocks.dtype == torch.uint8
    assert not hasattr(experts, "gate_up")  # no dense copy of the experts anywhere


def test_unknown_models_are_refused() -> None:
    with pytest.raises(ValueError, match="load_format='dummy' needs"):
        Engine("not-a-model", load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        Engine("tiny-gpt-oss", load_format="mmap")


def test_a_dummy_minimax_engine_keeps_fp8_weights(tmp_path: Path) -> None:
    c = dict(REAL_CONFIGS["minimax-m2"])
    c.update(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, hidden_size=256, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32, vocab_size=512)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(c))
    engine = Engine(str(tmp_path), load_format="dummy", kv_cache_tokens=256)
    layer = engine.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.q_proj.weight_scale_inv.dtype == torch.float32
    assert layer.mlp.experts.fp8 and layer.mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_minimax_fp8_q_k_v_run_as_one_projection(tmp_path: Path) -> None:
    """fuse() stacks MiniMax-M2's FP8 q, k and v (whole 128-row scale blocks each) into one weight and one
    scale grid, the three projections becoming views of them (the engine's worker fuses); the one product
    equals the three of an unfused copy, each block with its own scale."""
    import copy

    from minakv.ops.fp8_linear import linear_fp8
    from minakv.presets.real import build_dummy

    c = dict(REAL_CONFIGS["minimax-m2"])
    c.update(num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2, hidden_size=256, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32, vocab_size=512)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert Engine(str(tmp_path), load_format="dummy", kv_cache_tokens=256).model.layers[0].self_attn.qkv
    plain = build_dummy(str(tmp_path), torch.device("cpu"), torch.float32).layers[0].self_attn
    gen = torch.Generator().manual_seed(1)
    for name in ("q_proj", "k_proj", "v_proj"):  # (dummy scales are all 0.02: give each block its own)
        scales = getattr(plain, name).weight_scale_inv
        scales.copy_(0.01 + 0.02 * torch.rand(scales.shape, generator=gen))
    attn = copy.deepcopy(plain)
    attn.fuse()
    weight, scales = attn.qkv
    assert weight.shape == (256 + 2 * 128, 256) and scales.shape == (4, 2)
    assert attn.k_proj.weight.data_ptr() == weight[256:].data_ptr()
    x = torch.randn(3, 256, generator=gen)
    unfused = torch.cat([plain.q_proj(x), plain.k_proj(x), plain.v_proj(x)], -1)
    torch.testing.assert_close(linear_fp8(x, weight, scales), unfused, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1), unfused)


@interpreted
def test_the_minimax_moe_hands_its_k_parts_to_the_next_norm(tmp_path: Path, monkeypatch) -> None:
    """Alone on its GPU (Triton paths, interpreted here), MiniMax-M2's FP8 MoE block returns its k weighted
    fp32 parts for the next add_rms_norm to sum, as GPT-OSS's does (no sum and cast launches of its own);
    their sum is the block's output with the sum forced inside it."""
    from minakv.ops import triton_util

    c = dict(REAL_CONFIGS["minimax-m2"])
    c.update(num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2, hidden_size=256, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32, vocab_size=512)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(c))
    block = Engine(str(tmp_path), load_format="dummy", kv_cache_tokens=256).model.layers[0].mlp
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)).to(block.gate.weight.dtype)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)  # every op on its Triton path (interpreted)
    parts = block(x)
    assert parts.shape == (1, 2, 256) and parts.dtype == torch.float32
    monkeypatch.setattr(block.experts, "sum_k", True)
    assert torch.equal(parts.sum(1).to(x.dtype), block(x))


def test_the_engine_decides_once_whether_the_scales_fold(tmp_path: Path) -> None:
    """Dummy MXFP4 scales (2^-7, byte 120) fold into the weights (mxfp4_mma_grouped.FOLD_RANGE); one byte
    outside the range turns folding off for its layer only, when the model is fused again."""
    engine = Engine(str(small(tmp_path)), load_format="dummy", kv_cache_tokens=256)
    first, second = (layer.mlp.experts for layer in engine.model.layers)
    assert first.fold and second.fold
    first.down_scales[0, 0, 0] = 137
    engine.model.fuse()
    assert not first.fold and second.fold


@interpreted
def test_the_router_hands_the_packed_gemv_its_input_in_pair_order(tmp_path: Path, monkeypatch) -> None:
    """Where the tensor-core GEMV will read x (compiled runs: `takes_pair_order`, forced here), the MoE block
    has the router's kernel write x in pair order and hands that copy to the experts; the output is the
    block's usual one (the interpreter's GEMV reads x itself)."""
    from minakv.model import gpt_oss
    from minakv.ops import triton_util

    engine = Engine(str(small(tmp_path)), load_format="dummy", kv_cache_tokens=256)
    block = engine.model.layers[0].mlp
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(block.router.weight.dtype)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)  # every op on its Triton path (interpreted)
    plain = block(x)
    seen = []
    moe_mxfp4 = gpt_oss.moe_mxfp4
    monkeypatch.setattr(gpt_oss, "takes_pair_order", lambda *args: True)
    monkeypatch.setattr(
        gpt_oss, "moe_mxfp4", lambda *a, x16=None, **kw: seen.append(x16) or moe_mxfp4(*a, **kw)
    )
    assert torch.equal(block(x), plain)
    (x16,) = seen
    order = x.double().view(3, 8, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(3, 64)
    assert x16 is not None and torch.equal(x16, order.to(torch.float16))
