"""The engine through its Triton kernels, on CPU: segment and decode attention, rotate-and-store,
re-rotation, RMSNorm and the fused MoE run in Triton's interpreter (`triton_util.TRITON_ON_CPU`), as they
do on a GPU, in float32, against the float64 walk oracle.

The kernels are each tested against float64 references (tests/test_ops_*.py), and the engine is tested
with the torch references (tests/test_engine_walk.py); this joins the two: the metadata the engine builds
for the kernels (key lists, segment plans, slots, positions after drops and repositions) is what the
kernels expect. The programs include the three that once failed on the GPU in bf16 (found to be routing
noise; see tests/test_engine_gpu.py). The interpreter is slow, so CI runs three cases; `-m slow` runs
every program at every engine shape on both families.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.models import tiny_model
from helpers.programs import HISTORY, assert_matches_oracle, compiles
from helpers.triton import interpreted

from minakv import Engine, SamplingParams
from minakv.ops import triton_util

GREEDY = SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)
PROGRAMS = HISTORY + [([[5, 6, 7], [8, 9], [10, 11, 12, 13]], {"drop": {"2": [1]}, "reposition": [2]})]
SHAPES = {
    "page1": {"page_size": 1, "max_num_batched_tokens": 512, "kv_cache_tokens": 1024},
    "page16-chunked": {"page_size": 16, "max_num_batched_tokens": 7, "kv_cache_tokens": 1024},
    "page7-small-pool": {"page_size": 7, "max_num_batched_tokens": 13, "kv_cache_tokens": 140},
}
SLOW = pytest.mark.slow  # the interpreter takes ~10-40 s a program: CI runs one per case


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(triton_util, "TRITON_ON_CPU", True)


@interpreted
@pytest.mark.parametrize(
    "family,shape,program",
    [
        ("gpt_oss", "page1", 0),
        ("gpt_oss", "page16-chunked", 3),
        ("minimax_m2", "page7-small-pool", 2),
        *[
            pytest.param(f, s, p, marks=SLOW)
            for f in ("gpt_oss", "minimax_m2")
            for s in SHAPES
            for p in range(4)
        ],
    ],
)
def test_engine_through_the_kernels_matches_the_walk(kernels_on_cpu, family, shape, program) -> None:
    model64 = tiny_model(family)
    engine = Engine(tiny_model(family, dtype=torch.float32), **SHAPES[shape])
    rng = random.Random(program)
    segments, cache = PROGRAMS[program]
    assert compiles(segments, cache)
    others = [[rng.randrange(384) for _ in range(rng.randint(1, 5))] for _ in range(2)]
    outs = engine.generate([others[0], {"message_tokens": segments, "cache": cache}, others[1]], GREEDY)
    assert_matches_oracle(model64, segments, cache, outs[1], tol=1e-4)
    for prompt, out in zip(others, (outs[0], outs[2])):
        assert_matches_oracle(model64, [prompt], {}, out, tol=1e-4)
    again = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[
        0
    ]  # full pages from the cache
    assert_matches_oracle(model64, segments, cache, again, tol=1e-4)
    engine.check()
