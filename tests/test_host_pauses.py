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
assert gc.get_threshold() == (50_000, 10, 10)  # young collections far apart (serving's short-lived objects)
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
