"""minakv: a small inference engine for agent workloads on MoE models, with cache engineering.

from minakv import Engine, SamplingParams
engine = Engine("tiny-gpt-oss")
print(engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text)
"""

from minakv.engine import CacheOpError, Engine, Overloaded
from minakv.outputs import RequestOutput, Usage
from minakv.params import SamplingParams

__all__ = ["CacheOpError", "Engine", "Overloaded", "RequestOutput", "SamplingParams", "Usage"]
__version__ = "0.1.0"
