"""bench/h200_open_items.sh lists its steps in its header and runs them from a `case`: every listed step
must have its case (a missing one only prints "unknown step" on the device, after the call is paid for)."""

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "h200_open_items.sh"


def test_every_listed_step_has_a_case() -> None:
    text = SCRIPT.read_text()
    listed = set(re.findall(r"^#   (\w+)\s+issue", text, flags=re.MULTILINE))
    cases = set(re.findall(r"^        (\w+)\) ", text, flags=re.MULTILINE))
    assert len(listed) > 10
    assert listed == cases, f"listed without a case: {listed - cases}; case not listed: {cases - listed}"
