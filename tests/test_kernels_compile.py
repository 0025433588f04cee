"""Every Triton kernel the engine launches compiles for the H200 (sm_90), with the argument types and
constexprs the engine passes, on this CPU-only machine.

The other kernel tests run in Triton's CPU interpreter, which accepts code the compiler rejects (a helper
with `return`s of different types across static `if` branches ran there and failed on the GPU). Here each
case drives real entry points on small CPU tensors with their Triton path forced; tests/helpers/
compile_cuda.py records every launch instead of running it and compiles each distinct variant down to a
cubin for GPUTarget("cuda", 90, 32). Shapes are small, but the dtypes, head sizes, flags and plans
(block sizes, splits sized for 132 SMs) are the engine's, so the constexprs are the ones the GPU sees.
A failure names the kernel variant and quotes the compiler.

The session has TRITON_INTERPRET=1 (tests/conftest.py), and Triton decides at import whether kernels are
interpreted, so the recording and compiling happen in one subprocess (its compiles forked over the cores),
its Triton cache in the session's private cache dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CASES: dict[str, Callable[[], None]] = {}


def case(name: str):
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CASES[name] = fn
        return fn

    return register


# The two families' attention shapes: (query heads, KV heads, head dim, rotary dim, windows, sinks).
GPT_OSS = {"heads": 64, "kv_heads": 8, "head_dim": 64, "rotary": 64, "windows": (128, None), "sinks": True}
MINIMAX = {"heads": 48, "kv_heads": 8, "head_dim": 128, "rotary": 64, "windows": (None,), "sinks": False}
FAMILIES = {"gpt_oss": GPT_OSS, "minimax": MINIMAX}


def _pool(shape: dict, dtype: torch.dtype, slots: int = 64, layers: int = 0) -> tuple[torch.Tensor, ...]:
    dims = (slots, shape["kv_heads"], shape["head_dim"])
    dims = (layers, *dims) if layers else dims
    return torch.randn(dims).to(dtype), torch.randn(dims).to(dtype)


def _sinks(shape: dict) -> torch.Tensor | None:
    return torch.randn(shape["heads"], dtype=torch.float32) if shape["sinks"] else None


def _decode(shape: dict, cache_dtype: torch.dtype) -> None:
    """As minakv/worker/paged.py calls it: key table rows (int32) from int64 starts and ends, ascending."""
    from minakv.ops.decode_attention import decode_attention

    batch, width = 3, 16
    k_cache, v_cache = _pool(shape, cache_dtype)
    q = torch.randn(batch, shape["heads"], shape["head_dim"]).to(BF16)
    kv_start = torch.arange(batch, dtype=torch.int64) * width
    kv_end = kv_start + torch.tensor([5, 16, 9])
    table_slots = torch.randint(0, 64, (batch * width,), dtype=torch.int32)
    table_pos = torch.arange(batch * width, dtype=torch.int32) % width
    q_pos = torch.full((batch,), width, dtype=torch.int64)
    # a short hint: one split; a long one: several; per-row splits (a CUDA graph's: no bound known)
    for window, max_kv_len in [(window, width + 1) for window in shape["windows"]] + [(None, 8192)]:
        decode_attention(q, k_cache, v_cache, kv_start, table_slots, table_pos, q_pos, 0.125, window,
                         _sinks(shape), max_kv_len=max_kv_len, kv_end=kv_end, ascending=True)  # fmt: skip
    for window in shape["windows"]:
        decode_attention(q, k_cache, v_cache, kv_start, table_slots, table_pos, q_pos, 0.125, window,
                         _sinks(shape), kv_end=kv_end, ascending=True, per_row_splits=33)  # fmt: skip


def _segments(shape: dict, cache_dtype: torch.dtype) -> None:
    """Two segments (one with context keys), with the plan built once, as paged.py does."""
    from minakv.ops.segment_attention import plan_segments, segment_attention

    k_cache, v_cache = _pool(shape, cache_dtype)
    q_lens = [5, 3]  # the second segment has 4 context keys
    q = torch.randn(sum(q_lens), shape["heads"], shape["head_dim"]).to(BF16)
    q_pos = torch.cat([torch.arange(5), torch.arange(4, 7)])
    q_slots = torch.arange(sum(q_lens), dtype=torch.int64)
    seg_q = torch.tensor([0, 5, 8])
    seg_kv = torch.tensor([0, 0, 4])
    kv_slots, kv_pos = torch.arange(20, 24), torch.arange(4)
    plan = plan_segments(q_pos, q_slots, seg_q, seg_kv, kv_slots, kv_pos, 5)
    for window in shape["windows"]:
        segment_attention(q, k_cache, v_cache, q_pos, q_slots, seg_q, seg_kv, kv_slots, kv_pos, 0.125, window,
                          _sinks(shape), max_seg_len=5, plan=plan)  # fmt: skip


def _rope(shape: dict):
    from minakv.ops.rope import Rope

    return Rope(shape["rotary"], 10000.0)


def _store(shape: dict, cache_dtype: torch.dtype) -> None:
    from minakv.ops.kv_store import rotate_and_store

    tokens = 4
    k_cache, v_cache = _pool(shape, cache_dtype)
    q = torch.randn(tokens, shape["heads"], shape["head_dim"]).to(BF16)
    k = torch.randn(tokens, shape["kv_heads"], shape["head_dim"]).to(BF16)
    cos, sin = _rope(shape).cos_sin(torch.arange(tokens))
    rotate_and_store(q, k, k.clone(), cos, sin, torch.arange(tokens), k_cache, v_cache)


def _rerotate(shape: dict, cache_dtype: torch.dtype) -> None:
    """As minakv/worker/worker.py calls it: all layers at once, int64 slots and positions."""
    from minakv.ops.rerotate import rerotate_copy

    k_cache, v_cache = _pool(shape, cache_dtype, layers=3)
    src, dst = torch.arange(6), torch.arange(10, 16)
    rerotate_copy(k_cache, v_cache, src, dst, torch.arange(6) + 4, torch.arange(6), _rope(shape))


for _family, _shape in FAMILIES.items():
    for _dtype, _tag in ((BF16, ""), (FP8, "-fp8kv")):
        for _name, _fn in (("decode", _decode), ("segments", _segments), ("store", _store),
                           ("rerotate", _rerotate)):  # fmt: skip
            CASES[f"{_name}-{_family}{_tag}"] = lambda fn=_fn, shape=_shape, dtype=_dtype: fn(shape, dtype)


@case("rms_norm")
def _rms_norm() -> None:
    """Hidden norms of both families (GPT-OSS weights in fp32), MiniMax's q / k norms over whole vectors."""
    from minakv.ops.norm import rms_norm

    for size, in_fp32 in ((2880, True), (3072, False), (48 * 128, False), (8 * 128, False)):
        rms_norm(torch.randn(2, size).to(BF16), torch.randn(size).to(BF16), 1e-5, in_fp32)


@case("rms_norm_two")
def _rms_norm_two() -> None:
    """MiniMax-M2's q and k norms in one launch, on views of the q/k/v product (strided rows)."""
    from minakv.ops.norm import rms_norm_two

    for tokens in (1, 64):
        q, k, _ = torch.randn(tokens, 6144 + 2 * 1024).to(BF16).split([6144, 1024, 1024], dim=-1)
        rms_norm_two(q, torch.randn(6144).to(BF16), k, torch.randn(1024).to(BF16), 1e-6, False)


@case("add_rms_norm")
def _add_rms_norm() -> None:
    """The residual add fused with the next norm, both families' ways of applying the weight."""
    from minakv.ops.norm import add_rms_norm

    for size, in_fp32 in ((2880, True), (3072, False)):
        x, update = torch.randn(2, size).to(BF16), torch.randn(2, size).to(BF16)
        add_rms_norm(x, update, torch.randn(size).to(BF16), 1e-5, in_fp32)
    # GPT-OSS decode: the MoE's four fp32 parts summed by the norm
    add_rms_norm(torch.randn(2, 2880).to(BF16), torch.randn(2, 4, 2880), torch.randn(2880), 1e-5, True)


@case("route_fused")
def _route_fused() -> None:
    """GPT-OSS routing: 20b's 32 experts and 120b's 128, decode batches 1 (one launch: the last split
    program finishes, an atomic counter) and 64 / 256 (two launches); at one token also writing x in pair
    order (the tensor-core GEMV's input)."""
    from minakv.ops.routing import route_softmax_topk_fused

    for tokens, experts in ((1, 32), (1, 128), (256, 32), (64, 128)):
        weight, bias = torch.randn(experts, 2880).to(BF16), torch.randn(experts).to(BF16)
        pair_out = torch.empty(tokens, 2880, dtype=torch.float16) if tokens == 1 else None
        route_softmax_topk_fused(torch.randn(tokens, 2880).to(BF16), weight, bias, 4, pair_out)


@case("route_sigmoid_fused")
def _route_sigmoid_fused() -> None:
    """MiniMax-M2's routing in the same one or two launches: 256 experts, top-8, its fp32 correction bias."""
    from minakv.ops.routing import route_sigmoid_bias_fused

    for tokens in (1, 64):
        weight = torch.randn(256, 3072).to(BF16)
        route_sigmoid_bias_fused(torch.randn(tokens, 3072).to(BF16), weight, torch.randn(256), 8)


def _routing(tokens: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from minakv.ops.moe import route_softmax_topk

    return route_softmax_topk(torch.randn(tokens, experts), k)


def _bf16_experts(experts: int, hidden: int, inter: int, bias: bool):
    gate_up = torch.randn(experts, 2 * inter, hidden).to(BF16)
    down = torch.randn(experts, hidden, inter).to(BF16)
    biases = (
        (torch.randn(experts, 2 * inter).to(BF16), torch.randn(experts, hidden).to(BF16))
        if bias
        else (None,) * 2
    )
    return gate_up, down, *biases


@case("moe_fused")
def _moe_fused() -> None:
    """The bf16 decode MoE: scan (few pairs) and sorted, each plain and swap_ab; both activations."""
    from minakv.ops.fused_moe import moe_fused

    for tokens, activation, bias in ((2, "swiglu_oai", True), (40, "silu", False), (256, "silu", False)):
        gate_up, down, gub, db = _bf16_experts(32, 256, 128, bias)
        weights, ids = _routing(tokens, 32, 4)
        x = torch.randn(tokens, 256).to(BF16)
        for swap_ab in (False, True):
            moe_fused(x, gate_up, down, weights, ids, gub, db, activation, swap_ab=swap_ab)


@case("moe_dispatch")
def _moe_dispatch() -> None:
    """minakv.ops.moe.moe as the bf16 models call it (the fused path for a decode batch)."""
    from minakv.ops.moe import moe

    gate_up, down, gub, db = _bf16_experts(32, 256, 128, True)
    weights, ids = _routing(8, 32, 4)
    moe(torch.randn(8, 256).to(BF16), gate_up, down, weights, ids, gub, db, "swiglu_oai")


def _mxfp4_layer(tokens: int, experts: int = 32, hidden: int = 256, inter: int = 128):
    """GPT-OSS's MoE in MXFP4: swiglu_oai with biases, top-4 (compiled only: the bytes' layout does not matter)."""
    from minakv.ops.quant import quantize_mxfp4

    w = {}
    w["gate_up_blocks"], w["gate_up_scales"] = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden))
    w["down_blocks"], w["down_scales"] = quantize_mxfp4(torch.randn(experts, hidden, inter))
    weights, ids = _routing(tokens, experts, 4)
    biases = torch.randn(experts, 2 * inter).to(BF16), torch.randn(experts, hidden).to(BF16)
    return torch.randn(tokens, hidden).to(BF16), w, weights, ids, *biases, "swiglu_oai"


@case("mxfp4_dispatch")
def _mxfp4_dispatch() -> None:
    """moe_mxfp4 as the model calls it: fused at decode, grouped (its default mode) at prefill."""
    from minakv.ops.mxfp4_moe import moe_mxfp4

    for tokens in (4, 160):
        moe_mxfp4(*_mxfp4_layer(tokens))


def _mxfp4_fused_mode(mode: str) -> None:
    from minakv.ops.mxfp4_moe import moe_mxfp4_fused

    for slots in ("experts", "pairs"):
        moe_mxfp4_fused(*_mxfp4_layer(2), mode=mode, slots=slots)


def _mxfp4_grouped_mode(mode: str) -> None:
    from minakv.ops.mxfp4_grouped import dequantize_mxfp4_bf16, moe_mxfp4_grouped

    args = _mxfp4_layer(160)
    if mode == "bf16":  # its only kernel: the bf16 grouped GEMM after it is torch's (CUDA only)
        dequantize_mxfp4_bf16(args[1]["gate_up_blocks"], args[1]["gate_up_scales"], BF16)
    else:
        moe_mxfp4_grouped(*args, mode=mode)


def _mxfp4_modes() -> tuple[str, ...]:
    from minakv.ops.mxfp4_tile import MODES

    return tuple(MODES)


@case("mxfp4_gemv")
def _mxfp4_gemv() -> None:
    """The few-pairs GEMV path with its inline-PTX decode: the defaults, a wider step, split-K."""
    from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv

    moe_mxfp4_gemv(*_mxfp4_layer(1))
    moe_mxfp4_gemv(*_mxfp4_layer(2), block_n=32, groups=16, sum_k=False)
    moe_mxfp4_gemv(*_mxfp4_layer(1), splits=3, sum_k=False)
    moe_mxfp4_gemv(*_mxfp4_layer(1), block_n=1, groups=32, num_warps=1)  # a row a program, one warp
    moe_mxfp4_gemv(*_mxfp4_layer(1), x_in_asm=True)  # the PTX loads the activations
    moe_mxfp4_gemv(*_mxfp4_layer(1), block_n=4, groups=32, x_in_asm=True)  # the default at one token


@case("mxfp4_mma")
def _mxfp4_mma() -> None:
    """The tensor-core GEMV in inline PTX (mma.sync, its loop and labels): PTX that ptxas must accept."""
    from minakv.ops.mxfp4_mma import moe_mxfp4_mma

    moe_mxfp4_mma(*_mxfp4_layer(1))
    moe_mxfp4_mma(*_mxfp4_layer(1, hidden=96, inter=160), sum_k=False, unroll=8)  # 3 and 5 groups: tails
    moe_mxfp4_mma(*_mxfp4_layer(1), sum_k=False, splits=(2, 3))  # split-K: partials, the pair-order finish


@case("mxfp4_mma_grouped")
def _mxfp4_mma_grouped() -> None:
    """The grouped tensor-core GEMM: PTX generated per shape (tiles, unrolled steps and their tail)."""
    from minakv.ops.mxfp4_mma_grouped import moe_mxfp4_mma_grouped

    moe_mxfp4_mma_grouped(*_mxfp4_layer(16), sum_k=False)
    moe_mxfp4_mma_grouped(*_mxfp4_layer(16, hidden=96, inter=160), sum_k=False, mr=2, nt=1, unroll=4)
    moe_mxfp4_mma_grouped(
        *_mxfp4_layer(16), sum_k=False, mr=2, nt=4, unroll=2, fold=True
    )  # scales in the MMA's A


@case("mxfp4_fused-split_k")
def _mxfp4_fused_split_k() -> None:
    """Split-K: the kernels' partial-sum stores and the gate/up finishing kernel."""
    from minakv.ops.mxfp4_moe import moe_mxfp4_fused

    for mode in ("scaled", "split"):
        moe_mxfp4_fused(*_mxfp4_layer(2), mode=mode, splits=2, sum_k=False)


for _mode in _mxfp4_modes():
    CASES[f"mxfp4_fused-{_mode}"] = lambda mode=_mode: _mxfp4_fused_mode(mode)
for _mode in (*_mxfp4_modes(), "bf16"):
    CASES[f"mxfp4_grouped-{_mode}"] = lambda mode=_mode: _mxfp4_grouped_mode(mode)


@case("linear_fp8")
def _linear_fp8() -> None:
    """MiniMax-M2's FP8 projections: decode rows (K split over the SMs, then summed) and prefill rows."""
    from minakv.ops.fp8_linear import linear_fp8
    from minakv.ops.quant import quantize_fp8_block

    weight, scale_inv = quantize_fp8_block(torch.randn(384, 1024))
    for rows in (1, 8, 200):
        linear_fp8(torch.randn(rows, 1024).to(BF16), weight, scale_inv)


@case("fp8_gemv-x_in_asm")
def _fp8_gemv_x_in_asm() -> None:
    """The FP8 GEMVs with the PTX block that loads and dots each 16-byte vector itself."""
    from minakv.ops.fp8_gemv import linear_fp8_gemv, moe_fp8_gemv
    from minakv.ops.fp8_tile import quantize_experts
    from minakv.ops.quant import quantize_fp8_block

    weight, scale_inv = quantize_fp8_block(torch.randn(384, 1024))
    linear_fp8_gemv(torch.randn(1, 1024).to(BF16), weight, scale_inv, x_in_asm=True)
    experts, hidden, inter = 32, 384, 256
    w = {}
    w["gate_up"], w["gate_up_scale_inv"] = quantize_experts(
        torch.randn(experts, 2 * inter, hidden), halves=True
    )
    w["down"], w["down_scale_inv"] = quantize_experts(torch.randn(experts, hidden, inter))
    weights, ids = _routing(2, experts, 8)
    moe_fp8_gemv(torch.randn(2, hidden).to(BF16), w, weights, ids, x_in_asm=True)


@case("moe_fp8")
def _moe_fp8() -> None:
    """MiniMax-M2's FP8 MoE (silu, no biases; top-8): fused at decode (ids scanned or sorted), grouped at
    prefill; and with biases."""
    from minakv.ops.fp8_moe import moe_fp8
    from minakv.ops.fp8_tile import quantize_experts

    experts, hidden, inter = 32, 384, 256
    w = {}
    w["gate_up"], w["gate_up_scale_inv"] = quantize_experts(
        torch.randn(experts, 2 * inter, hidden), halves=True
    )
    w["down"], w["down_scale_inv"] = quantize_experts(torch.randn(experts, hidden, inter))
    for tokens in (4, 16, 80):  # fused (ids scanned), fused (sorted first), grouped
        weights, ids = _routing(tokens, experts, 8)
        moe_fp8(torch.randn(tokens, hidden).to(BF16), w, weights, ids, activation="silu")
    gub, db = torch.randn(experts, 2 * inter).to(BF16), torch.randn(experts, hidden).to(BF16)
    for tokens in (4, 80):
        weights, ids = _routing(tokens, experts, 8)
        moe_fp8(torch.randn(tokens, hidden).to(BF16), w, weights, ids, gub, db, "swiglu_oai")


@case("pdl")
def _pdl() -> None:
    """The kernels that take programmatic dependent launch (EngineConfig.pdl), with it on: their gdc_wait /
    gdc_launch_dependents and Triton's launch_pdl option, at batch 1 as the decode step runs them."""
    from minakv.ops import triton_util
    from minakv.ops.fp8_gemv import linear_fp8_gemv, moe_fp8_gemv
    from minakv.ops.fp8_tile import quantize_experts
    from minakv.ops.mxfp4_mma import moe_mxfp4_mma
    from minakv.ops.norm import add_rms_norm, rms_norm
    from minakv.ops.quant import quantize_fp8_block
    from minakv.ops.routing import route_sigmoid_bias_fused, route_softmax_topk_fused

    triton_util.PDL = True  # (the recorder launches nothing: no device needed)
    try:
        rms_norm(torch.randn(1, 2880).to(BF16), torch.randn(2880), 1e-5)
        add_rms_norm(torch.randn(1, 2880).to(BF16), torch.randn(1, 4, 2880), torch.randn(2880), 1e-5)
        route_softmax_topk_fused(torch.randn(1, 2880).to(BF16), torch.randn(32, 2880).to(BF16), None, 4)
        route_sigmoid_bias_fused(torch.randn(1, 3072).to(BF16), torch.randn(256, 3072).to(BF16),
                                 torch.randn(256), 8)  # fmt: skip
        moe_mxfp4_mma(*_mxfp4_layer(1), sum_k=False)  # (and the pair-order kernel before it)
        _store(GPT_OSS, BF16)
        _decode(GPT_OSS, BF16)
        weight, scale_inv = quantize_fp8_block(torch.randn(384, 1024))
        for asm in (False, True):
            linear_fp8_gemv(torch.randn(1, 1024).to(BF16), weight, scale_inv, x_in_asm=asm)
        w = {}
        w["gate_up"], w["gate_up_scale_inv"] = quantize_experts(torch.randn(32, 512, 384), halves=True)
        w["down"], w["down_scale_inv"] = quantize_experts(torch.randn(32, 384, 256))
        weights, ids = _routing(1, 32, 8)
        moe_fp8_gemv(torch.randn(1, 384).to(BF16), w, weights, ids)
        _bf16_gemv()
    finally:
        triton_util.PDL = False


@case("bf16_gemv")
def _bf16_gemv() -> None:
    """The one-row bf16 GEMV at gpt-oss's q/k/v and o_proj shapes, with their biases."""
    from minakv.ops.bf16_gemv import linear_gemv

    for out, inp in ((5120, 2880), (2880, 4096)):
        linear_gemv(torch.randn(1, inp).to(BF16), torch.randn(out, inp).to(BF16), torch.randn(out).to(BF16))


@case("sampling")
def _sampling() -> None:
    """The sampler's kernels (minakv/worker/sampler.py): Gumbel argmax with and without a threshold, top-p."""
    from minakv.ops.sampling import gumbel_argmax_triton
    from minakv.ops.top_p import top_p_threshold_triton

    rows, vocab = 3, 201088
    z = torch.randn(rows, vocab)
    key = torch.randint(0, 2**32, (rows,), dtype=torch.int64)
    thr = torch.full((rows, 1), float("-inf"))
    gumbel_argmax_triton(z, key, None)
    gumbel_argmax_triton(z, key, thr)
    gumbel_argmax_triton(z, key, None, shift=z.amax(-1, keepdim=True), temperature=torch.full((rows,), 0.7))
    top_p_threshold_triton(z, thr, torch.full((rows,), 0.9), splits=1)
    top_p_threshold_triton(z, thr, torch.full((rows,), 0.9), splits=8)


@pytest.fixture(scope="module")
def compiled(minakv_cache: Path) -> dict[str, list[dict]]:
    """Record and compile every case once, in a subprocess without the interpreter."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(minakv_cache / "triton-sm90")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    helper = Path(__file__).parent / "helpers" / "compile_cuda.py"
    results = minakv_cache / "kernels-compile.json"
    command = [sys.executable, str(helper), str(results), Path(__file__).stem]
    proc = subprocess.run(command, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the compile helper failed:\n{proc.stderr[-5000:]}"
    out = json.loads(results.read_text())
    if "skip" in out:
        pytest.skip(out["skip"])
    return out["results"]


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_compile_for_sm90(compiled: dict[str, list[dict]], name: str) -> None:
    results = compiled[name]
    assert results, f"{name} launched no Triton kernel: its driver no longer reaches the Triton path"
    failures = [f"{r['kernel']}\n{r['error']}" for r in results if r["error"]]
    if failures:
        pytest.fail(f"{len(failures)} of {len(results)} kernel variants failed:\n\n" + "\n\n".join(failures),
                    pytrace=False)  # fmt: skip
