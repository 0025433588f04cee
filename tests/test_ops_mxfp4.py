"""The MXFP4 MoE kernels (minakv/ops/mxfp4_moe.py, mxfp4_grouped.py) against the float64 reference on
`dequantize_mxfp4` of the same packed weights: in Triton's CPU interpreter at tiny shapes (fp32 tiles and
dots there), and on the GPU at the gpt-oss-20b expert shape in bf16 beside the bf16 paths."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers.models import moe_reference
from helpers.mxfp4 import ALPHA, LIMIT, assert_matches, case
from helpers.triton import interpreted

from minakv.ops import mxfp4_moe
from minakv.ops.moe import route_softmax_topk
from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv
from minakv.ops.mxfp4_grouped import moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import packed_rows, tile, tile_rows, untile_rows
from minakv.ops.mxfp4_moe import moe_mxfp4, moe_mxfp4_fused, moe_mxfp4_ref
from minakv.ops.mxfp4_tile import load_mxfp4_halves, load_mxfp4_tile
from minakv.ops.quant import dequantize_mxfp4

PATHS = {"fused": moe_mxfp4_fused, "grouped": moe_mxfp4_grouped}


@triton.jit
def _dequant_kernel(b_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BF16: tl.constexpr, HALVES: tl.constexpr):  # fmt: skip
    """W [N, K] through load_mxfp4_tile, or (HALVES) load_mxfp4_halves' even and odd columns."""
    pid = tl.program_id(0)
    offs_n, n_ok, byte_rows, scale_rows = packed_rows(b_ptr, s_ptr, pid * 0, pid * BLOCK_N, N, 0, K // 2, 0,
                                                      K // 32, BLOCK_N)  # fmt: skip
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_K // 2)
    for k0 in range(0, K, BLOCK_K):
        if HALVES:
            even, odd = load_mxfp4_halves(byte_rows, scale_rows, n_ok, k0, K, BLOCK_K, BF16)
            mask = n_ok[:, None] & (k0 // 2 + offs_j < K // 2)[None, :]
            out = out_ptr + offs_n[:, None] * K + k0 + 2 * offs_j[None, :]
            tl.store(out, even.to(tl.float32), mask=mask)
            tl.store(out + 1, odd.to(tl.float32), mask=mask)
        else:
            tile = load_mxfp4_tile(byte_rows, scale_rows, n_ok, k0, K, BLOCK_K, BF16)
            mask = n_ok[:, None] & (k0 + offs_k < K)[None, :]
            tl.store(out_ptr + offs_n[:, None] * K + k0 + offs_k[None, :], tile.to(tl.float32), mask=mask)


def check_dequant_exact(device: str, bf16: bool, halves: bool = False) -> None:
    """Every byte value under every scale, through the in-register path (halves: the select-free decode of
    the split modes) from tiles (mxfp4_layout.py): equal to dequantize_mxfp4 of the same bytes in rows."""
    rows, groups = 256, 5  # 160 inputs: a tail with BLOCK_K 64
    blocks = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(rows, groups, 16).contiguous()
    blocks = blocks.roll(1, dims=1)  # a row's groups differ
    # 255 is NaN in E8M0; 6 * 2^126 is the largest finite fp32 here (halves: 2^14 more, folded in); bf16:
    # clear of its overflow and its subnormals
    lo, hi = (10, 240) if bf16 else (0, 240 if halves else 252)
    scales = (torch.arange(rows * groups).reshape(rows, groups) % 256).clamp(lo, hi).to(torch.uint8)
    ref = dequantize_mxfp4(blocks, scales)
    blocks, scales = tile(blocks, scales)
    blocks, scales = blocks.to(device), scales.to(device)
    out = torch.empty(rows, groups * 32, device=device)
    _dequant_kernel[(triton.cdiv(rows, 32),)](blocks, scales, out, rows, groups * 32, 32, 64, BF16=bf16,
                                              HALVES=halves)  # fmt: skip
    assert torch.equal(out.cpu(), ref)


@interpreted
def test_dequant_tile_is_exact() -> None:
    check_dequant_exact("cpu", bf16=False)


@interpreted
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_paths_match_reference(path: str, activation: str, t: int) -> None:
    """4 experts, top-2, biases; blocks smaller than the dims (and for grouped, 16 rows: an expert's rows
    take several tiles at T=17), so every masked edge and loop runs."""
    args, ref = case(activation, t, seed=t)
    blocks = {"block_n": 32, "block_k": 32}
    if path == "grouped":
        blocks["block_m"] = 16
    assert_matches(PATHS[path](*args, **blocks), ref)


@interpreted
@pytest.mark.parametrize("path", list(PATHS))
def test_k_not_a_multiple_of_the_block(path: str) -> None:
    """H = 96 and I = 160 are multiples of 32 but not of BLOCK_K = 64 (like gpt-oss's 2880 with 128), and
    I is not a multiple of BLOCK_N = 64 either; no biases."""
    args, ref = case("swiglu_oai", 5, e=3, h=96, i=160, seed=7, biases=False)
    assert_matches(PATHS[path](*args, block_n=64, block_k=64), ref)


VARIANTS = [  # (path, knobs) beyond the defaults: each tile mode, and the fused kernels' per-pair grid
    ("fused", {"mode": "interleave"}),
    ("fused", {"mode": "split"}),
    ("fused", {"mode": "swap"}),
    ("fused", {"mode": "fma"}),
    ("fused", {"mode": "fma", "block_m": 1}),
    ("fused", {"mode": "split", "slots": "pairs"}),
    ("fused", {"mode": "interleave", "slots": "pairs"}),
    ("fused", {"mode": "split", "splits": 2}),  # split-K: partials summed by gate_up_finish / here
    ("fused", {"mode": "split", "slots": "pairs", "splits": 3}),  # H has 2 K blocks: one split is empty
    ("grouped", {"mode": "interleave", "block_m": 16}),
    ("grouped", {"mode": "split", "block_m": 16}),
    ("grouped", {"mode": "swap", "block_m": 16}),
    ("grouped", {"mode": "fma", "block_m": 4}),
]


@interpreted
@pytest.mark.parametrize("path, knobs", VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("t", [1, 17])
def test_variants_match_reference(path: str, knobs: dict, t: int) -> None:
    """Each variant on the masked edges: H = 96 and I = 160 not multiples of BLOCK_K = 64 nor I of
    BLOCK_N = 32; at T = 17 experts share pairs (the per-pair grid must serve each expert once)."""
    args, ref = case("swiglu_oai", t, e=3, h=96, i=160, seed=t)
    assert_matches(PATHS[path](*args, block_n=32, block_k=64, **knobs), ref)


@interpreted
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("t", [1, 17])
def test_scaled_mode_matches_reference(path: str, t: int) -> None:
    """Mode "scaled" (tl.dot_scaled on the packed bytes) takes bf16 activations: against float64 on the
    same bf16 inputs, within the bf16 rounding of the intermediate h (a wrong nibble order, scale or
    mask gives errors of order 1). Masked edges as in test_variants_match_reference."""
    args, ref = case("swiglu_oai", t, e=3, h=96, i=160, seed=t)
    args[0] = args[0].bfloat16()
    rows = untile_rows(args[1])
    gate_up = dequantize_mxfp4(rows["gate_up_blocks"], rows["gate_up_scales"])
    down = dequantize_mxfp4(rows["down_blocks"], rows["down_scales"])
    ref = moe_reference(args[0].float(), gate_up, down, *args[2:6], "swiglu_oai", LIMIT, ALPHA)
    knobs = {"block_m": 16} if path == "grouped" else {"splits": 2}
    out = PATHS[path](*args, block_n=32, block_k=64, mode="scaled", **knobs)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err


@interpreted
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize(
    "t, block_n, groups, splits", [(1, 16, 2, 1), (3, 32, 4, 1), (5, 16, 1, 3), (1, 16, 2, 2), (1, 4, 32, 1)]
)
def test_gemv_matches_reference(activation: str, t: int, block_n: int, groups: int, splits: int) -> None:
    """The few-pairs GEMV path (its arithmetic decode; the inline PTX runs on the GPU only): H = 96 and
    I = 160 are 3 and 5 groups, so a step of 2 or 4 groups has a masked tail, and I is not a multiple of
    block_n; at T = 5 experts share pairs (each pair reads its expert again). The k parts (sum_k=False)
    are the fp32 [T, k, H] that add_rms_norm sums (with split-K, [T, k * splits, H]: bias counted once).
    Split-K 3 over 3 groups (H) and 5 (I) leaves programs with one group or none. 4 x 32: the default
    strips at one token, wider than the inputs."""
    args, ref = case(activation, t, e=3, h=96, i=160, seed=t)
    knobs = {"block_n": block_n, "groups": groups, "splits": splits}
    assert_matches(moe_mxfp4_gemv(*args, **knobs), ref)
    parts = moe_mxfp4_gemv(*args, **knobs, sum_k=False)
    assert parts.shape == (t, 2 * splits, 96) and parts.dtype == torch.float32
    assert_matches(parts.sum(1), ref)


@interpreted
def test_split_k_parts_sum_to_the_output() -> None:
    """sum_k=False with split-K: [T, k * splits, H] fp32 parts that add up to the summed output (the
    model's add_rms_norm sums them), the bias counted once."""
    args, ref = case("swiglu_oai", 3, e=3, h=96, i=160, seed=5)
    parts = moe_mxfp4_fused(*args, block_n=32, block_k=32, mode="split", splits=2, sum_k=False)
    assert parts.shape == (3, 2 * 2, 96) and parts.dtype == torch.float32
    assert_matches(parts.sum(1), ref)


@interpreted
def test_grouped_bf16_mode() -> None:
    """Dequantize once (the Triton kernel, equal to dequantize_mxfp4 bit for bit), then the grouped GEMM."""
    from minakv.ops.mxfp4_grouped import dequantize_mxfp4_bf16

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 7, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(10, 241, (3, 5, 7), dtype=torch.uint8, generator=gen)  # clear of bf16 subnormals
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            dequantize_mxfp4_bf16(blocks, scales, dtype), dequantize_mxfp4(blocks, scales, dtype)
        )
    args, ref = case("silu", 5, seed=1)
    assert_matches(moe_mxfp4_grouped(*args, mode="bf16"), ref)


@interpreted
def test_dequant_halves_are_exact() -> None:
    """The select-free decode of the split modes: every byte under every scale, even / odd halves (fp32:
    the interpreter garbles bitcasts to bf16; the GPU test checks both)."""
    check_dequant_exact("cpu", bf16=False, halves=True)


@interpreted
def test_moe_mxfp4_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the dequantize-and-loop reference; with Triton on CPU, pairs no more than the experts
    the GEMV, a few more the fused kernels and many (here: more than 4) the grouped GEMM; all agree."""
    from minakv.ops import triton_util

    args, ref = case("silu", 3, seed=3)
    one, ref_one = case("silu", 1, seed=4)  # 2 pairs, 4 experts
    assert_matches(moe_mxfp4(*args), ref)
    taken = []
    for name in ("moe_mxfp4_gemv", "moe_mxfp4_fused", "moe_mxfp4_grouped"):
        fn = getattr(mxfp4_moe, name)
        monkeypatch.setattr(
            mxfp4_moe, name, lambda *a, fn=fn, name=name, **kw: taken.append(name) or fn(*a, **kw)
        )
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    assert_matches(moe_mxfp4(*one), ref_one)
    assert_matches(moe_mxfp4(*args), ref)
    monkeypatch.setattr(mxfp4_moe, "FUSED_MAX_PAIRS", 4)
    assert_matches(moe_mxfp4(*args), ref)
    assert taken == ["moe_mxfp4_gemv", "moe_mxfp4_fused", "moe_mxfp4_grouped"]


def test_fp32_activations_stay_off_the_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled runs (the interpreter flag off, the kernels stubbed): 16-bit activations take the
    tensor-core GEMV and grouped GEMM, fp32 ones the CUDA-core GEMV and the fused kernels (fp32 dots), since
    the MMAs' fp16 inputs would cost them ~1e-3; and the router writes x in pair order only for the former."""
    from minakv.ops import triton_util

    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    monkeypatch.setattr(mxfp4_moe, "interpreting", lambda: False)
    taken = []
    monkeypatch.setattr(mxfp4_moe, "moe_mxfp4_gemv", lambda *a, mma, **kw: taken.append(("gemv", mma)))
    monkeypatch.setattr(mxfp4_moe, "moe_mxfp4_mma_grouped", lambda *a, **kw: taken.append("mma grouped"))
    monkeypatch.setattr(mxfp4_moe, "moe_mxfp4_fused", lambda *a, **kw: taken.append("fused"))
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 3):  # 2 pairs over 4 experts: the GEMV; 6: the grouped tensor-core GEMM if it may
            args, _ = case("silu", tokens, seed=tokens)
            moe_mxfp4(args[0].to(dtype), *args[1:])
    assert taken == [("gemv", True), "mma grouped", ("gemv", False), "fused"]
    x = torch.zeros(1, 64)
    assert mxfp4_moe.takes_pair_order(x.bfloat16(), 2, 4) and not mxfp4_moe.takes_pair_order(x, 2, 4)


def test_shapes_are_checked() -> None:
    args, _ = case("silu", 2)
    x, w = args[0], args[1]
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_mxfp4_ref(x[:, :48], *args[1:])
    bad = dict(w, down_blocks=w["down_blocks"][:, :, :1])  # I = 64 but down has 32 inputs
    with pytest.raises(ValueError, match="intermediate size"):
        moe_mxfp4_ref(x, bad, *args[2:])
    with pytest.raises(ValueError, match="lack"):
        moe_mxfp4_ref(x, {k: v for k, v in w.items() if k != "down_scales"}, *args[2:])
    with pytest.raises(ValueError, match="activation"):
        moe_mxfp4_ref(*args[:6], "gelu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bf16", [False, True])
def test_dequant_tile_is_exact_gpu(bf16: bool) -> None:
    check_dequant_exact("cuda", bf16)
    check_dequant_exact("cuda", bf16, halves=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_order(dtype: torch.dtype) -> None:
    """The tensor-core GEMV's activations: fp16, inputs 0 2 4 6 1 3 5 7 of each 8, saturated at fp16's max."""
    from minakv.ops.mxfp4_order import pair_order

    x = torch.randn(3, 2880).to(dtype)
    x[0, 5], x[2, 7] = 1e6, -1e6
    ref = x.float().view(3, 360, 4, 2).transpose(-1, -2).clamp(-65504, 65504).half().reshape(3, 2880)
    assert torch.equal(pair_order(x), ref)
    # gathered for the grouped kernels: row r is token order[r] // topk's, then zero rows
    order = torch.tensor([5, 0, 4, 1, 3, 2])  # pairs of 3 tokens x 2 slots, sorted by some expert order
    rows = pair_order(x, order, topk=2, pad=3)
    assert rows.shape == (9, 2880) and torch.equal(rows[:6], ref[order // 2]) and not rows[6:].any()


def test_tile_rows_layout() -> None:
    """tile_rows against its stated layout, byte by byte: row r, group j of expert e at
    e R G 16 + (r // 16) G 256 + j 256 + (r % 16) 16 (blocks), e R G + (r // 16) G 16 + j 16 + r % 16
    (scales), so a program's first row sits where the checkpoint's layout has it."""
    e, i, h = 2, 48, 96
    gen = torch.Generator().manual_seed(0)
    w = {
        "gate_up_blocks": torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=gen, dtype=torch.uint8),
        "gate_up_scales": torch.randint(0, 256, (e, 2 * i, h // 32), generator=gen, dtype=torch.uint8),
        "down_blocks": torch.randint(0, 256, (e, h, i // 32, 16), generator=gen, dtype=torch.uint8),
        "down_scales": torch.randint(0, 256, (e, h, i // 32), generator=gen, dtype=torch.uint8),
    }
    tiled = tile_rows(w)
    for name in ("gate_up", "down"):
        blocks, scales = w[f"{name}_blocks"], w[f"{name}_scales"]
        flat_b, flat_s = tiled[f"{name}_blocks"].reshape(-1), tiled[f"{name}_scales"].reshape(-1)
        assert tiled[f"{name}_blocks"].shape == blocks.shape and tiled[f"{name}_scales"].shape == scales.shape
        _, rows, groups, _ = blocks.shape
        for ex, r, j in [(ex, r, j) for ex in range(e) for r in range(rows) for j in range(groups)]:
            at = ex * rows * groups * 16 + (r // 16) * groups * 256 + j * 256 + (r % 16) * 16
            assert torch.equal(flat_b[at : at + 16], blocks[ex, r, j])
            assert flat_s[ex * rows * groups + (r // 16) * groups * 16 + j * 16 + r % 16] == scales[ex, r, j]
    with pytest.raises(ValueError, match="rows"):
        tile_rows(
            {
                **w,
                "gate_up_blocks": w["gate_up_blocks"][:, :80],
                "gate_up_scales": w["gate_up_scales"][:, :80],
            }
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "t, e, h, i",
    [(1, 3, 96, 160), (3, 4, 256, 72 * 32), (1, 2, 2880, 2880), (12, 3, 96, 160), (40, 4, 256, 512)],
)
def test_mma_gemv_gpu(t: int, e: int, h: int, i: int) -> None:
    """The tensor-core kernels (mxfp4_mma.py per pair, mxfp4_mma_grouped.py row x pair tiles; inline PTX:
    GPU only) against float64 on the dequantized weights, fp32 activations (cast to fp16 by them: exact
    for these inputs' range, so within fp32 summation error of the reference): 3 and 5 groups (tails of the
    unrolled step and of the warps' shares; H = 96 and I = 160 rows end inside a warp's rows, which then
    moves back), gpt-oss's 90 groups; 48 and 160 pairs over 3 and 4 experts (full and partial pair tiles)."""
    from minakv.ops.mxfp4_mma import moe_mxfp4_mma
    from minakv.ops.mxfp4_mma_grouped import fold_fits, moe_mxfp4_mma_grouped

    args, ref = case("swiglu_oai", t, e=e, h=h, i=i, seed=t + h)
    args = [
        a.cuda()
        if isinstance(a, torch.Tensor)
        else ({k: v.cuda() for k, v in a.items()} if isinstance(a, dict) else a)
        for a in args
    ]
    tol = {"rtol": 2e-3, "atol": 2e-3 * float(ref.abs().max())}
    for unroll, splits in ((4, (1, 1)), (8, (2, 3)), (4, (3, 4))):  # split-K 4 over 5 groups: one split empty
        parts = moe_mxfp4_mma(*args, sum_k=False, unroll=unroll, splits=splits)
        assert parts.shape == (t, 2 * splits[1], h) and parts.dtype == torch.float32
        torch.testing.assert_close(parts.sum(1).cpu().double(), ref, **tol)
    assert fold_fits(args[1])  # the folded scales' range: quantize_mxfp4 of unit-scale weights is inside
    for mr, nt, unroll, fold in (
        (4, 4, 2, False), (2, 1, 4, False), (2, 2, 1, False), (4, 8, 1, False), (2, 4, 2, True), (2, 1, 4, True),
    ):  # fmt: skip
        parts = moe_mxfp4_mma_grouped(*args, sum_k=False, mr=mr, nt=nt, unroll=unroll, fold=fold)
        assert parts.shape == (t, 2, h) and parts.dtype == torch.float32
        torch.testing.assert_close(parts.sum(1).cpu().double(), ref, **tol)


def real_shape(tokens: int, e: int = 32, h: int = 2880, i: int = 2880, k: int = 4, seed: int = 0):
    """gpt-oss-20b's experts at `tokens`, random packed bytes (in tiles, as their bytes are random) with
    scales near 2^-7 (weights ~0.02)."""
    gen = torch.Generator("cuda").manual_seed(seed)

    def rand_packed(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(
            0, 256, (e, out, inp // 32, 16), generator=gen, device="cuda", dtype=torch.uint8
        )
        scales = torch.randint(119, 123, (e, out, inp // 32), generator=gen, device="cuda", dtype=torch.uint8)
        return blocks, scales

    w = {}
    w["gate_up_blocks"], w["gate_up_scales"] = rand_packed(2 * i, h)
    w["down_blocks"], w["down_scales"] = rand_packed(h, i)
    x = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = route_softmax_topk(torch.randn(tokens, e, generator=gen, device="cuda"), k)
    biases = [(torch.randn(e, n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16) for n in (2 * i, h)]
    return x, w, weights, ids, *biases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_real_shape_gpu(tokens: int) -> None:
    """bf16 at the gpt-oss-20b expert shape (E=32, H=I=2880, top-4): each MXFP4 path, and the bf16 paths
    on the dequantized weights, against fp32 `moe_loop` on the same weights; MXFP4 within bf16's error.
    Also fp32 activations through the MXFP4 kernels (fp32 dots): near exact."""
    from minakv.ops.fused_moe import moe_fused
    from minakv.ops.moe import moe_grouped, moe_loop

    x, w, weights, ids, gub, db = real_shape(tokens)
    rows = untile_rows(w)
    gate_up = dequantize_mxfp4(rows["gate_up_blocks"], rows["gate_up_scales"], torch.float32)
    down = dequantize_mxfp4(rows["down_blocks"], rows["down_scales"], torch.float32)
    act = ("swiglu_oai", 7.0, 1.702)
    ref = moe_loop(x.float(), gate_up, down, weights, ids, gub.float(), db.float(), *act).double()

    def err(out: torch.Tensor) -> float:
        assert out.shape == ref.shape and torch.isfinite(out).all()
        return float((out.double() - ref).norm() / ref.norm())

    errs = {"mxfp4": err(moe_mxfp4(x, w, weights, ids, gub, db, *act))}
    errs["mxfp4 grouped"] = err(moe_mxfp4_grouped(x, w, weights, ids, gub, db, *act))
    errs["mxfp4 fp32"] = err(moe_mxfp4_grouped(x.float(), w, weights, ids, gub.float(), db.float(), *act))
    if tokens * 4 <= 1024:  # the fused kernels' id scan is sized for decode batches
        errs["mxfp4 fused"] = err(moe_mxfp4_fused(x, w, weights, ids, gub, db, *act))
        errs["mxfp4 fused fp32"] = err(
            moe_mxfp4_fused(x.float(), w, weights, ids, gub.float(), db.float(), *act)
        )
    if 32 < tokens * 4 <= 4096:  # the grouped tensor-core GEMM (what moe_mxfp4 takes here; GPU only)
        from minakv.ops.mxfp4_mma_grouped import moe_mxfp4_mma_grouped

        errs["mxfp4 mma grouped"] = err(moe_mxfp4_mma_grouped(x, w, weights, ids, gub, db, *act))
        errs["mxfp4 mma grouped fold"] = err(
            moe_mxfp4_mma_grouped(x, w, weights, ids, gub, db, *act, fold=True)
        )
    if tokens * 4 <= 32:  # the GEMV (what moe_mxfp4 takes here): its inline-PTX decode runs on the GPU only
        errs["mxfp4 gemv"] = err(moe_mxfp4_gemv(x, w, weights, ids, gub, db, *act))
        errs["mxfp4 gemv x in asm"] = err(moe_mxfp4_gemv(x, w, weights, ids, gub, db, *act, x_in_asm=True))
        errs["mxfp4 gemv mma"] = err(moe_mxfp4_gemv(x, w, weights, ids, gub, db, *act, mma=True))
        errs["mxfp4 gemv split-K fp32"] = err(
            moe_mxfp4_gemv(x.float(), w, weights, ids, gub.float(), db.float(), *act, splits=3)
        )
    gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    errs["bf16 grouped"] = err(moe_grouped(x, gate_up, down, weights, ids, gub, db, *act))
    if tokens * 4 <= 1024:
        errs["bf16 fused"] = err(moe_fused(x, gate_up, down, weights, ids, gub, db, *act))
    print(f"T={tokens} relative errors vs fp32: {errs}")
    bf16_err = max(v for name, v in errs.items() if name.startswith("bf16"))
    for name, v in errs.items():
        if name.endswith("fp32"):
            assert v < 1e-5, (name, v)
        elif name.startswith("mxfp4"):
            assert v < 1e-2 and v < 2 * bf16_err + 1e-3, (name, v, bf16_err)


def test_prefill_mode() -> None:
    """The prefill path dequantizes to bf16 once only with many pairs an expert and a small enough copy:
    gpt-oss-20b's 32 experts (1.6 GB in bf16) from 512 pairs an expert; never 120b's 128 (6.4 GB a layer),
    nor fp32 activations."""
    from minakv.ops.mxfp4_moe import prefill_mode

    def layer(e: int) -> dict[str, torch.Tensor]:
        return {
            "gate_up_blocks": torch.empty(e, 5760, 90, 16, dtype=torch.uint8, device="meta"),
            "down_blocks": torch.empty(e, 2880, 90, 16, dtype=torch.uint8, device="meta"),
        }

    x = torch.empty(1, 2880, dtype=torch.bfloat16, device="meta")
    assert prefill_mode(512 * 32, x, layer(32)) == "bf16"
    assert prefill_mode(512 * 32 - 1, x, layer(32)) == "scaled"
    assert prefill_mode(4096 * 128, x, layer(128)) == "scaled"
    assert prefill_mode(512 * 32, x.float(), layer(32)) == "scaled"


def test_grouped_config_folds_only_where_it_was_faster() -> None:
    """The tiles of the grouped tensor-core GEMM (measured, RESULTS.md): folded scales only from 13 pairs an
    expert and only where the layer allows it."""
    from minakv.ops.mxfp4_moe import grouped_config

    assert grouped_config(2, fold=True) == {"mr": 2, "nt": 1, "unroll": 2}
    assert grouped_config(8, fold=True) == {"mr": 2, "nt": 1, "unroll": 2}  # one pair tile holds them
    assert grouped_config(9) == {"mr": 2, "nt": 2, "unroll": 2}
    assert grouped_config(12, fold=True) == {"mr": 2, "nt": 2, "unroll": 2}
    assert grouped_config(64) == {"mr": 2, "nt": 4, "unroll": 2}
    assert grouped_config(32, fold=True) == {"mr": 2, "nt": 4, "unroll": 2, "fold": True}
    assert grouped_config(64, fold=True) == {"mr": 2, "nt": 8, "unroll": 1, "fold": True}
