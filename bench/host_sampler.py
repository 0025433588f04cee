"""Where a thread's time goes: a sampling profiler for one thread, inside the benchmark's own process.

A background thread reads the target thread's Python stack (`sys._current_frames`) every `interval`
seconds and counts each function on it (inclusive: a function counts once per sample however deep). On a
GPU run this says what the engine thread does while the device idles: waiting for results
(`Worker.collect`), launching kernels (`Worker.launch`), or planning (`Scheduler.schedule`). No ptrace, so
it works where py-spy cannot attach.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


def _stack(frame) -> tuple[list[str], str]:
    """The functions on the stack (as `name (file:first line)`), and the innermost line being run."""
    functions, innermost = [], ""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        short = path.split("/minakv/")[-1] if "/minakv/" in path else path.rsplit("/", 1)[-1]
        functions.append(f"{code.co_qualname} ({short}:{code.co_firstlineno})")
        innermost = innermost or f"{code.co_qualname} ({short}:{frame.f_lineno})"
        frame = frame.f_back
    return functions, innermost


@contextmanager
def sample_thread(thread: threading.Thread, interval: float = 0.002) -> Iterator[dict]:
    """Sample `thread` during the block; afterwards the dict holds `samples` and `top`
    (function -> fraction of samples that had it on the stack, the 40 most frequent), and `leaf`
    (the innermost frame's function and line -> fraction)."""
    found: dict = {"samples": 0, "top": {}, "leaf": {}}
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            frame = sys._current_frames().get(thread.ident)
            if frame is None:
                continue
            functions, innermost = _stack(frame)
            found["samples"] += 1
            leaf[innermost] += 1
            inclusive.update(set(functions))

    sampler = threading.Thread(target=run, name="host-sampler", daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        yield found
    finally:
        stop.set()
        sampler.join()
        n = max(found["samples"], 1)
        found["wall_s"] = time.perf_counter() - start
        found["top"] = {k: round(v / n, 4) for k, v in inclusive.most_common(40)}
        found["leaf"] = {k: round(v / n, 4) for k, v in leaf.most_common(20)}


def print_samples(found: dict, title: str) -> None:
    print(f"\n--- {title}: {found['samples']} samples over {found['wall_s']:.2f} s ---")
    for name, frac in found["top"].items():
        print(f"{frac:7.3f}  {name}")
    print("innermost:")
    for name, frac in found["leaf"].items():
        print(f"{frac:7.3f}  {name}")
