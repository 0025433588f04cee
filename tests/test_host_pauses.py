"""Host pauses that leave the device idle (docs/engine.md, "Garbage collection" and the graph notes): what the
engine does about them, checked without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minakv.worker.graphs import DecodeGraphs


def test_the_first_engine_freezes_what_exists_before_it() -> None:
    """Libraries imported before the first engine hold hundreds of thousands of objects that live as long as
    the process: a full collection while serving must not scan them. Later engines freeze nothing (their
    objects stay collectable). In a fresh interpreter, since the test session has made engines already."""
    script = """
import gc
from minakv import Engine
class Old: pass
old = Old()
assert gc.get_freeze_count() == 0 and gc.is_tracked(old)
first = Engine("tiny-gpt-oss", kv_cache_tokens=256)
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen
assert not any(o is old for o in gc.get_objects())  # frozen: not among what a collection scans
new = Old()
Engine("tiny-gpt-oss", kv_cache_tokens=256)
assert gc.get_freeze_count() == frozen and any(o is new for o in gc.get_objects())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize(
    "captured, wanted, reused",
    [
        ([(8, 16384)], (4, 16384), (8, 16384)),  # twice the batch: reused
        ([(16, 16384)], (4, 16384), None),  # four times: capture instead
        ([(8, 65536)], (8, 16384), (8, 65536)),  # four times the key bound: reused
        ([(8, 131072)], (8, 16384), None),  # eight times: capture instead
        ([(4, 8192)], (8, 8192), None),  # smaller than needed: never
        ([(8, 32768), (8, 16384), (16, 16384)], (8, 16384), (8, 16384)),  # the smallest that fits
    ],
)
def test_a_step_reuses_a_graph_of_a_slightly_larger_bucket(captured, wanted, reused) -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the choice needs only the captured keys
    graphs.graphs = {key: key for key in captured}
    assert graphs._covering(*wanted) == reused
