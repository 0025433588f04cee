"""Profiling helpers the benchmarks share: the GPU busy fraction of a block (the union of its kernels'
intervals over the wall time), where the host threads spent it, and which host<->device syncs it made.

    with profiled(True) as found:      # found["gpu_busy"], found["wall_s"] after the block
        run_the_thing()

GPU busy, not a kernel's own speed, is what shows a slow engine: a fast kernel inside a loop that leaves the
device idle (bench/NOTES.md).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_decode import DEVICE


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@contextmanager
def profiled(enabled: bool, api_table: bool = False, keep: bool = False) -> Iterator[dict]:
    """Profile the block on CUDA; afterwards the dict holds wall_s and the GPU busy fractions (None on CPU
    or when disabled), and with `keep` the profile itself ("profile")."""
    found: dict = {"gpu_busy": None, "gpu_kernel_sum_fraction": None}
    if not enabled or DEVICE != "cuda":
        sync()
        start = time.perf_counter()
        yield found
        sync()
        found["wall_s"] = time.perf_counter() - start
        return
    from torch.profiler import ProfilerActivity, profile

    # Kernel times need only CUDA activity; recording every CPU op as well costs the host microseconds per
    # op, which would slow the very launches whose gaps are measured (so only with --api-table).
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if api_table else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        yield found
        sync()
        found["wall_s"] = wall = time.perf_counter() - start
    if keep:
        found["profile"] = prof
    try:  # a measurement, not the benchmark: never lose the run to a profiler quirk
        found.update(gpu_busy(prof, wall))
        if api_table:
            print_api_time(prof, wall)
    except Exception as exc:  # noqa: BLE001
        print(f"WARNING: could not read the profile: {exc!r}", flush=True)


def print_api_time(prof, wall_s: float, top: int = 14) -> None:
    """Where the host threads spent the profiled block: CUDA runtime calls (a long cudaMemcpyAsync or
    cudaStreamSynchronize is the host waiting for the device) and the ops with the most self CPU time."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"--- host time by op/runtime call (wall {wall_s * 1e3:.0f} ms): name | calls | self CPU ms")
    for e in rows[:top]:
        print(f"{e.key[:60]} | {e.count} | {e.self_cpu_time_total / 1e3:.1f}")
    api = [e for e in rows if e.key.startswith("cuda")]
    print("--- CUDA runtime calls: name | calls | CPU ms")
    for e in api[:top]:
        print(f"{e.key[:60]} | {e.count} | {e.self_cpu_time_total / 1e3:.1f}")


@contextmanager
def sync_warnings(enabled: bool) -> Iterator[None]:
    """torch's sync debug mode during the block: print each place in minakv that synchronised the host
    with the device (a hidden sync stalls the overlap loop), with its count."""
    if not enabled or DEVICE != "cuda":
        yield
        return
    import traceback
    import warnings
    from collections import Counter

    seen: Counter = Counter()
    old = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f for f in traceback.extract_stack()[:-1] if "minakv" in f.filename or "bench" in f.filename
        ]
        where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])
        seen[f"{str(message)[:50]} @ {where}"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
        print(f"--- host<->device syncs in the block: {sum(seen.values())}")
        for k, n in seen.most_common(20):
            print(f"{n:6d}  {k}")


def gpu_busy(prof, wall_s: float) -> dict:
    """Device time of a profile: the union of its kernel (and copy) intervals, and their plain sum
    (which counts overlapping streams twice), each over the wall time."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    total = sum(b - a for a, b in spans)
    union, reach = 0.0, float("-inf")
    for a, b in spans:
        if b > reach:
            union += b - max(a, reach)
            reach = b
    wall_us = wall_s * 1e6
    return {"gpu_busy": union / wall_us, "gpu_kernel_sum_fraction": total / wall_us, "kernels": len(spans)}
