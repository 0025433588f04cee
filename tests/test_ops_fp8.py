"""The FP8 (128x128 block-scaled) kernels, minakv/ops/fp8_linear.py, fp8_moe.py and fp8_grouped.py, against
float64 references on the dequantized weights: in Triton's CPU interpreter at small shapes with several scale
blocks and ragged edges (fp32 dots there), and on the GPU at MiniMax-M2's shapes in bf16 beside the bf16
paths on the same dequantized weights."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers.models import moe_reference
from helpers.triton import interpreted

from minakv.ops import fp8_moe
from minakv.ops.fp8_gemv import linear_fp8_gemv, moe_fp8_gemv
from minakv.ops.fp8_grouped import moe_fp8_grouped
from minakv.ops.fp8_linear import linear_fp8, linear_fp8_ref, linear_fp8_triton
from minakv.ops.fp8_moe import moe_fp8, moe_fp8_fused, moe_fp8_ref
from minakv.ops.fp8_tile import dequantize_experts, quantize_experts
from minakv.ops.moe import route_sigmoid_bias, route_softmax_topk
from minakv.ops.quant import dequantize_fp8_block, quantize_fp8_block

LIMIT, ALPHA = 1.0, 1.702  # a small limit so the clamps of swiglu_oai bite
PATHS = {
    "fused": moe_fp8_fused,
    "fused sorted": partial(moe_fp8_fused, sort=True),
    "grouped": moe_fp8_grouped,
}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def spread(*shape: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Random weights whose rows' magnitudes differ by up to 2^5, so the block scales differ."""
    octave = torch.randint(-4, 2, (*shape[:-1], 1), generator=gen, device=device).float()
    return torch.randn(*shape, generator=gen, device=device) * torch.exp2(octave)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


# ---- linear ----


def linear_case(t: int, out: int, inp: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight, scale = quantize_fp8_block(spread(out, inp, gen=gen))
    x = torch.randn(t, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    ref = x.double() @ dequantize_fp8_block(weight, scale).double().T
    return (x, weight, scale, b), ref + b.double() if bias else ref


@interpreted
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])  # whole blocks; ragged blocks both ways
@pytest.mark.parametrize("t", [1, 5, 33])
def test_linear_matches_reference(shape: tuple[int, int], t: int) -> None:
    """Whole K in one program and K split 3 ways (partials summed by the second kernel), BLOCK_K 64 and 128,
    BLOCK_N 64 (so 200 rows end in a partial tile inside a partial scale block), with and without bias."""
    args, ref = linear_case(t, *shape, seed=t, bias=shape[0] == 256)
    for split_k, block_k in ((1, 64), (3, 128)):
        assert_matches(linear_fp8_triton(*args, split_k=split_k, block_n=64, block_k=block_k), ref)


@interpreted
@pytest.mark.parametrize("shape", [(256, 384), (200, 320)])  # whole blocks; ragged scale blocks both ways
@pytest.mark.parametrize("t", [1, 3])
def test_linear_gemv_matches_reference(shape: tuple[int, int], t: int) -> None:
    """The few-rows GEMV: its chosen strip, and strips of 16 and 64 rows with 2 and 8 vectors a step (200 rows
    end inside a strip and inside a scale block; 320 inputs end inside a step)."""
    args, ref = linear_case(t, *shape, seed=t, bias=shape[0] == 256)
    assert_matches(linear_fp8_gemv(*args), ref)
    for block_n, groups in ((16, 2), (64, 8)):
        assert_matches(linear_fp8_gemv(*args, block_n=block_n, groups=groups), ref)


@interpreted
def test_linear_plan_defaults() -> None:
    """The planned tiles and split (interpreter: 4 'SMs'), at a decode and a prefill row count."""
    for t in (2, 80):
        args, ref = linear_case(t, 200, 640, seed=t)
        assert_matches(linear_fp8_triton(*args), ref)


@interpreted
def test_linear_tile_dequant_is_exact() -> None:
    """x = identity, so y = W^T: every finite e4m3 byte under several scales comes out exactly as
    dequantize_fp8_block has it."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(150 * 160 // 256 + 1)[: 150 * 160]
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    weight = codes.reshape(150, 160).view(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0**-10, 3.0], [0.7, 2.0**5]])
    y = linear_fp8_triton(torch.eye(160), weight, scale, block_n=64, block_k=32)
    assert torch.equal(y.T, dequantize_fp8_block(weight, scale))


@interpreted
def test_linear_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the reference; with Triton on CPU, up to GEMV_MAX_ROWS rows the GEMV, more the
    tensor-core kernel; leading dims are kept."""
    from minakv.ops import fp8_linear, triton_util

    (x, weight, scale, b), ref = linear_case(6, 256, 384, seed=1)
    x3, ref3 = x.view(2, 3, 384), ref.view(2, 3, 256)
    assert_matches(linear_fp8(x3, weight, scale, b), ref3)
    assert_matches(linear_fp8_ref(x3, weight, scale, b), ref3)
    taken = []
    for name in ("linear_fp8_gemv", "linear_fp8_triton"):
        fn = getattr(fp8_linear, name)
        monkeypatch.setattr(
            fp8_linear, name, lambda *a, fn=fn, name=name, **kw: taken.append(name) or fn(*a, **kw)
        )
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    assert_matches(linear_fp8(x3, weight, scale, b), ref3)
    assert_matches(linear_fp8(x3[:1, :1], weight, scale, b), ref3[:1, :1])
    assert taken == ["linear_fp8_triton", "linear_fp8_gemv"]


def test_linear_shapes_are_checked() -> None:
    (x, weight, scale, b), _ = linear_case(2, 256, 384, seed=0)
    with pytest.raises(ValueError, match="scales are"):
        linear_fp8_ref(x, weight, scale[:, :2], b)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        linear_fp8_ref(x, weight.float(), scale, b)
    with pytest.raises(ValueError, match="expected"):
        linear_fp8_triton(x[:, :128], weight, scale, b)


# ---- MoE ----


def moe_case(activation: str, t: int, e: int = 4, h: int = 320, i: int = 160, k: int = 2, seed: int = 0,
             biases: bool = False):  # fmt: skip
    """Inputs of moe_fp8 (H = 320 and I = 160: ragged scale blocks; gate/up halves with their own scale
    rows), and the float64 reference output on the dequantized weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w = {}
    w["gate_up"], w["gate_up_scale_inv"] = quantize_experts(spread(e, 2 * i, h, gen=gen) / 8, halves=True)
    w["down"], w["down_scale_inv"] = quantize_experts(spread(e, h, i, gen=gen) / 8)
    gate_up_bias = torch.randn(e, 2 * i, generator=gen) if biases else None
    down_bias = torch.randn(e, h, generator=gen) if biases else None
    if activation == "silu":  # MiniMax-M2's routing
        weights, ids = route_sigmoid_bias(torch.randn(t, e, generator=gen), torch.randn(e, generator=gen), k)
    else:
        weights, ids = route_softmax_topk(torch.randn(t, e, generator=gen), k)
    args = [x, w, weights, ids, gate_up_bias, down_bias, activation, LIMIT, ALPHA]
    gate_up = dequantize_experts(w["gate_up"], w["gate_up_scale_inv"], halves=True)
    down = dequantize_experts(w["down"], w["down_scale_inv"])
    ref = moe_reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation, LIMIT, ALPHA)
    return args, ref


@interpreted
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("t", [1, 5, 33])
def test_moe_paths_match_reference(path: str, t: int) -> None:
    """4 experts, top-2, SiLU; blocks smaller than the dims (and for grouped, 16 rows: an expert's rows
    take several tiles at T=33), so every masked edge and loop runs."""
    args, ref = moe_case("silu", t, seed=t)
    blocks = {"block_n": 32, "block_k": 64}  # (fused: the pairs scanned; fused sorted: from a counting sort)
    if path == "grouped":
        blocks["block_m"] = 16
    assert_matches(PATHS[path](*args, **blocks), ref)


@interpreted
@pytest.mark.parametrize("path", list(PATHS))
def test_moe_swiglu_with_biases(path: str) -> None:
    """GPT-OSS's activation and biases through the same kernels, BLOCK_K 128 (one step per scale block)."""
    args, ref = moe_case("swiglu_oai", 5, e=3, seed=7, biases=True)
    assert_matches(PATHS[path](*args, block_n=64, block_k=128), ref)


@interpreted
@pytest.mark.parametrize("activation, biases", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("t", [1, 5])
def test_moe_gemv_matches_reference(activation: str, biases: bool, t: int) -> None:
    """The few-pairs GEMV: a program per (pair, strip), at its chosen strips and at 16 rows x 4 vectors (H =
    320 and I = 160 end inside a scale block; at T = 5 experts share pairs); the k parts sum to the output."""
    args, ref = moe_case(activation, t, seed=t, biases=biases)
    assert_matches(moe_fp8_gemv(*args), ref)
    parts = moe_fp8_gemv(*args, block_n=16, groups=4, sum_k=False)
    assert parts.shape == (t, 2, 320) and parts.dtype == torch.float32
    assert_matches(parts.sum(1), ref)


@interpreted
def test_moe_fp8_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the dequantize-per-expert reference; with Triton on CPU, pairs no more than the
    experts (and than GEMV_MAX_PAIRS) the GEMV, a few more the fused kernels and many (here: more than 4) the grouped GEMM; all agree."""
    from minakv.ops import triton_util

    args, ref = moe_case("silu", 3, h=256, i=128, seed=3)
    one, ref_one = moe_case("silu", 1, h=256, i=128, seed=4)  # 2 pairs, 4 experts
    assert_matches(moe_fp8(*args), ref)
    taken = []
    for name in ("moe_fp8_gemv", "moe_fp8_fused", "moe_fp8_grouped"):
        fn = getattr(fp8_moe, name)
        monkeypatch.setattr(
            fp8_moe, name, lambda *a, fn=fn, name=name, **kw: taken.append(name) or fn(*a, **kw)
        )
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    assert_matches(moe_fp8(*one), ref_one)
    assert_matches(moe_fp8(*args), ref)
    monkeypatch.setattr(fp8_moe, "FUSED_MAX_PAIRS", 4)
    assert_matches(moe_fp8(*args), ref)
    assert taken == ["moe_fp8_gemv", "moe_fp8_fused", "moe_fp8_grouped"]


@interpreted
def test_moe_fp8_hands_its_k_parts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """sum_k=False (MiniMax-M2's MoE alone on its GPU): the GEMV and the fused kernels return the k weighted
    fp32 parts [T, k, H] for the next add_rms_norm to sum; the CPU reference and the grouped GEMM sum
    anyway. Every form agrees with float64."""
    from minakv.ops import triton_util

    args, ref = moe_case("silu", 3, h=256, i=128, seed=3)  # 6 pairs over 4 experts: the fused kernels
    one, ref_one = moe_case("silu", 1, h=256, i=128, seed=4)  # 2 pairs: the GEMV
    assert_matches(moe_fp8(*args, sum_k=False), ref)
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)
    for a, r in ((one, ref_one), (args, ref)):
        parts = moe_fp8(*a, sum_k=False)
        assert parts.shape == (r.shape[0], 2, r.shape[1]) and parts.dtype == torch.float32
        assert_matches(parts.sum(1), r)
    monkeypatch.setattr(fp8_moe, "FUSED_MAX_PAIRS", 4)
    assert_matches(moe_fp8(*args, sum_k=False), ref)


def test_moe_ref_and_quantize_round_trip() -> None:
    """The CPU reference with biases, and quantize_experts(dequantize_experts(q)) == q."""
    args, ref = moe_case("swiglu_oai", 4, seed=2, biases=True)
    assert_matches(moe_fp8_ref(*args), ref)
    w = args[1]
    back = quantize_experts(
        dequantize_experts(w["gate_up"], w["gate_up_scale_inv"], halves=True), halves=True
    )
    assert torch.equal(back[0].view(torch.uint8), w["gate_up"].view(torch.uint8))


def test_moe_shapes_are_checked() -> None:
    args, _ = moe_case("silu", 2, h=256, i=128)
    x, w = args[0], args[1]
    with pytest.raises(ValueError, match="x is"):
        moe_fp8_ref(x[:, :128], *args[1:])
    with pytest.raises(ValueError, match="gate_up_scale_inv"):
        moe_fp8_ref(x, dict(w, gate_up_scale_inv=w["gate_up_scale_inv"][:, :1]), *args[2:])
    with pytest.raises(ValueError, match="lack"):
        moe_fp8_ref(x, {k: v for k, v in w.items() if k != "down_scale_inv"}, *args[2:])
    with pytest.raises(ValueError, match="activation"):
        moe_fp8_ref(*args[:6], "gelu")


# ---- GPU, MiniMax-M2's shapes ----

LINEARS = {"q_proj": (6144, 3072), "k_proj": (1024, 3072), "v_proj": (1024, 3072), "o_proj": (3072, 6144)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_linear_real_shapes_gpu(tokens: int) -> None:
    """bf16 activations through linear_fp8 at each attention projection, against fp32 on the dequantized
    weights: within bf16's error (the bf16 F.linear on the same weights, rounded to bf16, sets the bar);
    fp32 activations (fp32 dots) near exact."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    for name, (out, inp) in LINEARS.items():
        weight, scale = quantize_fp8_block(torch.randn(out, inp, generator=gen, device="cuda") * 0.02)
        w32 = dequantize_fp8_block(weight, scale)
        x = torch.randn(tokens, inp, generator=gen, device="cuda").to(torch.bfloat16)
        ref = (x.double() @ w32.double().T).double()
        ours = rel_err(linear_fp8(x, weight, scale), ref)
        bf16 = rel_err(torch.nn.functional.linear(x, w32.to(torch.bfloat16)), ref)
        fp32 = rel_err(linear_fp8(x.float(), weight, scale), ref)
        gemv = rel_err(linear_fp8_gemv(x[:4], weight, scale), ref[:4])  # at tokens = 1, what linear_fp8 took
        asm = rel_err(linear_fp8_gemv(x[:4], weight, scale, x_in_asm=True), ref[:4])
        assert asm < 1e-2 and asm < 2 * bf16 + 1e-3, (name, asm, bf16)
        print(f"{name} T={tokens}: fp8 {ours:.2e}, bf16 {bf16:.2e}, fp8 fp32 {fp32:.2e}, gemv {gemv:.2e}")
        assert ours < 1e-2 and ours < 2 * bf16 + 1e-3, (name, ours, bf16)
        assert gemv < 1e-2 and gemv < 2 * bf16 + 1e-3, (name, gemv, bf16)
        assert fp32 < 1e-5, (name, fp32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_moe_real_shape_gpu(tokens: int) -> None:
    """MiniMax-M2's experts (E=256, top-8, H=3072, I=1536, SiLU, sigmoid routing) in bf16: each FP8 path and
    the bf16 paths on the dequantized weights, against fp32 moe_loop on the same weights."""
    from minakv.ops.fused_moe import moe_fused
    from minakv.ops.moe import moe_grouped, moe_loop

    e, k, h, i = 256, 8, 3072, 1536
    gen = torch.Generator("cuda").manual_seed(tokens)
    w = {}
    w["gate_up"], w["gate_up_scale_inv"] = quantize_experts(
        torch.randn(e, 2 * i, h, generator=gen, device="cuda") * 0.02, halves=True
    )
    w["down"], w["down_scale_inv"] = quantize_experts(
        torch.randn(e, h, i, generator=gen, device="cuda") * 0.02
    )
    x = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
    logits, bias = torch.randn(tokens, e, generator=gen, device="cuda"), torch.randn(e, device="cuda") * 0.1
    weights, ids = route_sigmoid_bias(logits, bias, k)
    gate_up = dequantize_experts(w["gate_up"], w["gate_up_scale_inv"], halves=True)
    down = dequantize_experts(w["down"], w["down_scale_inv"])
    ref = moe_loop(x.float(), gate_up, down, weights, ids).double()
    errs = {"fp8": rel_err(moe_fp8(x, w, weights, ids), ref)}
    errs["fp8 grouped"] = rel_err(moe_fp8_grouped(x, w, weights, ids), ref)
    errs["fp8 grouped fp32"] = rel_err(moe_fp8_grouped(x.float(), w, weights, ids), ref)
    if tokens * k <= 512:  # the fused kernels' id scan is sized for decode batches
        errs["fp8 fused"] = rel_err(moe_fp8_fused(x, w, weights, ids), ref)
        errs["fp8 fused fp32"] = rel_err(moe_fp8_fused(x.float(), w, weights, ids), ref)
    if tokens * k <= e:  # the GEMV (what moe_fp8 takes up to 16 pairs)
        errs["fp8 gemv"] = rel_err(moe_fp8_gemv(x, w, weights, ids), ref)
        errs["fp8 gemv fp32"] = rel_err(moe_fp8_gemv(x.float(), w, weights, ids), ref)
        errs["fp8 gemv x in asm"] = rel_err(moe_fp8_gemv(x, w, weights, ids, x_in_asm=True), ref)
    gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    if hasattr(torch.nn.functional, "grouped_mm"):
        errs["bf16 grouped"] = rel_err(moe_grouped(x, gate_up, down, weights, ids), ref)
    if tokens * k <= 512:
        errs["bf16 fused"] = rel_err(moe_fused(x, gate_up, down, weights, ids), ref)
    print(f"T={tokens} relative errors vs fp32: {errs}")
    bf16_err = max(v for name, v in errs.items() if name.startswith("bf16"))
    for name, v in errs.items():
        if name.endswith("fp32"):
            assert v < 1e-5, (name, v)
        elif name.startswith("fp8"):
            assert v < 1e-2 and v < 2 * bf16_err + 1e-3, (name, v, bf16_err)


@interpreted
def test_bench_tiny(tmp_path) -> None:
    """bench/bench_fp8.py --tiny runs (tiny shapes, the kernels interpreted) and writes its rows."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "bench_fp8.py"
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(script), "--tiny", "--tokens", "1", "--layers", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "fp8_tiny.json").read_text())
    names = [r["name"] for r in rows if r["kind"] == "bench"]
    assert any(n.startswith("linear q_proj") for n in names) and any(n.startswith("moe ") for n in names)
    assert any(n.startswith("decode step 1 layers") for n in names)
    assert all(r["err_vs_bf16"] < 1e-4 for r in rows if "err_vs_bf16" in r)
