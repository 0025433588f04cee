"""minakv: a small inference engine for agent workloads on MoE models, with cache engineering.

from minakv import Engine, SamplingParams
engine = Engine("tiny-gpt-oss")
print(engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minakv.engine import CacheOpError, Engine, Overloaded
    from minakv.outputs import RequestOutput, Usage
    from minakv.params import SamplingParams

__all__ = ["CacheOpError", "Engine", "Overloaded", "RequestOutput", "SamplingParams", "Usage"]
__version__ = "0.1.0"

# The engine imports torch. Client-side code (minakv.agent) must import without it, and importing any
# submodule runs this file first, so the public names load on first use (PEP 562), not here.
_HOME = {"CacheOpError": "minakv.engine", "Engine": "minakv.engine", "Overloaded": "minakv.engine",
         "RequestOutput": "minakv.outputs", "Usage": "minakv.outputs", "SamplingParams": "minakv.params"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'minakv' has no attribute {name!r}")
