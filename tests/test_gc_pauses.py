"""The engine's garbage-collector settings (minakv/gc_pauses.py, docs/engine.md "Garbage collection"): after
`quiet_gc` no allocation pattern sets off a full collection by itself; `collect_when_due` runs them, idle
or every few minutes, and really collects cycles."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
import weakref

import pytest

from minakv import SamplingParams, gc_pauses


@pytest.fixture
def full_collections():
    seen: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(info["collected"])

    gc.callbacks.append(on_gc)
    yield seen
    gc.callbacks.remove(on_gc)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def make_cycles(n: int) -> list[weakref.ref]:
    """n two-object cycles, dropped at once; weak references to one side of each."""
    refs = []
    for _ in range(n):
        a, b = Node(), Node()
        a.other, b.other = b, a
        refs.append(weakref.ref(a))
    return refs


@pytest.mark.skipif(not gc.isenabled(), reason="the collector is disabled in this process")
def test_an_engine_leaves_full_collections_to_its_idle_time(full_collections, monkeypatch):
    """The engine's thresholds leave no automatic full collection, and its thread runs one once idle."""
    from minakv import Engine

    monkeypatch.setattr(gc_pauses, "IDLE_EVERY_S", 0.2)
    engine = Engine("tiny-gpt-oss", device="cpu", dtype="float32", kv_cache_tokens=1024, max_model_len=256)
    try:
        young, _, old = gc.get_threshold()
        assert young >= gc_pauses.GC_YOUNG_THRESHOLD and old >= gc_pauses.GC_OLD_THRESHOLD

        async def one() -> None:  # through the engine's thread (generate() alone steps in the caller's)
            async for _ in engine.stream([1, 2, 3], SamplingParams(max_tokens=4)):
                pass

        asyncio.run(one())
        full_collections.clear()
        refs = make_cycles(1000)  # garbage only a full collection is sure to free (they may age meanwhile)
        deadline = time.monotonic() + 5
        while not full_collections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert full_collections, "the idle engine thread ran no full collection"
        assert all(r() is None for r in refs)
    finally:
        engine.shutdown()


@pytest.mark.skipif(not gc.isenabled(), reason="the collector is disabled in this process")
def test_collect_when_due_collects_cycles(full_collections):
    now = time.monotonic()
    gc_pauses._last_full[0] = now
    assert not gc_pauses.collect_when_due(idle=True, now=now + gc_pauses.IDLE_EVERY_S / 2)
    assert not gc_pauses.collect_when_due(idle=False, now=now + gc_pauses.IDLE_EVERY_S * 2)
    assert full_collections == []
    refs = make_cycles(1000)
    gc.collect(0)  # (what young collections do: the cycles move to older generations)
    gc.collect(1)
    assert gc_pauses.collect_when_due(idle=True, now=now + gc_pauses.IDLE_EVERY_S * 2)
    assert len(full_collections) == 1
    assert all(r() is None for r in refs)
    later = gc_pauses._last_full[0]
    assert gc_pauses.collect_when_due(idle=False, now=later + gc_pauses.BUSY_EVERY_S + 1)
    assert len(full_collections) == 2


def test_quiet_gc_also_after_someone_else_froze():
    """A process that froze objects before the first engine (an interpreter start-up hook, a library) still
    gets the engine's thresholds: once, the GPU machine's runs kept CPython's (their full collections took
    ~180 ms each, the frozen imports scanned again)."""
    code = (
        "import gc; gc.freeze(); from minakv import gc_pauses; gc_pauses.quiet_gc(); "
        "y, _, o = gc.get_threshold(); "
        "assert y >= gc_pauses.GC_YOUNG_THRESHOLD and o >= gc_pauses.GC_OLD_THRESHOLD, gc.get_threshold()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
