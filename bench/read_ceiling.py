"""How fast can one kernel read N megabytes? The ceiling for the decode GEMVs' sizes, not just for 1 GiB.

A decode step at batch 1 is a chain of reads of 3-60 MB each (a projection's weight, one token's experts).
The bytes bound of bench/RESULTS.md divides by the copy bandwidth of a 1 GiB copy; a kernel that reads
20 MB also pays its launch, the ramp of its first wave and its tail, which no layout or instruction count
removes. This measures that floor: for each size, kernels that do nothing but read (and reduce) a buffer,

    torch sum       buf.sum(): torch's reduction kernel (a read-only stream)
    triton read v   each thread v 16-byte loads in flight, summed (a program per 16 KB * v)

each inside one CUDA graph over enough distinct buffers (>= 512 MB) that the 50 MB L2 holds none of them,
as the layers of a decode step do. Reported: GB/s of bytes read and the fraction of the 1 GiB copy
bandwidth measured in the same run (bench/common.py: read + written bytes over time).

    python3 bench/read_ceiling.py [--sizes-mb 3,6,17,34,64,256,1024]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Log, bench_ms, copy_bandwidth


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, UNROLL: tl.constexpr):
    """Sum of int32 words; each thread keeps UNROLL 16-byte loads in flight before adding any."""
    block = 128 * 4 * UNROLL  # words per program: 4 warps x 32 lanes x 4 words x UNROLL
    offs = tl.program_id(0) * block + tl.arange(0, UNROLL)[:, None] * 512 + tl.arange(0, 512)[None, :]
    words = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(words, 1), 0))


def graph_ms(fns: list, reps: int = 3) -> float:
    """Milliseconds per call of one replay of a CUDA graph that runs every fn once, reps times."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    return bench_ms(graph.replay) / (reps * len(fns))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="3,6,17,34,64,256,1024")
    args = p.parse_args()
    log = Log()
    copy = copy_bandwidth()
    log.add("bench", name="copy bandwidth (1 GiB copy)", tb_s=copy / 1e12)
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        n_words = int(mb * 1e6) // 4
        count = max(2, int(512 / mb) + 1)
        bufs = [torch.randint(0, 7, (n_words,), dtype=torch.int32, device="cuda") for _ in range(count)]
        rows = {"torch sum": [lambda b=b: b.sum() for b in bufs]}
        for unroll in (1, 2, 4, 8):
            grid = (triton.cdiv(n_words, 512 * unroll),)
            out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
            rows[f"triton read v{unroll}"] = [
                lambda b=b, u=unroll, g=grid, o=out, n=n_words: _read_kernel[g](b, o, n, UNROLL=u)
                for b in bufs
            ]
        for name, fns in rows.items():
            ms = graph_ms(fns)
            gb_s = n_words * 4 / (ms * 1e-3) / 1e9
            log.add("bench", name=f"{mb:g} MB {name}", ms=ms, gb_s=gb_s, frac_copy=gb_s * 1e9 / copy)
        del bufs
        torch.cuda.empty_cache()
    print("\nsize | reader | us | GB/s | of copy")
    for r in log.rows[1:]:
        size, _, name = r["name"].partition(" MB ")
        print(f"{size} MB | {name} | {r['ms'] * 1e3:.1f} | {r['gb_s']:.0f} | {r['frac_copy']:.2f}")
    log.save("read_ceiling.json")


if __name__ == "__main__":
    main()
