"""Host pauses that leave the device idle (docs/engine.md, "Garbage collection" and the graph notes): what the
engine does about them, checked without a GPU."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
import weakref

import pytest

from minakv import SamplingParams, gc_pauses
from minakv.worker.graphs import DecodeGraphs


def test_the_first_engine_freezes_what_exists_before_it() -> None:
    """Libraries imported before the first engine hold hundreds of thousands of objects that live as long as
    the process: a full collection while serving must not scan them. Later engines freeze nothing (their
    objects stay collectable). The young threshold is raised. In a fresh interpreter, since the test session
    has made engines already."""
    script = """
import gc
from minakv import Engine
class Old: pass
old = Old()
assert gc.get_freeze_count() == 0 and gc.is_tracked(old)
gc.set_threshold(700, 10, 10)  # CPython 3.12's default
first = Engine("tiny-gpt-oss", kv_cache_tokens=256)
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
# young collections far apart (serving's short-lived objects), no automatic full ones (gc_pauses.collect_when_due)
assert gc.get_threshold() == (50_000, 10, 1_000_000)
assert not any(o is old for o in gc.get_objects())  # frozen: not among what a collection scans
new = Old()
Engine("tiny-gpt-oss", kv_cache_tokens=256)
assert gc.get_freeze_count() == frozen and any(o is new for o in gc.get_objects())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize(
    "captured, wanted, reused",
    [
        ([8], 4, 8),  # twice the batch: reused
        ([16], 4, None),  # four times: capture instead
        ([4], 8, None),  # smaller than needed: never
        ([32, 16, 64], 16, 16),  # the smallest that fits
        ([48, 64], 32, 48),
    ],
)
def test_a_step_reuses_a_graph_of_a_slightly_larger_bucket(captured, wanted, reused) -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the choice needs only the captured buckets
    graphs.graphs = {key: key for key in captured}
    assert graphs._covering(wanted) == reused


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
