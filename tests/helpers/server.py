"""The in-process server harness and what the server tests compare with.

`ServerThread` serves an aiohttp app from a background event loop on 127.0.0.1, so a test can talk to it
with real clients and still call the same engine directly (`greedy`, the reference for greedy outputs;
`wait_idle`, the pool check once every request is done).
"""

from __future__ import annotations

import asyncio
import threading
import time
from itertools import pairwise

from aiohttp import web

from minakv.engine import Engine
from minakv.params import SamplingParams


class ServerThread:
    """An aiohttp app on 127.0.0.1:<free port>, served from a background event loop."""

    def __init__(self, app: web.Application, runner: type[web.AppRunner] = web.AppRunner) -> None:
        """`runner`: the class serving `app` (`minakv.server.errors.Runner` is the one `minakv serve` uses)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = runner(app, handler_cancellation=True)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def greedy(engine: Engine, prompt, max_tokens: int) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].token_ids


def token_bytes(engine: Engine, ids: list[int]) -> bytes:
    from minakv.server.output import token_bytes as one

    return b"".join(one(engine.tokenizer, t) for t in ids)


def chat_bytes(resp) -> bytes:
    """The generated tokens' bytes from a response's logprobs (independent of output parsing)."""
    return b"".join(bytes(t.bytes) for t in resp.choices[0].logprobs.content)


def wait_idle(engine: Engine, timeout: float = 30) -> dict:
    """Wait until no request runs or waits, then check the pool's accounting."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still active: {stats}"
        time.sleep(0.05)
    engine.check()
    assert stats["pages_free"] + stats["pages_used"] == stats["pages_total"]
    return stats


def hand_thinking_drop(
    tokenizer, msgs: list[dict], index: int, reasoning: str, tools=None
) -> tuple[dict, int]:
    """thinking_drop built by hand (the reference): the smallest run of message `index`'s tokens whose text
    holds `reasoning` becomes its own segment, every message and the generation prompt one segment each,
    and the reasoning segment is dropped at the end of its message. Returns (prompt, prompt length)."""
    from minakv.text.chat import render

    rendered = render(msgs, tokenizer, tools=tools)
    ids, owners = rendered.token_ids, rendered.owners
    mine = [t for t in range(len(ids)) if owners[t] == index]
    lo = max(t for t in mine if reasoning in tokenizer.decode(ids[t : mine[-1] + 1]))
    hi = min(t for t in range(lo, mine[-1] + 1) if reasoning in tokenizer.decode(ids[lo : t + 1]))
    cuts = sorted({owners.index(o) for o in set(owners)} | {lo, hi + 1, len(ids)})
    segments = [ids[a:b] for a, b in pairwise(cuts)]
    seg_of = {t: k for k, (a, b) in enumerate(pairwise(cuts)) for t in range(a, b)}
    return {"message_tokens": segments, "cache": {"drop": {seg_of[mine[-1]]: [seg_of[lo]]}}}, len(ids)
