"""The one-token GEMVs over their strip shapes: rows per program (BN), 16-byte vectors per thread per step
(V: G = V * threads / BN vectors per row and step), warps, and (FP8) the PTX loads (x_in_asm). The FP8 GEMVs
of minakv/ops/fp8_gemv.py at MiniMax-M2's shapes, and the bf16 GEMV of minakv/ops/bf16_gemv.py at gpt-oss's
attention projections (with their biases) beside F.linear (cuBLAS). What moves them towards the read ceiling?

    python3 bench/gemv_sweep.py [--budget-s 200] [--only fp8|bf16]   (on the GPU; rows to $OUT/gemv_sweep.json)
    python3 bench/gemv_sweep.py --tiny                                 (CPU smoke test, Triton interpreted)

Each row times COPIES calls on distinct weights in one CUDA graph (the projections: COPIES weight tensors;
the MoE: COPIES disjoint sets of 8 experts), so L2 (60 MB on the H200) serves no repeat read, as in a decode
step of many layers. Figure: the weight and scale bytes over the time, as a fraction of the copy bandwidth
measured in the same run. Every config is checked against the default config's output first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from bench_fp8 import FULL, TINY, random_fp8, timer
from common import Log, rel_err

from minakv.ops.bf16_gemv import linear_gemv
from minakv.ops.fp8_gemv import linear_fp8_gemv, moe_fp8_gemv

GPT_OSS_ATTENTION = {"qkv": (5120, 2880), "o_proj": (2880, 4096)}  # (out, in), both with a bias


def configs(tiny: bool, fp8: bool = True) -> list[dict]:
    """The strip shapes to time: the default ({}) first; bf16: F.linear ({"cublas": True}) second."""
    if tiny:
        return [{}, {"block_n": 4, "groups": 8, "num_warps": 1}] + ([] if fp8 else [{"cublas": True}])
    out: list[dict] = [{}, {"x_in_asm": True} if fp8 else {"cublas": True}]
    for warps in (4, 8):
        for block_n in (2, 4, 8, 16):
            for per_thread in (1, 2, 4, 8):
                groups = per_thread * 32 * warps // block_n
                if groups <= 256:
                    out.append({"block_n": block_n, "groups": groups, "num_warps": warps})
    for block_n in (4, 8, 16) if fp8 else ():
        for per_thread in (1, 2, 4):
            out.append({"block_n": block_n, "groups": per_thread * 128 // block_n, "x_in_asm": True})
    return out


def bf16_linear(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor, cfg: dict) -> torch.Tensor:
    return F.linear(a, w, b) if cfg.get("cublas") else linear_gemv(a, w, b, **cfg)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds for all the cases together")
    p.add_argument("--only", choices=("fp8", "bf16"), help="one kind of case")
    args = p.parse_args()
    log = Log()
    device = "cpu" if args.tiny else "cuda"
    s, dtype = (TINY, torch.float32) if args.tiny else (FULL, torch.bfloat16)
    copies = 2 if args.tiny else args.copies
    gen = torch.Generator(device).manual_seed(0)
    ms_of = timer(device)
    if args.tiny:
        copy_bw = 1e9
    else:
        from common import copy_bandwidth

        copy_bw = copy_bandwidth()
    log.add("bench", name="copy bandwidth", ms=0.0, figure=f"{copy_bw / 1e12:.3f} TB/s", headline=True)
    x = torch.randn(1, s["hidden"], generator=gen, device=device).to(dtype)
    xq = torch.randn(1, s["q"], generator=gen, device=device).to(dtype)
    cases = {}  # name -> (fn(config) -> outputs, bytes read, configs)
    fp8_configs, bf16_configs = configs(args.tiny), configs(args.tiny, fp8=False)
    for name, out, inp, a in (("q_proj", s["q"], s["hidden"], x), ("o_proj", s["hidden"], s["q"], xq),
                              ("k_proj", s["kv"], s["hidden"], x)):  # fmt: skip
        ws = [random_fp8(out, inp, device=device, gen=gen) for _ in range(copies)]
        need = copies * (out * inp + ws[0][1].numel() * 4)
        cases[f"{name} {out}x{inp}"] = (lambda cfg, a=a, ws=ws: [linear_fp8_gemv(a, w, sc, **cfg) for w, sc in ws],
                                        need, fp8_configs)  # fmt: skip
    e, h, i, k = s["experts"], s["hidden"], s["inter"], s["topk"]
    w = {}
    w["gate_up"], w["gate_up_scale_inv"] = random_fp8(e, 2 * i, h, device=device, gen=gen)
    w["down"], w["down_scale_inv"] = random_fp8(e, h, i, device=device, gen=gen)
    sets = torch.randperm(e, generator=gen, device=device)[: copies * k].view(copies, 1, k)
    weights = torch.full((1, k), 1.0 / k, device=device)
    per_expert = sum(t[0].numel() * t.element_size() for t in w.values())
    cases[f"moe top-{k} T=1"] = (lambda cfg: [moe_fp8_gemv(x, w, weights, ids, **cfg) for ids in sets],
                                 copies * k * per_expert, fp8_configs)  # fmt: skip
    if args.only == "bf16":
        cases = {}
    for name, (out, inp) in GPT_OSS_ATTENTION.items() if args.only != "fp8" else ():
        if args.tiny:
            out, inp = out // 40, inp // 320 * 8
        a = torch.randn(1, inp, generator=gen, device=device).to(dtype)
        ws = [(torch.randn(out, inp, generator=gen, device=device).to(dtype) * 0.02,
               torch.randn(out, generator=gen, device=device).to(dtype)) for _ in range(copies)]  # fmt: skip
        need = copies * (out * inp + out) * ws[0][0].element_size()
        cases[f"bf16 {name} {out}x{inp}"] = (lambda cfg, a=a, ws=ws: [bf16_linear(a, w, b, cfg) for w, b in ws],
                                             need, bf16_configs)  # fmt: skip
    for case, (fn, need, case_configs) in cases.items():  # the budget shared evenly by the cases
        start = time.perf_counter()
        ref = fn({})
        best = None
        for cfg in case_configs:
            if time.perf_counter() - start > args.budget_s / len(cases):
                log.add("note", name="budget spent: configs left out", value=case)
                break
            try:
                err = max(rel_err(a, b) for a, b in zip(fn(cfg), ref, strict=True))
                ms = ms_of(lambda cfg=cfg, fn=fn: fn(cfg)) / copies
            except Exception as exc:  # noqa: BLE001 (a config the compiler refuses (registers, shared memory): say so, go on)
                log.add("note", name=f"{case} {cfg}", value=f"failed: {type(exc).__name__}: {exc}"[:200])
                continue
            frac = need / copies / (ms * 1e-3) / copy_bw
            log.add("bench", name=f"{case} {cfg}", ms=ms, figure=f"{frac:.1%} of copy bw", frac_copy=frac,
                    err_vs_default=err, headline=not cfg, **cfg)  # fmt: skip
            assert err < 1e-2, f"{case} {cfg}: {err} against the default config"
            if best is None or ms < best[0]:
                best = (ms, cfg, frac)
        if best:
            log.add("bench", name=f"{case} best {best[1]}", ms=best[0], figure=f"{best[2]:.1%} of copy bw",
                    headline=True)  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()
    log.table()
    log.save("gemv_sweep.json")


if __name__ == "__main__":
    main()
