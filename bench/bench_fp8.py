"""FP8 (W8A16, 128x128 block scales) at MiniMax-M2's shapes: the attention projections (minakv/ops/fp8_linear.py)
and the MoE (minakv/ops/fp8_moe.py) at T = 1, 64, 256, each against its bytes bound and against the bf16 path
on the dequantized weights (F.linear; moe_fused / moe_grouped).

    python3 bench/bench_fp8.py [--tokens 1,64,256] [--layers N] [--sweep]      (on the H200; from anywhere)
    python3 bench/bench_fp8.py --tiny       (CPU smoke test: tiny shapes, Triton interpreted, wall clock)

Bytes bound: the FP8 weight bytes a call must read plus their fp32 scales, over the copy bandwidth of this
run. Linear: the whole weight. MoE: the distinct experts routed to, times an expert's bytes. The bf16 rows
read twice the bytes. Times are medians of CUDA-graph replays (as the engine runs decode), so host launch
overhead is not counted; the glue of each path (sorts, partial sums, the final sum) is.

--layers N: one decode step of N MiniMax-M2-shaped layers, weights only: q, k and v in one projection (as
the model fuses them), o (applied to q, standing in for attention's output), the residual adds with their
RMSNorms (one kernel each, the second summing the experts' k parts, as the model runs them), the bf16
router and routing (fused, its counters kept per layer, as the model runs a decode batch) and the experts;
attention and the q/k norms left out. Every layer has its own weights, so nothing is served from L2
between layers. Bound: N layers' bytes.

Weights are random bytes (NaN codes avoided) with scales in [2^-14, 2^-13]: an rms near 0.01, though
log-uniform rather than normal (timing does not care; correctness is tests/test_ops_fp8.py's job, and
each row logs its error against the bf16 path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--tiny" in sys.argv:  # before Triton is imported: the kernels then run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from common import Log, rel_err

from minakv.ops.fp8_gemv import linear_fp8_gemv, moe_fp8_gemv
from minakv.ops.fp8_linear import GEMV_MAX_ROWS, linear_fp8, linear_fp8_triton
from minakv.ops.fp8_moe import FUSED_MAX_PAIRS, GEMV_MAX_PAIRS, moe_fp8, moe_fp8_fused, moe_fp8_grouped
from minakv.ops.fp8_tile import KEYS, dequantize_experts
from minakv.ops.fused_moe import SCAN_MAX_PAIRS, moe_fused
from minakv.ops.moe import moe_grouped, route_sigmoid_bias
from minakv.ops.norm import add_rms_norm
from minakv.ops.quant import dequantize_fp8_block
from minakv.ops.routing import block_counters, route_sigmoid_bias_fused
from minakv.ops.triton_util import use_triton

FULL = {"hidden": 3072, "q": 6144, "kv": 1024, "experts": 256, "topk": 8, "inter": 1536}
TINY = {"hidden": 256, "q": 256, "kv": 128, "experts": 4, "topk": 2, "inter": 128}
SWEEP_LINEAR = [{"block_n": n, "split_k": s} for n in (32, 64, 128) for s in (1, 2, 4, 8)]
SWEEP_MOE = [{"block_n": n, "block_k": k} for n in (32, 64, 128) for k in (64, 128)]


def random_fp8(*shape: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes [..., out, in] (no NaN codes) and fp32 block scales in [2^-14, 2^-13]."""
    codes = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)  # 0x7F / 0xFF are NaN
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale = (1 + torch.rand(grid, generator=gen, device=device)) * 2.0**-14
    return codes.view(torch.float8_e4m3fn), scale


def timer(device: str):
    """ms of one call: CUDA-graph replay on the GPU (bench_moe.graph_ms), one wall-clock call on the CPU."""
    if device == "cuda":
        from bench_moe import graph_ms

        return graph_ms

    def wall_ms(fn) -> float:
        start = time.perf_counter()  # one call: the interpreter has nothing to warm up
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


class Bench:
    def __init__(self, log: Log, copy_bw: float, device: str, dtype: torch.dtype, shape: dict[str, int],
                 sweep: bool) -> None:  # fmt: skip
        self.log, self.copy_bw, self.device, self.dtype = log, copy_bw, device, dtype
        self.s, self.sweep = shape, sweep
        self.ms_of = timer(device)
        self.gen = torch.Generator(device).manual_seed(0)

    def row(self, name: str, fn, need: int, headline: bool = True, **extra) -> float:
        """Time fn; report it against `need` bytes at the copy bandwidth."""
        ms = self.ms_of(fn)
        bound = need / self.copy_bw * 1e3
        self.log.add("bench", name=name, ms=ms, figure=f"{need / 1e6:.1f} MB, {bound / ms:.1%} of the bytes bound",
                     bytes=need, bound_ms=bound, frac_bound=bound / ms, headline=headline, **extra)  # fmt: skip
        return ms

    def linears(self, tokens: int) -> None:
        s = self.s
        shapes = {"q_proj": (s["q"], s["hidden"]), "k_proj": (s["kv"], s["hidden"]),
                  "v_proj": (s["kv"], s["hidden"]), "o_proj": (s["hidden"], s["q"])}  # fmt: skip
        for name, (out, inp) in shapes.items():
            weight, scale = random_fp8(out, inp, device=self.device, gen=self.gen)
            w16 = dequantize_fp8_block(weight, scale, dtype=self.dtype)
            x = torch.randn(tokens, inp, generator=self.gen, device=self.device).to(self.dtype)
            need = out * inp + scale.numel() * 4
            err = rel_err(linear_fp8(x, weight, scale), F.linear(x, w16))
            tag = f"{name} {out}x{inp} T={tokens}"
            run = {"x": x, "weight": weight, "scale_inv": scale}
            fp8 = self.row(f"linear {tag} fp8", lambda run=run: linear_fp8(**run), need, err_vs_bf16=err)
            if x.shape[0] <= GEMV_MAX_ROWS:  # linear_fp8 took the GEMV: the tensor-core kernel beside it
                self.row(f"linear {tag} fp8 tensor cores", lambda run=run: linear_fp8_triton(**run), need,
                         headline=False)  # fmt: skip
                self.row(f"linear {tag} fp8 gemv x-in-asm", lambda run=run: linear_fp8_gemv(**run, x_in_asm=True),
                         need, headline=False)  # fmt: skip
            bf16 = self.row(f"linear {tag} bf16 F.linear", lambda x=x, w16=w16: F.linear(x, w16), 2 * need)
            self.log.add("verdict", name=f"linear {tag}: bf16 / fp8 time", value=bf16 / fp8, need=1.0,
                         met=bf16 >= fp8)  # fmt: skip
            if self.sweep and self.device == "cuda":
                for cfg in SWEEP_LINEAR:
                    self.row(f"linear {tag} fp8 {cfg}", lambda cfg=cfg, run=run: linear_fp8_triton(**run, **cfg),
                             need, headline=False, **cfg)  # fmt: skip

    def experts(self) -> dict[str, torch.Tensor]:
        s = self.s
        e, h, i = s["experts"], s["hidden"], s["inter"]
        w = {}
        w["gate_up"], w["gate_up_scale_inv"] = random_fp8(e, 2 * i, h, device=self.device, gen=self.gen)
        w["down"], w["down_scale_inv"] = random_fp8(e, h, i, device=self.device, gen=self.gen)
        return w

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(x.shape[0], self.s["experts"], generator=self.gen, device=self.device)
        return route_sigmoid_bias(logits, torch.zeros(self.s["experts"], device=self.device), self.s["topk"])

    def moe(self, tokens: int, w: dict[str, torch.Tensor], w16: tuple[torch.Tensor, torch.Tensor]) -> None:
        s = self.s
        x = torch.randn(tokens, s["hidden"], generator=self.gen, device=self.device).to(self.dtype)
        weights, ids = self.route(x)
        touched = int(torch.unique(ids).numel())
        per_expert = sum(w[n][0].numel() * (1 if "scale" not in n else 4) for n in KEYS)
        need = touched * per_expert
        tag = f"moe E={s['experts']} top-{s['topk']} T={tokens} ({touched} experts)"
        fused_ok = ids.numel() <= FUSED_MAX_PAIRS
        bf16_path = moe_fused if fused_ok else moe_grouped
        ref = bf16_path(x, *w16, weights, ids)
        err = rel_err(moe_fp8(x, w, weights, ids), ref)
        fp8 = self.row(f"{tag} fp8 (moe_fp8)", lambda: moe_fp8(x, w, weights, ids), need, err_vs_bf16=err)
        if ids.numel() <= min(GEMV_MAX_PAIRS, s["experts"]):  # moe_fp8 took the GEMV: the others beside it
            self.row(
                f"{tag} fp8 moe_fp8_fused", lambda: moe_fp8_fused(x, w, weights, ids), need, headline=False
            )
            self.row(f"{tag} fp8 gemv x-in-asm", lambda: moe_fp8_gemv(x, w, weights, ids, x_in_asm=True), need,
                     headline=False)  # fmt: skip
        if fused_ok and ids.numel() > SCAN_MAX_PAIRS:  # moe_fp8 sorted the pairs first: the id scan beside it
            self.row(f"{tag} fp8 moe_fp8_fused, ids scanned", lambda: moe_fp8_fused(x, w, weights, ids, sort=False),
                     need, headline=False)  # fmt: skip
        if fused_ok:  # the other FP8 path (the fused kernels' id scan is sized for decode batches)
            self.row(
                f"{tag} fp8 moe_fp8_grouped",
                lambda: moe_fp8_grouped(x, w, weights, ids),
                need,
                headline=False,
            )
        paths = {"moe_fused": moe_fused} if fused_ok else {}
        if self.device == "cuda" and hasattr(F, "grouped_mm"):
            paths["moe_grouped"] = moe_grouped
        best = float("inf")
        for name, fn in paths.items():
            best = min(
                best, self.row(f"{tag} bf16 {name}", lambda fn=fn: fn(x, *w16, weights, ids), 2 * need)
            )
        if paths:
            self.log.add(
                "verdict", name=f"{tag}: best bf16 / fp8 time", value=best / fp8, need=1.0, met=best >= fp8
            )
        if self.sweep and self.device == "cuda" and fused_ok:
            for cfg in SWEEP_MOE:
                self.row(f"{tag} fp8 fused {cfg}", lambda cfg=cfg: moe_fp8_fused(x, w, weights, ids, **cfg), need,
                         headline=False, **cfg)  # fmt: skip

    def layers(self, num_layers: int, batches: list[int]) -> None:
        """A decode step of num_layers layers (module docstring) at each batch size, against its bytes bound."""
        s = self.s
        layers = []
        for _ in range(num_layers):
            layer = {name: random_fp8(out, inp, device=self.device, gen=self.gen)
                     for name, out, inp in (("q", s["q"], s["hidden"]), ("k", s["kv"], s["hidden"]),
                                            ("v", s["kv"], s["hidden"]), ("o", s["hidden"], s["q"]))}  # fmt: skip
            router = torch.randn(s["experts"], s["hidden"], generator=self.gen, device=self.device) * 0.02
            layer["router"], layer["experts"] = router.to(self.dtype), self.experts()
            layer["counts"] = block_counters(torch.device(self.device))
            # q, k and v stacked (weights and scale grids) into one projection, as Attention.fuse does
            layer["qkv"] = tuple(torch.cat([layer[n][i] for n in "qkv"]) for i in (0, 1))
            layers.append(layer)
        bias = torch.zeros(s["experts"], device=self.device)
        norm = torch.ones(s["hidden"], device=self.device)
        dense = sum(t.numel() + 4 * sc.numel() for t, sc in (layers[0][n] for n in "qkvo"))
        dense += layers[0]["router"].numel() * layers[0]["router"].element_size()
        per_expert = sum(layers[0]["experts"][n][0].numel() * (1 if "scale" not in n else 4) for n in KEYS)
        for tokens in batches:
            x0 = torch.randn(tokens, s["hidden"], generator=self.gen, device=self.device).to(self.dtype)
            touched: list[int] = []

            def step(x0=x0, touched=touched) -> torch.Tensor:
                x = h = x0
                for layer in layers:  # as DecoderLayer.forward, alone on its GPU
                    q = linear_fp8(h, *layer["qkv"])[:, : s["q"]]
                    x, h = add_rms_norm(x, linear_fp8(q, *layer["o"]), norm, 1e-6, False)
                    weights, ids = route_sigmoid_bias_fused(
                        h, layer["router"], bias, s["topk"], layer["counts"]
                    )
                    if len(touched) < num_layers:  # the eager first call (a host sync: not in the graph)
                        touched.append(int(torch.unique(ids).numel()))
                    x, h = add_rms_norm(
                        x, moe_fp8(h, layer["experts"], weights, ids, sum_k=False), norm, 1e-6, False
                    )
                return h

            step()
            need = num_layers * dense + sum(touched) * per_expert
            ms = self.row(f"decode step {num_layers} layers T={tokens} fp8 (weights only)", step, need,
                          experts_touched=touched)  # fmt: skip
            self.log.add(
                "bench", name=f"  per layer T={tokens}", ms=ms / num_layers, figure="", headline=True
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--tokens", default=None, help="comma-separated batch sizes (default 1,64,256; --tiny 1,5)"
    )
    p.add_argument("--layers", type=int, default=0, help="also time a decode step of N layers")
    p.add_argument("--sweep", action="store_true", help="also time other tile configs")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    args = p.parse_args()
    log = Log()
    if args.tiny:
        from minakv.ops import triton_util

        torch.set_num_threads(1)
        triton_util.TRITON_ON_CPU = True  # the kernels, not the torch references
        device, shape, dtype, tokens = "cpu", TINY, torch.float32, args.tokens or "1,5"
        src = torch.randn(2**22)
        dst = torch.empty_like(src)
        copy_bw = 2 * src.numel() * 4 / (timer("cpu")(lambda: dst.copy_(src)) * 1e-3)
    else:
        from common import copy_bandwidth

        device, shape, dtype, tokens = "cuda", FULL, torch.bfloat16, args.tokens or "1,64,256"
        copy_bw = copy_bandwidth()
    log.add("bench", name="copy bandwidth", ms=0.0, figure=f"{copy_bw / 1e12:.3f} TB/s", headline=True)
    bench = Bench(log, copy_bw, device, dtype, shape, args.sweep)
    assert use_triton(torch.empty(0, device=device)), "the FP8 kernels would not run"
    batches = [int(t) for t in tokens.split(",")]
    for t in batches:
        bench.linears(t)
    w = bench.experts()
    w16 = tuple(dequantize_experts(w[n], w[n + "_scale_inv"], dtype=dtype) for n in ("gate_up", "down"))
    for t in batches:
        bench.moe(t, w, w16)
    del w, w16
    if args.layers:
        if device == "cuda":
            torch.cuda.empty_cache()
        bench.layers(args.layers, batches)
    log.table()
    log.save("fp8_tiny.json" if args.tiny else "fp8.json")


if __name__ == "__main__":
    main()
