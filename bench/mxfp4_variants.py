"""Variants of the MXFP4 (W4A16) MoE kernels on the GPU, side by side: which to make the default.

For gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts), hidden = intermediate = 2880, top-4, biases,
the clamped SwiGLU, bf16 activations, at T = 1, 8, 64, 256, 1024, 4096 tokens it runs

    fused baseline        moe_mxfp4_fused in mode "split" (two dots on the even / odd halves, dequantized in
                          registers: the default until "scaled"); "fused default": its defaults
    fused <mode> ...      tile modes of mxfp4_tile.MODES ("scaled": tl.dot_scaled on the packed bytes) with
                          the per-pair grid (slots=auto) and a few block shapes    (T <= 64, and T = 256)
    gemv bn.. g.. w..     mxfp4_gemv: a GEMV per pair on the CUDA cores (T <= 16); "x-in-asm": the PTX
                          block loads the activations itself (no layout change); "mma u4/u8": the
                          tensor-core GEMV of mxfp4_mma.py (inline-PTX mma.sync), 4 or 8 groups a step;
                          "mma grouped": mxfp4_mma_grouped.py (row x pair tiles a warp, T >= 8);
                          "stream-only" (T = 64):
                          its weight reads alone, no decode nor math (a ceiling for its access pattern)
    fused ... split-K k   K split over k programs per output block (partial sums, then a finishing pass)
    grouped baseline      moe_mxfp4_grouped in mode "split"; "grouped default": its defaults   (T >= 256)
    grouped scaled        tl.dot_scaled tiles at a few block shapes ("interleave", "swap" and "fma",
                          slower everywhere in earlier runs, are left to the tests)
    bf16 fused / grouped  minakv.ops' bf16 paths on the dequantized weights (the bar to beat)

Each is checked against fp32 `moe_loop` on the dequantized weights (relative error, flagged above 1e-2)
and timed as a CUDA-graph replay (CUDA events, median, after warm-up; do_bench flushes L2 in between, so
the weights come from HBM as in a real layer). GB/s counts the bytes a path must read: distinct experts
routed to x one expert's bytes (packed for MXFP4, bf16 for the bf16 paths), over the copy bandwidth of a
1 GiB torch copy in the same run. A variant that fails to compile or run prints its error and the run goes
on; past --budget-s the remaining variants are skipped (the whole run is meant to take < 3 minutes).

    python bench/mxfp4_variants.py [--shapes 20b,120b] [--tokens 1,8,64,256,1024,4096] [--only split]
                                   [--out PATH]   (default $OUT/mxfp4_variants.json when $OUT is set)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mxfp4 import ACT, SHAPES, dequantized, expert_bytes, make_layer
from common import copy_bandwidth, rel_err

from minakv.ops.fused_moe import moe_fused
from minakv.ops.moe import moe_grouped, moe_loop
from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv
from minakv.ops.mxfp4_grouped import moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import group_offsets, row_starts
from minakv.ops.mxfp4_mma import moe_mxfp4_mma
from minakv.ops.mxfp4_mma_grouped import moe_mxfp4_mma_grouped
from minakv.ops.mxfp4_moe import moe_mxfp4_fused

TOKENS = (1, 8, 64, 256, 1024, 4096)
DECODE_MAX_T = 64  # fused variants up to here (and the two headline ones at 256)
TOL = 1e-2
FUSED = [("fused baseline", {"mode": "split"}), ("fused default", {})] + [
    (f"fused {mode} bn{n} bk{k} w{w}", {"mode": mode, "slots": "auto", "block_n": n, "block_k": k, "num_warps": w})
    for mode, n, k, w in (
        ("split", 64, 256, 4),
        ("scaled", 32, 128, 4),
        ("scaled", 64, 128, 4),
        ("scaled", 32, 256, 4),
        ("scaled", 64, 256, 8),
        ("scaled", 128, 128, 8),
    )
] + [
    (f"fused {mode} bn{n} split-K {k}", {"mode": mode, "block_n": n, "splits": k})
    for mode, n in (("split", 32), ("scaled", 64))
    for k in (2, 4)
]  # fmt: skip
GEMV = [  # the few-pairs GEMV on the CUDA cores (mxfp4_gemv.py), up to GEMV_MAX_T
    (f"gemv bn{n} g{g} w{w}", {"block_n": n, "groups": g, "num_warps": w})
    for n, g, w in ((16, 8, 4), (8, 8, 2), (16, 4, 2), (4, 32, 4), (2, 64, 4), (4, 8, 1), (2, 16, 1), (1, 32, 1))
] + [
    (f"gemv x-in-asm bn{n} g{g} w{w}", {"block_n": n, "groups": g, "num_warps": w, "x_in_asm": True})
    for n, g, w in ((16, 8, 4), (8, 8, 2), (16, 4, 2), (4, 32, 4), (32, 8, 4), (16, 16, 4))
] + [
    (f"gemv bn{n} g{g} w{w} split-K {k}", {"block_n": n, "groups": g, "num_warps": w, "splits": k})
    for n, g, w, k in ((16, 4, 2, 3), (4, 32, 4, 2))
]  # fmt: skip
MMA_GROUPED = [  # mxfp4_mma_grouped.py: row tiles (16 rows) x pair tiles (8 pairs) a warp, groups a step
    (f"mma grouped mr{mr} nt{nt} u{u}", {"mr": mr, "nt": nt, "unroll": u})
    for mr, nt, u in ((4, 4, 2), (4, 4, 1), (2, 4, 2), (2, 4, 4), (4, 2, 2), (2, 2, 2), (2, 1, 2), (4, 8, 1))
] + [  # the scales folded into the fp16 weights (no FMAs; the dummy scales, 2^-7, are in its range)
    (f"mma grouped fold mr{mr} nt{nt} u{u}", {"mr": mr, "nt": nt, "unroll": u, "fold": True})
    for mr, nt, u in ((2, 1, 2), (2, 2, 2), (2, 4, 2), (2, 8, 1), (4, 8, 1))
]
MMA = [  # the tensor-core GEMV (mxfp4_mma.py): groups a step, split-K for gate/up and down
    (f"gemv mma u{u} split {a},{b}", {"unroll": u, "splits": (a, b)})
    for u, a, b in ((4, 1, 1), (8, 1, 1), (4, 2, 2), (4, 2, 4), (4, 3, 3), (8, 2, 2))
]
GEMV_MAX_T = 16
GROUPED = [
    ("grouped baseline", {"mode": "split"}),
    ("grouped scaled", {"mode": "scaled"}),
    ("grouped scaled bm128 bn128 bk64", {"mode": "scaled", "block_n": 128}),
    ("grouped scaled bm128 bn128 bk128", {"mode": "scaled", "block_n": 128, "block_k": 128}),
    (
        "grouped scaled bm64 bn128 bk128 w4",
        {"mode": "scaled", "block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4},
    ),
    ("grouped bf16 once", {"mode": "bf16"}),
    ("grouped default", {}),
]


STREAM = [(8, 8, 2), (16, 8, 4), (4, 32, 4), (2, 64, 4), (4, 8, 1), (1, 32, 1), (16, 32, 8)]  # (BN, G, warps)


@triton.jit
def _stream_kernel(w_ptr, ids_ptr, out_ptr, N, NG, stride_be, stride_bn, BLOCK_N: tl.constexpr,
                   GROUPS: tl.constexpr):  # fmt: skip
    """Read a pair's expert rows as the GEMV does ([BN, G, 4] words a step, in tiles: mxfp4_layout.py), xor
    them: bytes only, no math."""
    expert = tl.load(ids_ptr + tl.program_id(0))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, _ = row_starts(w_ptr, w_ptr, expert, offs_n, stride_be, stride_bn, 0, 0, 4)  # (no scales read)
    acc = tl.zeros((BLOCK_N, GROUPS, 4), dtype=tl.int32)
    for g0 in range(0, NG, GROUPS):
        offs_g = g0 + tl.arange(0, GROUPS)
        ok = (offs_n < N)[:, None, None] & (offs_g < NG)[None, :, None]
        words = rows[:, None, None] + group_offsets(offs_g, 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
        acc ^= tl.load(words, mask=ok, other=0)
    tl.store(
        out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
        tl.sum(tl.sum(tl.sum(acc, 2), 1), 0),
    )


def stream(w: dict, ids: torch.Tensor, block_n: int, groups: int, warps: int) -> None:
    """The GEMV's weight reads alone (gate/up, then down), for a bytes-only ceiling of its access pattern."""
    out = torch.empty(ids.numel() * 8192, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    for key in ("gate_up_blocks", "down_blocks"):
        words = w[key].view(torch.int32)
        n, ng = words.shape[1], words.shape[2]
        _stream_kernel[(flat.numel(), triton.cdiv(n, block_n))](
            words,
            flat,
            out,
            n,
            ng,
            words.stride(0),
            words.stride(1),
            BLOCK_N=block_n,
            GROUPS=groups,
            num_warps=warps,
        )


def graph_ms(fn) -> float:
    """Median ms of one replay of fn captured in a CUDA graph (decode runs as graphs; at T=1 host launch
    overhead would otherwise dwarf a 20 us layer)."""
    for _ in range(2):  # compile, settle the allocator
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median"))


def variants(tokens: int, args: tuple, bf16_args: tuple) -> list[tuple[str, object, bool]]:
    """(name, fn, packed) of every path to run at this T."""
    out = []
    if tokens <= DECODE_MAX_T or tokens == 256:
        fused = FUSED if tokens <= DECODE_MAX_T else FUSED[:4]
        out += [(name, lambda kw=kw: moe_mxfp4_fused(*args, **kw), True) for name, kw in fused]
        out.append(("bf16 fused", lambda: moe_fused(*bf16_args), False))
    if tokens <= GEMV_MAX_T:
        out += [(name, lambda kw=kw: moe_mxfp4_gemv(*args, **kw), True) for name, kw in GEMV]
        out += [(name, lambda kw=kw: moe_mxfp4_mma(*args, **kw), True) for name, kw in MMA]
    if tokens >= 8:
        out += [(name, lambda kw=kw: moe_mxfp4_mma_grouped(*args, **kw), True) for name, kw in MMA_GROUPED]
    if GEMV_MAX_T < tokens <= DECODE_MAX_T:  # beyond, the GEMV's reads alone
        out += [(f"gemv stream-only bn{n} g{g} w{wp}", lambda n=n, g=g, wp=wp: stream(args[1], args[3], n, g, wp),
                 True) for n, g, wp in STREAM]  # fmt: skip
    if tokens >= 256:
        out += [(name, lambda kw=kw: moe_mxfp4_grouped(*args, **kw), True) for name, kw in GROUPED]
    out.append(("bf16 grouped", lambda: moe_grouped(*bf16_args), False))
    return out


def run(
    shapes: dict[str, int], tokens_list: tuple[int, ...], only: str | None, budget_s: float
) -> list[dict]:
    start = time.time()
    copy_bw = copy_bandwidth(1.0)
    rows = [{"name": "copy bandwidth 1 GiB", "GBps": copy_bw / 1e9}]
    print(f"copy bandwidth (1 GiB torch copy): {copy_bw / 1e12:.2f} TB/s", flush=True)
    for shape, experts in shapes.items():
        layer = make_layer(experts, max(tokens_list))
        x_all, w, weights_all, ids_all, gub, db = layer
        gate_up32, down32 = dequantized(w, torch.float32)
        gate_up16, down16 = gate_up32.to(x_all.dtype), down32.to(x_all.dtype)  # bf16 on the GPU
        h, i = x_all.shape[1], w["down_blocks"].shape[2] * 32
        for tokens in tokens_list:
            x, weights, ids = x_all[:tokens], weights_all[:tokens], ids_all[:tokens]
            ref = moe_loop(x.float(), gate_up32, down32, weights, ids, gub.float(), db.float(), *ACT)
            touched = int(torch.unique(ids).numel())
            args = (x, w, weights, ids, gub, db, *ACT)
            bf16_args = (x, gate_up16, down16, weights, ids, gub, db, *ACT)
            for name, fn, packed in variants(tokens, args, bf16_args):
                if (
                    only
                    and not any(part in name for part in only.split(","))
                    and not name.endswith("baseline")
                    and not name.startswith("bf16")
                ):
                    continue
                row = {"shape": shape, "experts": experts, "tokens": tokens, "touched": touched, "name": name}
                if time.time() - start > budget_s:
                    row["error"] = "skipped: over --budget-s"
                    rows.append(row)
                    continue
                try:
                    err = 0.0 if "stream-only" in name else rel_err(fn(), ref)
                    ms = graph_ms(fn)
                except Exception as exc:  # noqa: BLE001 (fail soft: report the variant and go on)
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{shape} T={tokens} {name}: FAILED {row['error']}", flush=True)
                    rows.append(row)
                    try:  # let a failed launch surface here, not in the next variant
                        torch.cuda.synchronize()
                    except Exception as sync_exc:  # noqa: BLE001
                        print(f"  after it: {type(sync_exc).__name__}: {str(sync_exc)[:200]}", flush=True)
                    continue
                need = touched * expert_bytes(h, i, packed)
                gbps = need / (ms * 1e-3) / 1e9
                row |= {"ms": ms, "bytes": need, "GBps": gbps, "frac_copy": gbps * 1e9 / copy_bw,
                        "rel_err": err, "err_flag": not err <= TOL}  # fmt: skip
                rows.append(row)
                print(f"{shape:>4} T={tokens:<5} {name:<34} {ms:8.4f} ms {gbps:8.0f} GB/s "
                      f"{row['frac_copy']:6.1%}  err {err:.1e}{'  > 1e-2 !' if row['err_flag'] else ''}",
                      flush=True)  # fmt: skip
        del layer, w, gate_up32, down32, gate_up16, down16
        torch.cuda.empty_cache()
    print(f"({time.time() - start:.0f} s)")
    return rows


def table(rows: list[dict]) -> None:
    """Per (shape, T): every path, fastest first, and the speed-up over the baseline."""
    print("\n=== summary ===")
    keys = sorted({(r["shape"], r["tokens"]) for r in rows if "shape" in r}, key=lambda k: (k[0], k[1]))
    for shape, tokens in keys:
        group = [r for r in rows if r.get("shape") == shape and r.get("tokens") == tokens]
        ok = sorted((r for r in group if "ms" in r), key=lambda r: r["ms"])
        base = [r["ms"] for r in ok if r["name"].endswith("baseline")]
        print(f"-- {shape} T={tokens} ({group[0]['touched']} experts)")
        for r in ok:
            speed = f"{base[0] / r['ms']:5.2f}x base" if base else ""
            flag = "  ERR > 1e-2" if r["err_flag"] else ""
            print(f"   {r['name']:<34} {r['ms']:8.4f} ms {r['frac_copy']:6.1%} of copy  {speed}{flag}")
        for r in group:
            if "error" in r:
                print(f"   {r['name']:<34} {r['error'][:90]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="20b,120b")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument(
        "--only", default=None, help="run only variants whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--budget-s", type=float, default=170.0)
    default_out = os.path.join(os.environ["OUT"], "mxfp4_variants.json") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    rows = run(shapes, tuple(int(t) for t in args.tokens.split(",")), args.only, args.budget_s)
    table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
