"""What the kernel tests share: they run the Triton kernels in Triton's CPU interpreter.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports Triton when there is no GPU (Triton jits
its standard library at import, so the variable must come first). `interpreted` marks tests that need it.
"""

from __future__ import annotations

import pytest

from minakv.ops.triton_util import interpreter_ready

interpreted = pytest.mark.skipif(
    not interpreter_ready(),
    reason="needs Triton's CPU interpreter (set TRITON_INTERPRET=1 before Triton loads)",
)
