"""The MoE at decode on the GPU: the fused Triton kernels (minakv/ops/fused_moe.py) against the grouped GEMM
(`F.grouped_mm`, minakv/ops/moe.py) on one gpt-oss-20b layer (32 experts top-4, hidden and intermediate
2880, bf16, biases, the clamped SwiGLU).

Decode reads each chosen expert's weights once, so the ceiling is bytes: (distinct experts routed to) x
(an expert's bytes) over the copy bandwidth of the same run. Both paths are timed as CUDA-graph replays,
as the engine runs decode, so launch overhead on the host is not counted; the glue around each path
(sort, counts, gathers, the final sum) is.

    python bench/bench_moe.py        (or through bench/run_h200.py --only moe)
"""

from __future__ import annotations

import torch
from common import Log, bench_ms, rel_err, run_alone

from minakv.ops.fused_moe import moe_fused
from minakv.ops.moe import moe_grouped, moe_loop, route_softmax_topk

E, K, H, I = 32, 4, 2880, 2880
BATCHES = (1, 8, 32, 64, 128)
SWEEP = [  # (block_n, block_k, num_warps, num_stages)
    (n, k, w, s) for n in (32, 64, 128) for k in (64, 128) for w, s in ((4, 3), (4, 4), (8, 3))
]


def make_layer(tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    gen = torch.Generator("cuda").manual_seed(seed)

    def randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    x = randn(tokens, H, scale=1.0)
    weights, ids = route_softmax_topk(randn(tokens, E, scale=1.0).float(), K)
    return [x, randn(E, 2 * I, H), randn(E, H, I), weights, ids, randn(E, 2 * I), randn(E, H)]


def graph_ms(fn) -> float:
    """Median time of one replay of fn captured in a CUDA graph."""
    for _ in range(3):  # compile and settle the allocator outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def check(log: Log) -> None:
    """Both bf16 paths, and the fused kernels in fp32, against the per-expert loop (cuBLAS) in fp32 on the
    same (bf16-valued) inputs."""
    for tokens in (1, 32, 300):
        args = make_layer(tokens)
        args32 = [a.float() if a.is_floating_point() else a for a in args]
        ref = moe_loop(*args32, "swiglu_oai")
        err = rel_err(moe_fused(*args32, "swiglu_oai"), ref)
        log.add("check", name=f"moe fused fp32 T={tokens} vs loop", err=err, tol=1e-4)
        for name, fn in (("fused", moe_fused), ("grouped", moe_grouped)):
            err = rel_err(fn(*args, "swiglu_oai"), ref)
            log.add("check", name=f"moe {name} bf16 T={tokens} vs fp32", err=err, tol=1e-2)


def bench(log: Log, copy_bw: float, sweep: bool = True) -> None:
    for tokens in BATCHES:
        bench_batch(log, copy_bw, tokens, sweep and tokens in (1, 32, 128))
        torch.cuda.empty_cache()


def bench_batch(log: Log, copy_bw: float, tokens: int, sweep: bool) -> None:
    args = make_layer(tokens)
    touched = int(torch.unique(args[4]).numel())
    need = touched * (2 * I * H + H * I + 2 * I + H) * 2  # the routed experts' weights and biases

    def row(name: str, fn, headline: bool = False, **extra) -> float:
        ms = graph_ms(fn)
        frac = need / (ms * 1e-3) / copy_bw
        log.add("bench", name=f"moe T={tokens} ({touched} experts) {name}", ms=ms,
                figure=f"{need / (ms * 1e-3) / 1e12:.2f} TB/s = {frac:.1%} of copy bw", frac_copy=frac,
                headline=headline, tokens=tokens, **extra)  # fmt: skip
        return ms

    grouped = row("grouped_mm", lambda: moe_grouped(*args, "swiglu_oai"), headline=True)
    fused = row("fused (default)", lambda: moe_fused(*args, "swiglu_oai"), headline=True)
    if sweep:
        best = (fused, "default")
        for n, k, w, s in SWEEP:
            cfg = {"block_n": n, "block_k": k, "num_warps": w, "num_stages": s}
            try:
                ms = row(f"fused {cfg}", lambda cfg=cfg: moe_fused(*args, "swiglu_oai", **cfg), **cfg)
            except Exception as exc:  # noqa: BLE001 (a config that does not fit: report and go on)
                log.add("error", name=f"moe fused {cfg}", trace=repr(exc)[:300])
                continue
            best = min(best, (ms, str(cfg)))
        log.add("bench", name=f"moe T={tokens} fused best of sweep {best[1]}", ms=best[0], figure="",
                headline=True)  # fmt: skip
    log.add("verdict", name=f"moe T={tokens}: grouped / fused time", value=grouped / fused, need=1.0,
            met=grouped >= fused)  # fmt: skip


if __name__ == "__main__":
    run_alone("moe", check, bench)
