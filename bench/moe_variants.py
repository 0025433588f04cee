"""The bf16 MoE at decode batch 1..512: the fused kernels' variants against torch's grouped GEMM, as a
fraction of the copy bandwidth measured in the same run.

Shapes: gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts), hidden = intermediate = 2880, top-4,
swiglu_oai with biases, random routing. At batch 256 of the 20b every expert gets ~32 rows, so the MoE
must read all 32 experts' weights (1.6 GB) and is bound by those bytes: the figure of merit is
(bytes of the experts actually routed to) / time / copy bandwidth, and decode needs >= 0.75 there.

Variants are keyword knobs of `moe_fused` (minakv/ops/fused_moe.py): sort (counting sort by expert
on the device vs. each program scanning the id list), swap_ab (W @ x^T), block_m/n/k, num_warps,
num_stages; the fused default and `moe` (the dispatcher) show what the engine runs today. Each is
checked against an fp32 torch reference (per-expert matmuls, no TF32; error > 1e-2 is flagged), then
timed as CUDA-graph replays (as the engine decodes; eager if capture fails) with CUDA events: median
of several replays after warm-up. A variant that fails (shared memory, compile) is reported and skipped.

    python bench/moe_variants.py [--out rows.json] [--shapes 20b,120b] [--tokens 128,256] [--only swap]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minakv.ops.fused_moe import default_block_m, moe_fused
from minakv.ops.moe import activate, moe, moe_grouped, route_softmax_topk
from minakv.ops.moe_groups import sort_by_expert

H = I = 2880
TOPK = 4
SHAPES = {"20b": 32, "120b": 128}
TOKENS = (1, 16, 64, 128, 256, 512)
SWEEP_FROM = 128  # the whole sweep from this batch on; below it only the baselines and the defaults
TOL = 1e-2

BASELINES: list[tuple[str, dict]] = [
    ("moe() dispatcher", {}),
    ("grouped_mm", {}),
    ("fused scan (old default)", {"sort": False}),
    ("fused default", {}),
    ("fused swap_ab", {"swap_ab": True}),
]
SWEEP: list[tuple[str, dict]] = [  # the sorted mode; "bm_x2": twice the default block_m (skewed routing)
    (f"sorted{' swap' if swap else ''} bn{bn} bk{bk} w{w} s{s}",
     {"sort": True, "swap_ab": swap, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s})
    for swap, bn, bk, w, s in [
        (False, 64, 128, 4, 4), (False, 64, 64, 4, 4), (False, 64, 128, 8, 3), (False, 128, 64, 4, 3),
        (False, 128, 64, 8, 4), (False, 32, 128, 4, 4),
        (True, 64, 128, 4, 4), (True, 128, 64, 4, 4), (True, 128, 64, 8, 3), (True, 128, 128, 8, 3),
    ]
] + [("sorted bm_x2 bn64 bk64 w4 s4", {"sort": True, "bm_x2": True, "block_n": 64, "block_k": 64,
                                       "num_stages": 4})]  # fmt: skip


def time_ms(fn, iters: int = 25) -> tuple[float, bool]:
    """Median ms of one call, replayed from a CUDA graph when fn can be captured -> (ms, graphed)."""
    fn()
    torch.cuda.synchronize()
    graph, run = torch.cuda.CUDAGraph(), fn
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 (a host sync in fn: time it eagerly, and say so)
        torch.cuda.synchronize()
        graph = None
    for _ in range(3):
        run()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), graph is not None


def copy_bandwidth() -> float:
    """bench/common.py's measure (a 2 GiB copy, read + write bytes, the figure every other table uses): timing
    a 1 GiB copy replayed from a CUDA graph here gave 2.76 TB/s on the H200, against 4.27 from common."""
    from common import copy_bandwidth as measure

    return measure()


def make_layer(experts: int, gen: torch.Generator) -> list[torch.Tensor]:
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    return [randn(experts, 2 * I, H, scale=0.02), randn(experts, H, I, scale=0.02),
            randn(experts, 2 * I, scale=0.1), randn(experts, H, scale=0.1)]  # fmt: skip


def reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias) -> torch.Tensor:
    """fp32 per-expert matmuls (TF32 off) on the same bf16 values; syncs, which is fine here."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token].float() @ gate_up[e].float().T + gate_up_bias[e].float()
        y = activate(h, "swiglu_oai") @ down[e].float().T + down_bias[e].float()
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def run_case(shape: str, experts: int, layer, tokens: int, variants, copy_bw: float, rows: list) -> None:
    gen = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = route_softmax_topk(torch.randn(tokens, experts, generator=gen, device="cuda"), TOPK)
    gate_up, down, gate_up_bias, down_bias = layer
    args = (x, gate_up, down, weights, ids, gate_up_bias, down_bias, "swiglu_oai")
    ref = reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias)
    active = int(torch.unique(ids).numel())
    need = active * (3 * I * H + 2 * I + H) * 2  # the routed experts' weights and biases, bf16
    base = {"shape": shape, "experts": experts, "tokens": tokens, "pairs": tokens * TOPK, "active": active,
            "weight_bytes": need}  # fmt: skip
    for parallel in (False, True):  # one program, or a program per chunk of pairs (two launches)
        sort_ms, _ = time_ms(
            lambda parallel=parallel: sort_by_expert(ids.reshape(-1), experts, parallel=parallel)
        )
        rows.append({**base, "variant": f"sort_by_expert alone, parallel={parallel}", "ms": sort_ms})
    for name, kwargs in variants:
        kw = dict(kwargs)
        if kw.pop("bm_x2", False):
            kw["block_m"] = min(128, 2 * default_block_m(tokens * TOPK, experts, True))
        if name == "moe() dispatcher":
            fn = lambda: moe(*args)
        elif name == "grouped_mm":
            fn = lambda: moe_grouped(*args)
        else:
            fn = lambda kw=kw: moe_fused(*args, **kw)
        row = {**base, "variant": name, "kwargs": kw}
        if name.startswith("fused scan") and tokens * TOPK > 512:
            continue  # the scan's [BLOCK_M, pairs] match matrix: never used past 512 pairs, slow to compile
        try:
            out = fn()
            err = float((out.float() - ref).norm() / ref.norm())
            ms, graphed = time_ms(fn)
            row.update(ms=ms, gbps=need / (ms * 1e-3) / 1e9, frac_copy=need / (ms * 1e-3) / copy_bw, err=err,
                       err_flag=not err <= TOL, graphed=graphed)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 (a config that does not fit or compile: report, go on)
            row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=1)
        torch.cuda.synchronize()
        rows.append(row)
        print(json.dumps(row), flush=True)


def table(rows: list, copy_bw: float, need_frac: float = 0.75) -> None:
    print(f"\n=== MoE variants (copy bandwidth {copy_bw / 1e12:.2f} TB/s, 1 GiB) ===")
    print(
        f"{'shape':<5} {'T':>4} {'act':>4} {'variant':<34} {'ms':>8} {'GB/s':>7} {'copy':>6} {'rel err':>9}"
    )
    cases = sorted({(r["shape"], r["tokens"]) for r in rows}, key=lambda c: (SHAPES[c[0]], c[1]))
    for shape, tokens in cases:
        mine = [r for r in rows if (r["shape"], r["tokens"]) == (shape, tokens)]
        for r in mine:
            if "error" in r:
                print(f"{shape:<5} {tokens:>4} {r['active']:>4} {r['variant']:<34} FAILED {r['error'][:60]}")
            elif "frac_copy" not in r:
                print(f"{shape:<5} {tokens:>4} {r['active']:>4} {r['variant']:<34} {r['ms']:8.4f}")
            else:
                flag = " ERR>1e-2" if r["err_flag"] else ""
                print(f"{shape:<5} {tokens:>4} {r['active']:>4} {r['variant']:<34} {r['ms']:8.4f} "
                      f"{r['gbps']:7.0f} {r['frac_copy']:6.1%} {r['err']:9.2e}{flag}"
                      f"{'' if r['graphed'] else ' (eager)'}")  # fmt: skip
        ok = [r for r in mine if "frac_copy" in r and not r["err_flag"]]
        if ok:
            best = max(ok, key=lambda r: r["frac_copy"])
            met = "MET" if best["frac_copy"] >= need_frac else "MISSED"
            print(f"  best: {best['variant']} {best['frac_copy']:.1%} of copy (need {need_frac:.0%}: {met})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out_dir = os.environ.get("OUT")
    parser.add_argument("--out", default=os.path.join(out_dir, "moe_variants.json") if out_dir else None)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--only", default="", help="comma-separated substrings of the sweep names to keep")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; past it, baselines only")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.time()
    copy_bw = copy_bandwidth()
    keep = [s for s in args.only.split(",") if s]
    sweep = [v for v in SWEEP if not keep or any(s in v[0] for s in keep)]
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        experts = SHAPES[shape]
        layer = make_layer(experts, torch.Generator("cuda").manual_seed(experts))
        # the batches the goal is about first, so a budget cut drops the least useful ones
        for tokens in sorted(map(int, args.tokens.split(",")), key=lambda t: (t < SWEEP_FROM, -t)):
            over = time.time() - started > args.budget
            variants = BASELINES + (sweep if tokens >= SWEEP_FROM and not over else [])
            run_case(shape, experts, layer, tokens, variants, copy_bw, rows)
        del layer
        torch.cuda.empty_cache()
    table(rows, copy_bw)
    print(f"({time.time() - started:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_bw": copy_bw, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
