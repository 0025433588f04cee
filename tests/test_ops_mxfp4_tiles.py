"""The resident MXFP4 layout, 16-row tiles (minakv/ops/mxfp4_layout.py): tiles and rows convert both ways;
every MXFP4 path reads tiles, so the same bytes left in the checkpoint's rows give wrong outputs (each path
in Triton's CPU interpreter; the tensor-core kernels on the GPU: test_ops_mxfp4.py); the loader and the
dummy weights store tiles of a rank's own rows. Model outputs against transformers: test_model_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.mxfp4 import assert_matches, case
from helpers.triton import interpreted
from safetensors import safe_open

from minakv.model import build_model, load_model
from minakv.model.config import ModelConfig
from minakv.ops import triton_util
from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv
from minakv.ops.mxfp4_grouped import dequantize_mxfp4_bf16, moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import tile, tile_blocks, tile_rows, untile_rows
from minakv.ops.mxfp4_moe import moe_mxfp4, moe_mxfp4_fused, moe_mxfp4_ref
from minakv.parallel.group import Parallel
from minakv.parallel.shard import shard
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
    """tile_rows(untile_rows(w)) is w, other keys pass through, tile() of one weight is tile_rows' own, and
    gate/up must each be whole tiles (a tile holding gate and up rows would mix the two)."""
    args, _ = case("silu", 1, e=3, h=96, i=160, seed=1)
    tiles = {**args[1], "other": torch.ones(2)}
    rows = untile_rows(tiles)
    assert rows["other"] is tiles["other"]
    assert not torch.equal(rows["down_blocks"], tiles["down_blocks"])  # 96 rows: the layouts differ
    assert all(torch.equal(value, tiles[key]) for key, value in tile_rows(rows).items())
    blocks, scales = tile(rows["down_blocks"], rows["down_scales"])
    assert torch.equal(blocks, tiles["down_blocks"]) and torch.equal(scales, tiles["down_scales"])
    with pytest.raises(ValueError, match="2 parts of whole 16-row tiles"):
        tile(rows["gate_up_blocks"][:, :48], rows["gate_up_scales"][:, :48], parts=2)  # I = 24


@interpreted
@pytest.mark.parametrize("name, fn, knobs", PATHS, ids=[p[0] for p in PATHS])
def test_paths_read_tiles(name: str, fn, knobs: dict) -> None:
    t = 1 if fn is moe_mxfp4_gemv else 5  # the GEMV: one token (its pairs no more than the experts)
    args, ref = case("swiglu_oai", t, e=3, h=96, i=160, seed=len(name))
    assert_matches(fn(*args, **knobs), ref)
    in_rows = fn(args[0], untile_rows(args[1]), *args[2:], **knobs)
    assert not torch.allclose(in_rows.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@interpreted
def test_dispatch_reads_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_mxfp4 on tiles: right on CPU tensors (the reference) and with Triton on the CPU at one token (the
    GEMV) and at 5 (the fused kernels)."""
    args, ref = case("silu", 5, e=3, h=96, i=160, seed=2)
    one, ref_one = case("silu", 1, e=3, h=96, i=160, seed=3)
    for a, r in ((args, ref), (one, ref_one)):
        assert_matches(moe_mxfp4(*a), r)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    for a, r in ((args, ref), (one, ref_one)):
        assert_matches(moe_mxfp4(*a), r)


@interpreted
def test_dequantize_bf16_kernel_reads_rows() -> None:
    """The prefill's dequantize-once kernel writes bf16 rows from packed rows: "grouped bf16" untiles first
    (a copy), and the kernel on tiles would be wrong."""
    args, _ = case("silu", 1, e=2, h=64, i=64, seed=4)
    tiles, rows = args[1], untile_rows(args[1])
    expect = dequantize_mxfp4_bf16(rows["down_blocks"], rows["down_scales"], torch.float32)
    assert not torch.equal(
        dequantize_mxfp4_bf16(tiles["down_blocks"], tiles["down_scales"], torch.float32), expect
    )


def test_the_loader_stores_tiles(checkpoints: dict[str, Path]) -> None:
    """A tiny MXFP4 checkpoint: every layer's down experts are the checkpoint's bytes in tiles (gate/up also
    go from interleaved rows to halves: test_model_parity.py holds the outputs to transformers)."""
    model = load_model(checkpoints["gpt_oss_mxfp4"], device="cpu", dtype=torch.float32)
    files = sorted(Path(checkpoints["gpt_oss_mxfp4"]).glob("*.safetensors"))
    stored = {}
    for file in files:
        with safe_open(file, "pt") as f:
            stored |= {name: f.get_tensor(name) for name in f.keys() if "down_proj_" in name}  # noqa: SIM118
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}.mlp.experts.down_proj"
        blocks, scales = tile(stored[prefix + "_blocks"], stored[prefix + "_scales"])
        assert torch.equal(layer.mlp.experts.down_blocks, blocks)
        assert torch.equal(layer.mlp.experts.down_scales, scales)


def test_dummy_ranks_store_tiles_of_their_rows() -> None:
    """Dummy weights under tensor parallelism: a rank's experts are tiles of its share of the unsharded
    model's rows (tiling the whole and cutting the tiles would mix other rows in)."""
    c = dict(REAL_CONFIGS["gpt-oss-20b"])
    c.update(num_hidden_layers=1, num_local_experts=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, layer_types=["full_attention"])  # fmt: skip
    config = ModelConfig.from_hf(c)
    whole = untile_rows(build_model(config, device="cpu", seed=5).layers[0].mlp.experts.mxfp4)
    for rank in (0, 1):
        par = Parallel(rank=rank, tp=2)
        ours = build_model(config, device="cpu", seed=5, parallel=par).layers[0].mlp.experts.mxfp4
        for key in ("gate_up_blocks", "down_blocks"):
            expect = tile_blocks(shard(f"layers.0.mlp.experts.{key}", whole[key], par))
            assert torch.equal(ours[key], expect), (rank, key)
