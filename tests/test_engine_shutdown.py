"""`Engine.shutdown`: no new requests, in-flight ones finish within the timeout or end with an error the
stream sees, the background thread stops, and the pool accounting is exact afterwards."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers.models import tiny_model

from minakv import Engine, SamplingParams
from minakv.engine import Overloaded


@pytest.fixture(scope="module")
def model():
    return tiny_model("gpt_oss")


async def collect(engine: Engine, prompt: list[int], max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out async for out in engine.stream(prompt, params)]


def run_then_shutdown(engine: Engine, max_tokens: int, timeout: float) -> list[list]:
    async def main() -> list[list]:
        tasks = [asyncio.create_task(collect(engine, [i + 1, i + 2, i + 3], max_tokens)) for i in range(4)]
        while not all(engine.scheduler.running or t.done() for t in tasks):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # they are decoding
        await asyncio.to_thread(engine.shutdown, timeout)
        return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_shutdown_ends_long_streams_with_an_error(model) -> None:
    engine = Engine(model, page_size=4, kv_cache_tokens=2048)
    streams = run_then_shutdown(engine, max_tokens=100_000, timeout=0.1)
    for outs in streams:
        assert outs[-1].finish_reason == "error"  # each stream got a final output, none hangs
    assert not engine._thread.is_alive()
    engine.check()
    with pytest.raises(Overloaded):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_shutdown_lets_short_requests_finish(model) -> None:
    engine = Engine(model, page_size=4, kv_cache_tokens=2048)
    streams = run_then_shutdown(engine, max_tokens=12, timeout=30)
    assert all(outs[-1].finish_reason == "length" for outs in streams)
    assert all(sum(len(o.token_ids) for o in outs) == 12 for outs in streams)
    assert threading.active_count() >= 1 and not engine._thread.is_alive()
    engine.check()


def test_engine_as_a_context_manager(model) -> None:
    with Engine(model, page_size=4, kv_cache_tokens=512) as engine:
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and engine.mailbox.closing
