"""The MXFP4 MoE kernels (minakv/ops/mxfp4_moe.py, mxfp4_grouped.py) on the GPU, at the expert shapes of
gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts), top-4, hidden = intermediate = 2880, bf16
activations, biases, the clamped SwiGLU; against the bf16 paths (`moe_fused`, `moe_grouped`) on the
dequantized weights.

Each path is timed as a CUDA-graph replay (as the engine runs decode), at T = 1, 64, 256 and 4096 tokens.
The bytes figure counts the weights a path must read: (distinct experts routed to) x (one expert's packed
bytes: nibbles + scales + biases), or its bf16 bytes for the bf16 paths, over this run's copy bandwidth.
At decode that is the ceiling; at 4096 tokens the GEMMs are compute bound and TFLOP/s is the figure.

    python bench/bench_mxfp4.py [--sweep] [--shapes 20b,120b] [--tokens 1,64,256,4096]
    python bench/bench_mxfp4.py --tiny      (CPU smoke run: the Triton interpreter at tiny shapes)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--tiny" in sys.argv:  # before anything imports Triton: kernels run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from common import Log, bench_ms, copy_bandwidth, rel_err

from minakv.ops.fused_moe import moe_fused
from minakv.ops.moe import moe_grouped, moe_loop, route_softmax_topk
from minakv.ops.mxfp4_grouped import moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import tile
from minakv.ops.mxfp4_moe import FUSED_MAX_PAIRS, moe_mxfp4, moe_mxfp4_fused
from minakv.ops.quant import dequantize_mxfp4

K, H, I = 4, 2880, 2880
SHAPES = {"20b": 32, "120b": 128}  # experts
TOKENS = (1, 64, 256, 4096)
FUSED_UP_TO = 1024  # pairs: the fused kernels' id scan is sized for decode batches
ACT = ("swiglu_oai", 7.0, 1.702)
FUSED_SWEEP = [  # (block_n, block_k, num_warps, num_stages)
    (n, k, w, s) for n in (16, 32, 64) for k in (128, 256, 512) for w, s in ((4, 3), (8, 3))
]
GROUPED_SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (m, n, k, w, s)
    for m, n in ((64, 128), (128, 64), (128, 128))
    for k in (64, 128)
    for w, s in ((4, 3), (8, 3))
]


def make_layer(experts: int, tokens: int, h: int = H, i: int = I, k: int = K, device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16, seed: int = 0):  # fmt: skip
    """Random packed experts (uniform nibbles, scales 2^-8 .. 2^-5: weights ~0.02; read as the tiles the
    kernels take, minakv/ops/mxfp4_layout.py) and a routed batch."""
    gen = torch.Generator(device).manual_seed(seed)

    def packed(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (experts, out, inp // 32)
        blocks = torch.randint(0, 256, (*shape, 16), generator=gen, device=device, dtype=torch.uint8)
        return blocks, torch.randint(119, 123, shape, generator=gen, device=device, dtype=torch.uint8)

    w = {}
    w["gate_up_blocks"], w["gate_up_scales"] = packed(2 * i, h)
    w["down_blocks"], w["down_scales"] = packed(h, i)
    x = torch.randn(tokens, h, generator=gen, device=device).to(dtype)
    weights, ids = route_softmax_topk(torch.randn(tokens, experts, generator=gen, device=device), k)
    biases = [(torch.randn(experts, n, generator=gen, device=device) * 0.1).to(dtype) for n in (2 * i, h)]
    return x, w, weights, ids, *biases


def dequantized(w: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) in dtype from the tiles, one expert at a time (the fp32/int64 temporaries of a whole
    120b layer would take tens of GB)."""

    def one(name: str) -> torch.Tensor:
        blocks, scales = w[name + "_blocks"], w[name + "_scales"]
        rows = [tile(blocks[e], scales[e], back=True) for e in range(blocks.shape[0])]
        return torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in rows])

    return one("gate_up"), one("down")


def expert_bytes(h: int, i: int, packed: bool) -> int:
    """Bytes of one expert's weights and (bf16) biases."""
    weights = 3 * h * i
    return (weights // 2 + weights // 32 if packed else 2 * weights) + (2 * i + h) * 2


def graph_ms(fn) -> float:
    """Median time of one replay of fn captured in a CUDA graph."""
    for _ in range(3):  # compile and settle the allocator outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def wall_ms(fn, reps: int = 2) -> float:
    """The --tiny timer: wall time of a call after one warm-up (the interpreter: only a smoke figure)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def check(log: Log, tiny: bool = False) -> None:
    """Each MXFP4 path and the bf16 paths against fp32 `moe_loop` on the dequantized weights."""
    cases = [(4, 1), (4, 17)] if tiny else [(32, 1), (32, 256), (32, 4096), (128, 64)]
    for experts, tokens in cases:
        kw = {"h": 64, "i": 64, "k": 2, "device": "cpu", "dtype": torch.float32} if tiny else {}
        x, w, weights, ids, gub, db = make_layer(experts, tokens, **kw)
        gate_up, down = dequantized(w, torch.float32)
        ref = moe_loop(x.float(), gate_up, down, weights, ids, gub.float(), db.float(), *ACT)
        paths = {"moe_mxfp4": moe_mxfp4, "mxfp4 grouped": moe_mxfp4_grouped}
        if ids.numel() <= FUSED_UP_TO:
            paths["mxfp4 fused"] = moe_mxfp4_fused
        tol = 1e-5 if tiny else 1e-2
        for name, fn in paths.items():
            err = rel_err(fn(x, w, weights, ids, gub, db, *ACT), ref)
            log.add("check", name=f"{name} E={experts} T={tokens} vs fp32 loop", err=err, tol=tol)
        if not tiny:
            gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
            err = rel_err(moe_grouped(x, gate_up, down, weights, ids, gub, db, *ACT), ref)
            log.add("check", name=f"bf16 grouped E={experts} T={tokens} vs fp32 loop", err=err, tol=tol)
        del gate_up, down


def bench(log: Log, copy_bw: float, sweep: bool = False, shapes=SHAPES, tokens_list=TOKENS,
          tiny: bool = False) -> None:  # fmt: skip
    for shape, experts in shapes.items():
        layer = make_layer(experts, max(tokens_list), **tiny_kw(tiny))
        bf16 = dequantized(layer[1], layer[0].dtype)
        for tokens in tokens_list:
            bench_one(log, copy_bw, shape, experts, tokens, layer, bf16, sweep, tiny)
        del layer, bf16
        if not tiny:
            torch.cuda.empty_cache()


def tiny_kw(tiny: bool) -> dict:
    return {"h": 64, "i": 64, "k": 2, "device": "cpu", "dtype": torch.float32} if tiny else {}


def bench_one(log: Log, copy_bw: float, shape: str, experts: int, tokens: int, layer, bf16, sweep: bool,
              tiny: bool) -> None:  # fmt: skip
    x, w, weights, ids, gub, db = layer
    x, weights, ids = x[:tokens], weights[:tokens], ids[:tokens]
    h, i = x.shape[1], w["down_blocks"].shape[2] * 32
    touched = int(torch.unique(ids).numel())
    flops = 2 * ids.numel() * 3 * h * i
    timer = wall_ms if tiny else graph_ms

    def row(name: str, fn, packed: bool, headline: bool = True, **extra) -> float:
        ms = timer(fn)
        need = touched * expert_bytes(h, i, packed)
        bw = need / (ms * 1e-3)
        frac = bw / copy_bw if copy_bw else 0.0
        log.add("bench", name=f"{shape} T={tokens} ({touched} experts) {name}", ms=ms, headline=headline,
                figure=f"{bw / 1e12:.2f} TB/s = {frac:.1%} of copy bw, {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s",
                frac_copy=frac, bytes=need, tokens=tokens, experts=experts, **extra)  # fmt: skip
        return ms

    args = (x, w, weights, ids, gub, db, *ACT)
    bf16_args = (x, *bf16, weights, ids, gub, db, *ACT)
    times = {"mxfp4 grouped": row("mxfp4 grouped", lambda: moe_mxfp4_grouped(*args), True)}
    times["bf16 grouped"] = row("bf16 grouped_mm", lambda: moe_grouped(*bf16_args), False)
    if ids.numel() <= FUSED_UP_TO:
        times["mxfp4 fused"] = row("mxfp4 fused", lambda: moe_mxfp4_fused(*args), True)
        times["bf16 fused"] = row("bf16 fused", lambda: moe_fused(*bf16_args), False)
    picked = "fused" if ids.numel() <= FUSED_MAX_PAIRS else "grouped"
    mxfp4 = min(v for name, v in times.items() if name.startswith("mxfp4"))
    best_bf16 = min(v for name, v in times.items() if name.startswith("bf16"))
    if tiny:  # interpreter times say nothing about the kernels
        return
    log.add("verdict", name=f"{shape} T={tokens}: best bf16 / best mxfp4 time (moe_mxfp4 takes {picked})",
            value=best_bf16 / mxfp4, need=1.0, met=best_bf16 >= mxfp4)  # fmt: skip
    if sweep and ids.numel() <= FUSED_UP_TO:
        for n, k, nw, ns in FUSED_SWEEP:
            cfg = {"block_n": n, "block_k": k, "num_warps": nw, "num_stages": ns}
            try_row(log, row, f"mxfp4 fused {cfg}", lambda cfg=cfg: moe_mxfp4_fused(*args, **cfg), cfg)
    if sweep and tokens >= 256:
        for m, n, k, nw, ns in GROUPED_SWEEP:
            cfg = {"block_m": m, "block_n": n, "block_k": k, "num_warps": nw, "num_stages": ns}
            try_row(log, row, f"mxfp4 grouped {cfg}", lambda cfg=cfg: moe_mxfp4_grouped(*args, **cfg), cfg)


def try_row(log: Log, row, name: str, fn, cfg: dict) -> None:
    try:
        row(name, fn, True, headline=False, **cfg)
    except Exception as exc:  # noqa: BLE001 (a config that does not fit: report and go on)
        log.add("error", name=name, trace=repr(exc)[:300])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (Triton interpreter, tiny shapes)")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of block configs")
    parser.add_argument("--shapes", default="20b,120b")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    log = Log()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.tiny:
        torch.set_num_threads(1)
        shapes, tokens, bw = {"tiny": 4}, (1, 3), 0.0
    else:
        bw = copy_bandwidth()
        log.add("bench", name="copy bandwidth 2 GiB", ms=0.0, figure=f"{bw / 1e12:.2f} TB/s", headline=True)
    if not args.no_check:
        check(log, args.tiny)
    bench(log, bw, args.sweep, shapes, tokens, args.tiny)
    log.table()
    log.save("mxfp4.json")


if __name__ == "__main__":
    main()
