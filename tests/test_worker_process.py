"""The worker in a process of its own (`prefill_devices=["cpu"]` alone, minakv/worker/process.py):
the same tokens as the in-process engine (greedy, seeded sampling, drop and reposition, overlap on), and
supervision: a killed worker ends its requests with an error within 5 s, the accounting stays exact, the
engine restarts the worker and serves again, and no process is left behind after shutdown or exit.

Each engine here spawns a child that imports torch (a few seconds), so one engine serves the module."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.processes import alive

from minakv import Engine, SamplingParams
from minakv.worker.process import WorkerDied, WorkerProcess

PRESET = "tiny-minimax-m2"  # token ids in, no tokenizer to build: the quickest child to start
SETTINGS = {"device": "cpu", "page_size": 4, "kv_cache_tokens": 1024, "max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11],
    {"message_tokens": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "cache": {"drop": {"2": [1]}, "reposition": [2]}},
    {
        "message_tokens": [[5] * 9, [6, 7, 8], [9, 10], [11]],
        "cache": {"drop": {"2": [0], "3": [1]}, "reposition": [3]},
    },
]


@pytest.fixture(scope="module")
def engines():
    local = Engine(PRESET, **SETTINGS)
    remote = Engine(PRESET, prefill_devices=["cpu"], **SETTINGS)
    yield local, remote
    remote.shutdown()
    local.shutdown()


def outputs(engine: Engine, params: SamplingParams) -> list[tuple[list[int], object]]:
    return [(o.token_ids, o.usage) for o in engine.generate(PROMPTS, params)]


def tokens(engine: Engine, params: SamplingParams) -> list[list[int]]:
    """(after a restart the cache starts empty, so the usage's cached tokens differ from the other engine's)"""
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_same_tokens_as_the_in_process_engine(engines, params) -> None:
    local, remote = engines
    assert remote.config.overlap and remote.worker.pid != os.getpid()
    assert isinstance(remote.worker, WorkerProcess) and len(remote.worker.pids) == 1  # one worker, not a pair
    assert outputs(remote, params) == outputs(local, params)
    assert outputs(remote, params) == outputs(local, params)  # the second round reads cached pages
    assert remote.stats()["cache_hit_tokens"] == local.stats()["cache_hit_tokens"] > 0
    remote.check()
    local.check()


def test_killed_worker_during_generate_raises_and_the_engine_recovers(engines) -> None:
    # (before the stream test: once the background loop runs, generate goes through it and does not raise)
    local, remote = engines
    old = remote.worker.pid
    long = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    kill = threading.Timer(0.5, os.kill, (old, signal.SIGKILL))
    kill.start()
    try:
        with pytest.raises(WorkerDied, match="died"):
            remote.generate(PROMPTS[:2], long)
    finally:
        kill.cancel()
    remote.check()
    assert tokens(remote, GREEDY) == tokens(local, GREEDY)
    assert remote.worker.pid != old and not alive(old)


def test_killed_worker_fails_its_streams_fast_then_the_engine_serves_again(engines, caplog) -> None:
    local, remote = engines
    old = remote.worker.pid
    long = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)

    async def run() -> tuple[list, float]:
        async def consume(prompt):
            return [out async for out in remote.stream(prompt, long)]

        tasks = [asyncio.create_task(consume(p)) for p in PROMPTS[:3]]
        while sum(1 for r in remote.scheduler.running if r.output_ids) < 3:  # all three are decoding
            await asyncio.sleep(0.01)
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        return streams, time.monotonic() - killed

    with caplog.at_level(logging.ERROR, logger="minakv.engine"):
        streams, waited = asyncio.run(run())
    assert waited < 5
    assert all(outs[-1].finish_reason == "error" for outs in streams)
    assert all(0 < sum(len(o.token_ids) for o in outs) < 3000 for outs in streams)
    assert any("died" in r.getMessage() and "restarting the worker" in r.getMessage() for r in caplog.records)
    remote.check()
    assert remote.stats()["pages_cached"] == 0  # the KV died with the worker: nothing cached survives
    assert tokens(remote, SAMPLED) == tokens(local, SAMPLED)  # the restarted worker serves as before
    assert remote.worker.pid != old and not alive(old)
    remote.check()


def test_shutdown_leaves_no_worker_process() -> None:
    engine = Engine(PRESET, prefill_devices=["cpu"], **SETTINGS)
    pid = engine.worker.pid
    assert alive(pid)
    engine.generate([[1, 2, 3]], GREEDY)
    engine.shutdown()
    assert not alive(pid)


def test_interpreter_exit_leaves_no_worker_process() -> None:
    script = (
        "from minakv import Engine\n"
        "if __name__ == '__main__':\n"
        f"    e = Engine({PRESET!r}, prefill_devices=['cpu'], **{SETTINGS!r})\n"
        "    print(e.worker.pid, flush=True)\n"  # no shutdown: exit must still stop the child
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="same one device"):
        Engine(PRESET, prefill_devices=["cpu"], decode_devices=["cuda:0"], **SETTINGS)
    with pytest.raises(ValueError, match="could not start"):  # the child's error, not a hang
        Engine("no-such-model-dir", prefill_devices=["cpu"], **SETTINGS)


def test_serve_flags() -> None:
    from minakv.server.serve import parser

    args = parser().parse_args([PRESET, "--prefill-devices", "cpu", "--decode-devices", "cpu"])
    assert args.prefill_devices == args.decode_devices == ["cpu"]


def test_gpt_oss_text_prompts_match_the_in_process_engine() -> None:
    """The other family, with a tokenizer: the parent loads it, the child loads only the model."""
    prompts = [
        "Hello there",
        {"message_tokens": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "cache": {"drop": {"2": [1]}}},
    ]
    with Engine("tiny-gpt-oss", **SETTINGS) as local:
        expected = [(o.token_ids, o.text) for o in local.generate(prompts, SAMPLED)]
    with Engine("tiny-gpt-oss", prefill_devices=["cpu"], **SETTINGS) as remote:
        assert remote.tokenizer is not None and remote.arch == "gpt_oss"
        assert [(o.token_ids, o.text) for o in remote.generate(prompts, SAMPLED)] == expected
        remote.check()
