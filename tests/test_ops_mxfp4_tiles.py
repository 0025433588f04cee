"""The MXFP4 kernels on weights in tiles (minakv/ops/mxfp4_layout.py), in Triton's CPU interpreter: each
path, given the same weights in tiles and told so, returns exactly what it returns on them in rows (the
same arithmetic from other addresses), which matches float64; and a model stores its experts in tiles
under MINAKV_MXFP4_TILES=1 with the same outputs. (The tensor-core kernels, GPU only: test_ops_mxfp4.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.mxfp4 import assert_matches, case
from helpers.triton import interpreted

from minakv import Engine, SamplingParams
from minakv.ops import triton_util
from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv
from minakv.ops.mxfp4_grouped import dequantize_mxfp4_bf16, moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import tile, tile_rows, untile_rows
from minakv.ops.mxfp4_moe import moe_mxfp4, moe_mxfp4_fused, moe_mxfp4_ref
from minakv.presets.real import REAL_CONFIGS

# H = 96 and I = 160 (3 and 5 groups, 6 and 20 row tiles): blocks of 32 rows straddle row tiles, K blocks
# of 64 inputs end inside a group run, and output blocks of 64 rows end past the last row tile
PATHS = [
    ("fused split", moe_mxfp4_fused, {"mode": "split", "block_n": 32, "block_k": 64}),
    ("fused interleave", moe_mxfp4_fused, {"mode": "interleave", "block_n": 64, "block_k": 32}),
    ("fused fma, pairs, split-K", moe_mxfp4_fused, {"mode": "fma", "slots": "pairs", "splits": 2}),
    ("fused swap", moe_mxfp4_fused, {"mode": "swap", "block_n": 32, "block_k": 32}),
    ("grouped split", moe_mxfp4_grouped, {"mode": "split", "block_m": 16, "block_n": 32, "block_k": 64}),
    ("grouped interleave", moe_mxfp4_grouped, {"mode": "interleave", "block_m": 16, "block_n": 64}),
    ("grouped bf16", moe_mxfp4_grouped, {"mode": "bf16"}),
    ("gemv 16 x 2", moe_mxfp4_gemv, {"block_n": 16, "groups": 2}),
    ("gemv 4 x 32, split-K", moe_mxfp4_gemv, {"block_n": 4, "groups": 32, "splits": 2}),
    ("reference", moe_mxfp4_ref, {}),
]


def test_tile_round_trip() -> None:
    """untile_rows(tile_rows(w)) is w, other keys pass through, and tile() of one weight is tile_rows' own."""
    args, _ = case("silu", 1, e=3, h=96, i=160, seed=1)
    w = {**args[1], "other": torch.ones(2)}
    tiled = tile_rows(w)
    assert tiled["other"] is w["other"]
    assert not torch.equal(tiled["down_blocks"], w["down_blocks"])  # 96 rows: the layouts differ
    back = untile_rows(tiled)
    assert all(torch.equal(back[key], w[key]) for key in w)
    blocks, scales = tile(w["down_blocks"], w["down_scales"])
    assert torch.equal(blocks, tiled["down_blocks"]) and torch.equal(scales, tiled["down_scales"])


@interpreted
@pytest.mark.parametrize("name, fn, knobs", PATHS, ids=[p[0] for p in PATHS])
def test_paths_read_tiles(name: str, fn, knobs: dict) -> None:
    t = 1 if fn is moe_mxfp4_gemv else 5  # the GEMV: one token (its pairs no more than the experts)
    args, ref = case("swiglu_oai", t, e=3, h=96, i=160, seed=len(name))
    in_rows = fn(*args, **knobs)
    in_tiles = fn(args[0], tile_rows(args[1]), *args[2:], **knobs, tiled=True)
    assert torch.equal(in_tiles, in_rows), float((in_tiles - in_rows).abs().max())
    assert_matches(in_tiles, ref)


@interpreted
def test_dispatch_passes_tiles_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_mxfp4(tiled=True) on tiles: right on CPU tensors (the reference) and with Triton on the CPU at
    one token (the GEMV) and at 5 (the fused kernels); wrong if the weights are in tiles but not said so."""
    args, ref = case("silu", 5, e=3, h=96, i=160, seed=2)
    one, ref_one = case("silu", 1, e=3, h=96, i=160, seed=3)
    for a, r in ((args, ref), (one, ref_one)):
        assert_matches(moe_mxfp4(a[0], tile_rows(a[1]), *a[2:], tiled=True), r)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    for a, r in ((args, ref), (one, ref_one)):
        assert_matches(moe_mxfp4(a[0], tile_rows(a[1]), *a[2:], tiled=True), r)
    unsaid = moe_mxfp4(args[0], tile_rows(args[1]), *args[2:])
    assert not torch.allclose(unsaid.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@interpreted
def test_dequantize_bf16_kernel_in_rows() -> None:
    """The prefill's dequantize-once kernel reads rows: "grouped bf16" above untiles first (a copy)."""
    args, _ = case("silu", 1, e=2, h=64, i=64, seed=4)
    w = args[1]
    expect = dequantize_mxfp4_bf16(w["down_blocks"], w["down_scales"], torch.float32)
    tiled = tile_rows(w)
    assert not torch.equal(
        dequantize_mxfp4_bf16(tiled["down_blocks"], tiled["down_scales"], torch.float32), expect
    )


def test_engine_stores_tiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small dummy GPT-OSS engine: with MINAKV_MXFP4_TILES=1 the worker's fuse() re-lays every layer's
    experts in tiles (the same seeded bytes as without, re-laid; a second fuse leaves them), and greedy
    tokens and their logprobs are those of the engine in rows (CPU: the reference path, exact)."""
    c = dict(REAL_CONFIGS["gpt-oss-20b"])
    c.update(num_hidden_layers=2, num_local_experts=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(c))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    outs, experts = [], []
    for tiles in ("0", "1"):
        monkeypatch.setenv("MINAKV_MXFP4_TILES", tiles)
        engine = Engine(str(tmp_path), load_format="dummy", kv_cache_tokens=256)
        outs.append(engine.generate([[1, 2, 3, 4]], params)[0])
        experts.append([layer.mlp.experts for layer in engine.model.layers])
    assert not any(e.tiled for e in experts[0]) and all(e.tiled for e in experts[1])
    for rows, tiles in zip(*experts, strict=True):
        expect = tile_rows(rows.mxfp4)
        assert all(torch.equal(tiles.mxfp4[key], expect[key]) for key in expect)
    experts[1][0].fuse()
    assert all(
        torch.equal(experts[1][0].mxfp4[key], value) for key, value in tile_rows(experts[0][0].mxfp4).items()
    )
    assert outs[1].token_ids == outs[0].token_ids
    assert [p.logprob for p in outs[1].logprobs] == [p.logprob for p in outs[0].logprobs]
