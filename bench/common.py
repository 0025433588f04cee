"""Shared helpers for the benchmarks: timing, the measured copy-bandwidth ceiling, error and tables."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch
import triton


def bench_ms(fn: Callable[[], object]) -> float:
    """Median time of fn in milliseconds (CUDA events, after warm-up)."""
    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def paged_slots(lengths: list[int], page_size: int, num_pages: int | None = None, device: str = "cuda"):
    """Slot lists of requests whose pages come in random order (page_size 1: fully scattered)."""
    pages_each = [-(-n // page_size) for n in lengths]
    total = num_pages or sum(pages_each)
    order = torch.randperm(total, device=device)
    out, first = [], 0
    for n, pages in zip(lengths, pages_each):
        mine = order[first : first + pages]
        first += pages
        out.append((mine[:, None] * page_size + torch.arange(page_size, device=device)).flatten()[:n])
    return torch.cat(out).to(torch.int32), total * page_size


class Log:
    """Collects check and benchmark rows; prints them as they come and writes JSON under $OUT."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.start = time.time()

    def add(self, kind: str, **row: object) -> None:
        row = {"kind": kind, **row}
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def save(self, name: str = "results.json") -> None:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, name), "w") as f:
                json.dump(self.rows, f, indent=1)

    def table(self) -> None:
        print(f"\n=== summary ({time.time() - self.start:.0f} s) ===")
        for r in self.rows:
            if r["kind"] == "check":
                ok = "PASS" if r["err"] <= r["tol"] else "FAIL"
                print(f"check {r['name']:<48} err {r['err']:.2e} tol {r['tol']:.0e} {ok}")
        for r in self.rows:
            if r["kind"] == "bench" and r.get("headline"):
                print(f"bench {r['name']:<48} {r['ms']:.4f} ms  {r['figure']}")
        for r in self.rows:
            if r["kind"] == "verdict":
                print(
                    f"goal  {r['name']:<48} {r['value']:.3f} (need >= {r['need']}) {'MET' if r['met'] else 'MISSED'}"
                )


def run_alone(name: str, check: Callable[[Log], None], bench: Callable[[Log, float], None]) -> None:
    """A benchmark module run as a script: checks, then timings against this run's copy bandwidth."""
    log = Log()
    bw = copy_bandwidth()
    log.add("bench", name="copy bandwidth 2 GiB", ms=0.0, figure=f"{bw / 1e12:.2f} TB/s", headline=True)
    check(log)
    bench(log, bw)
    log.table()
    log.save(f"{name}.json")
