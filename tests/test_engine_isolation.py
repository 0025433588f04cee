"""A step that raises does not end everyone's request: the running requests are retried one by one
(`Scheduler.quarantine`), the one that fails alone ends with an error, the others finish with exactly the
tokens of a clean run, and the pool accounting stays exact."""

from __future__ import annotations

import asyncio

import pytest
from helpers.models import tiny_model

from minakv import Engine, SamplingParams

POISON = [7, 7, 7, 7, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("gpt_oss")


def prompts() -> list[list[int]]:
    return [[i + 1, 2 * i + 3, i + 5, 11, 12, 13] for i in range(5)]


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list:
    async def one(p: list[int]):
        return [out async for out in engine.stream(p, params)]

    async def main():
        return await asyncio.gather(*(one(p) for p in batch))

    return asyncio.run(main())


@pytest.mark.parametrize("when", [0, 3])  # fail at the poisoned request's first sample, or later
def test_a_failing_request_ends_alone(model, when: int) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    clean = run(Engine(model, page_size=4, kv_cache_tokens=1024), prompts(), params)
    engine = Engine(model, page_size=4, kv_cache_tokens=1024)
    launch = engine.worker.launch

    def faulty(batch):
        for r in batch.scheduled:
            if r.prompt_ids == POISON and len(r.output_ids) + r.pending >= when:
                raise RuntimeError("injected fault")
        return launch(batch)

    engine.worker.launch = faulty
    batch = prompts()
    batch.insert(2, POISON)
    outs = run(engine, batch, params)
    assert outs[2][-1].finish_reason == "error"
    rest = outs[:2] + outs[3:]
    for got, want in zip(rest, clean):
        assert got[-1].finish_reason == "length"
        assert [t for o in got for t in o.token_ids] == [t for o in want for t in o.token_ids]
    engine.check()
    assert engine.scheduler.counters.get("errors", 0) == 0  # nobody else was failed
