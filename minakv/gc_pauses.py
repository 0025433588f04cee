"""Keeping Python's garbage collector from stopping the engine while it serves.

A collection holds the GIL, so while it runs the engine thread launches nothing and the device goes idle.
Two things make collections long or frequent in a serving process:

    full collections   scan every tracked object: the imported libraries' hundreds of thousands of them,
                       and every item of every list (a request's growing outputs: kept in int arrays)
    young collections  run every 700 net allocations (CPython 3.12); a serving step makes hundreds of
                       short-lived objects per request, and each young collection promotes what is briefly
                       alive, which in turn sets off full collections

`quiet_gc`, run by the first engine of a process (and by each worker process once its model is loaded),
freezes what exists (the imports), spaces the young collections out and leaves full collections to
`collect_when_due`, which the engine thread (and a worker process's loop) calls between steps: a full
collection when the engine is idle, or, busy, once every few minutes (garbage cycles that reach the oldest
generation are still freed). docs/engine.md ("Garbage collection") has the measurements.
"""

from __future__ import annotations

import atexit
import gc
import time

GC_YOUNG_THRESHOLD = 50_000  # net allocations between young collections (CPython: 700 in 3.12, 2,000 in 3.13)
# middle collections between automatic full ones (CPython: 10): never, in practice
GC_OLD_THRESHOLD = 1_000_000
IDLE_EVERY_S = 10.0  # an idle engine collects at most this often
BUSY_EVERY_S = 300.0  # a busy one this often: one pause of ~0.1-0.2 s in minutes of serving
_last_full = [time.monotonic()]
_quieted = [False]


def quiet_gc() -> None:
    """Move what exists now (imported libraries: hundreds of thousands of objects that live as long as the
    process) out of the garbage collector's sight. A full collection scans every tracked object, so while
    serving it held the engine thread for 0.1-0.4 s with the device idle (bench/gpu_gaps.py). Once per
    process, at the first engine, after a collection: only live objects are frozen, and later engines'
    objects stay collectable (a frozen cycle is never freed). At exit they are unfrozen for the
    interpreter's last collection.

    Also raises the young generation's threshold and the oldest's (never lowers them; a disabled collector
    stays disabled), so that full collections happen only in `collect_when_due`.
    A serving step allocates hundreds of short-lived objects per request; at 700 a young collection ran
    every few steps and, by promoting what was briefly alive, a full one every second or so at 512 streams
    (tens of ms each, every thread stopped). At 50,000 none ran in 1,000 steps (bench/RESULTS.md)."""
    if _quieted[0]:  # (not gc.get_freeze_count(): something else may have frozen objects before us)
        return
    _quieted[0] = True
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    young, middle, old = gc.get_threshold()
    if young:
        gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, max(old, GC_OLD_THRESHOLD))
    _last_full[0] = time.monotonic()


def collect_when_due(idle: bool, now: float | None = None) -> bool:
    """A full collection if one is due: every IDLE_EVERY_S while the engine has nothing to run (a pause
    then costs no step), every BUSY_EVERY_S while it serves. `quiet_gc` turned the automatic ones off:
    at 512 streams on the H100 they still came every 1.5 s, ~180 ms each (21 in a 32 s decode phase,
    bench/RESULTS.md). Returns whether it collected (False with the collector disabled)."""
    now = time.monotonic() if now is None else now
    if not gc.isenabled() or now - _last_full[0] < (IDLE_EVERY_S if idle else BUSY_EVERY_S):
        return False
    gc.collect()
    _last_full[0] = time.monotonic()
    return True
