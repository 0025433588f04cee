"""The 30-minute soak of `minakv serve` (bench/soak.py): mixed good, bad, cancelled and cache-operation
traffic; no 5xx, exact page accounting at idle, flat memory. Slow: CI skips it; its figures are in
bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_thirty_minute_soak(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "30"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=40 * 60, check=False)
    verdict = next(r for r in json.loads((tmp_path / "soak.json").read_text()) if r["kind"] == "soak_verdict")
    assert done.returncode == 0 and verdict["ok"], verdict
