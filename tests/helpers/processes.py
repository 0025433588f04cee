"""What the worker-process tests share: is a process still there, and killing a worker while requests
decode (the streams must end within 5 s, then the engine serves the same tokens as a reference engine)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from minakv import Engine, SamplingParams
from minakv.engine import Unavailable

# Engine settings of the worker-process tests: small pages and small chunks, so prefill pieces and decodes
# share steps (and pages cross between workers) within a few tokens.
SMALL_STEPS = {"device": "cpu", "page_size": 4, "kv_cache_tokens": 2048, "max_num_seqs": 8,
               "max_num_batched_tokens": 24}  # fmt: skip
AGAIN = [[1, 2, 3, 4, 5], {"message_tokens": [[1, 2, 3], [4, 5, 6, 7], [8, 9]],
                           "cache": {"drop": {"2": [1]}, "reposition": [2]}}]  # fmt: skip


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_while_decoding(engine: Engine, victim: int) -> list[list]:
    """SIGKILL `victim` once two of three long requests decode; every stream must end within 5 s with
    `Unavailable`. Returns the streams' outputs."""
    long = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [5] * 30]

    async def run() -> tuple[list, float]:
        async def consume(prompt):
            return [out async for out in engine.stream(prompt, long)]

        tasks = [asyncio.create_task(consume(p)) for p in prompts]
        while sum(1 for r in engine.scheduler.running if r.output_ids) < 2:
            await asyncio.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        return streams, time.monotonic() - killed

    streams, waited = asyncio.run(run())
    assert waited < 5
    for outs in streams:
        assert isinstance(outs[-1], Unavailable) and outs[-1].finish_reason == "error"
    return streams


def assert_recovered(engine: Engine, local: Engine, old_pids: list[int], params: SamplingParams) -> None:
    """After a worker death: exact accounting, an empty cache, the reference's tokens, no old process left."""
    engine.check()
    assert engine.stats()["pages_cached"] == 0  # the KV of every worker process is gone
    assert [o.token_ids for o in engine.generate(AGAIN, params)] == [
        o.token_ids for o in local.generate(AGAIN, params)
    ]
    assert not any(alive(pid) for pid in old_pids) and not set(engine.worker.pids) & set(old_pids)
    engine.check()
