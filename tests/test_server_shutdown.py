"""SIGTERM with long streams in flight: `minakv serve` refuses new requests (503), lets the running ones go on
for `--shutdown-timeout`, then ends the rest with an error event and `data: [DONE]`, and exits 0.

A real `minakv serve tiny-gpt-oss` subprocess and 8 raw streaming clients: 4 that finish by themselves
(15 tokens: usually during the drain, on a slow machine they may be cut too) and 4 that would run for
minutes (`ignore_eos`, no `max_tokens`), which the shutdown must cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

TIMEOUT = 3.0  # --shutdown-timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    async with aiohttp.ClientSession() as session:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            await asyncio.sleep(0.2)


async def read_stream(
    session: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event
) -> list[str]:
    """The stream's `data:` payloads, in order."""
    events = []
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if len(events) >= 3:
                    started.set()
    return events


def ended_well(events: list[str]) -> str:
    """'complete' (a finish reason, then [DONE]) or 'cut' (an error event, then [DONE]); anything else fails."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["code"] == "server_shutting_down" and set(last["error"]) == {
            "message", "type", "param", "code"}, last  # fmt: skip
        return "cut"
    assert any(c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]), events[-3:]
    return "complete"


def test_sigterm_drains_then_ends_streams_and_exits_0(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minakv.server.serve", "tiny-gpt-oss", "--port", str(port), "--kv-cache-tokens",
           "8192", "--max-model-len", "4096", "--shutdown-timeout", str(TIMEOUT)]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:

        async def scenario() -> tuple[list[list[str]], int, dict, float]:
            await wait_healthy(url, proc, log)
            async with aiohttp.ClientSession() as session:
                short = {"model": "tiny-gpt-oss", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 15, "logprobs": True}  # still running at SIGTERM, done within the timeout  # fmt: skip
                long = {**short, "ignore_eos": True}
                del long["max_tokens"]
                started = [asyncio.Event() for _ in range(8)]
                streams = [asyncio.create_task(read_stream(session, url, short if i < 4 else long, started[i]))
                           for i in range(8)]  # fmt: skip
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[4:])), 120)
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.5)
                async with session.post(url + "/v1/chat/completions", json={**short, "stream": False}) as r:
                    refused = (r.status, await r.json())
                results = await asyncio.gather(*streams)
                return results, *refused, sent

        results, status, refused, sent = asyncio.run(scenario())
        code = proc.wait(TIMEOUT + 60)
        exited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-3000:]
    assert exited < TIMEOUT + 30, exited
    assert status == 503 and refused["error"]["code"] == "server_shutting_down", refused
    kinds = [ended_well(events) for events in results]
    assert kinds[4:] == ["cut"] * 4, kinds  # the long ones ran past the timeout
    assert "shutting down: ending" in log.read_text() and "Traceback" not in log.read_text()
