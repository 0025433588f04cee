"""Where the GPU idles, and what the engine thread was doing meanwhile.

GPU busy (kernel time over wall) says how much the device idled, not why. This module answers why for a
profiled block: it wraps the engine's phases (drain, schedule, launch, prepare, collect, update, deliver)
with host timestamps, puts a marker kernel at the block's start to align the host clock with the
profiler's, and attributes every idle interval of the device timeline to the phases the engine thread
was in during it:

    device   |kernels|.....idle.....|kernels|..idle..|kernels|
    host       launch | update | schedule | launch  | prepare ...
                        ^^^^^^^^^^^^^^^^^^^    -> idle time charged to update, schedule, launch

A gap charged to "collect" means the host waited for a step the device had already finished (should not
happen); to "launch" that an eager step's launches trail its kernels; to "other" that the engine thread
was outside the wrapped phases (for example waiting for the GIL between them, or for new requests).

    with phase_log(engine) as phases:
        marker = mark()                 # right after the profiler started and the device is idle
        ... run the block ...
    report = attribute(prof, marker, phases)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MIN_GAP_US = 50.0  # shorter idle intervals are launch latency, not host work


@contextmanager
def phase_log(engine) -> Iterator[list[tuple[str, float, float]]]:
    """Record (phase, start, end) host times (perf_counter seconds) of the engine thread's phases."""
    phases: list[tuple[str, float, float]] = []
    targets = [
        (engine.scheduler, "schedule"), (engine.worker, "launch"), (engine.scheduler, "prepare"),
        (engine.worker, "collect"), (engine.scheduler, "update"), (engine.mailbox, "deliver"), (engine, "_drain"),
    ]  # fmt: skip

    def wrap(name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases.append((name.lstrip("_"), t0, time.perf_counter()))

        return timed

    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in targets]
    for obj, name in targets:
        setattr(obj, name, wrap(name, getattr(obj, name)))
    try:
        yield phases
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)  # back to the class's method
            else:
                setattr(obj, name, old)


def mark() -> float:
    """Launch a marker kernel on an idle device; its host launch time (the alignment point)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(
        1000
    )  # a `spin_kernel` of ~1 us: its start is the host time t, give or take launch latency
    return t


def attribute(prof, marker: float, phases: list[tuple[str, float, float]], top: int = 8) -> dict:
    """Idle device time by the engine thread's phase, from a torch.profiler profile of the block."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spins = [e for e in kernels if "spin" in e.name]
    if not spins:
        return {"error": "no marker kernel in the profile"}
    origin = spins[0].time_range.start  # profiler us at host time `marker`
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels if e.time_range.start >= origin)
    gaps, reach = [], spans[0][1] if spans else origin
    for a, b in spans[1:]:
        if a - reach >= MIN_GAP_US:
            gaps.append((reach, a))
        reach = max(reach, b)

    def host(us: float) -> float:
        return marker + (us - origin) * 1e-6

    by_phase: Counter[str] = Counter()
    worst = []
    for g0, g1 in gaps:
        h0, h1 = host(g0), host(g1)
        covered = Counter()
        for name, p0, p1 in phases:
            overlap = min(h1, p1) - max(h0, p0)
            if overlap > 0:
                covered[name] += overlap
        covered["other"] = max(0.0, (h1 - h0) - sum(covered.values()))
        by_phase.update(covered)
        worst.append(((g1 - g0) / 1e3, (g0 - origin) / 1e3, dict(covered.most_common(3))))
    worst.sort(key=lambda w: -w[0])
    idle = sum(g1 - g0 for g0, g1 in gaps) / 1e6
    phase_time: Counter[str] = Counter()
    for name, p0, p1 in phases:
        phase_time[name] += p1 - p0
    return {
        "gaps": len(gaps), "idle_s": idle, "idle_by_phase_s": dict(by_phase.most_common()),
        "worst_gaps_ms": [
            (round(ms, 2), round(at, 1), {k: round(v * 1e3, 2) for k, v in c.items()}) for ms, at, c in worst[:top]
        ],
        "phase_time_s": dict(phase_time.most_common()),
    }  # fmt: skip


def print_report(report: dict, title: str) -> None:
    print(f"--- device idle, {title}: {report.get('gaps', 0)} gaps >= {MIN_GAP_US:.0f} us, "
          f"{report.get('idle_s', 0.0) * 1e3:.1f} ms idle ---")  # fmt: skip
    if "error" in report:
        print(f"  {report['error']}")
        return
    total = report["phase_time_s"]
    for name, s in report["idle_by_phase_s"].items():
        print(f"  {name:<10} idle {s * 1e3:8.1f} ms   (phase total {total.get(name, 0.0) * 1e3:8.1f} ms)")
    for ms, at, covered in report["worst_gaps_ms"]:
        print(f"  gap {ms:7.2f} ms at {at:8.1f} ms: {covered}")
