"""`n` > 1: several choices for one prompt, computed once.

Choice 0 is submitted first; the others are submitted when its first token arrives. By then its prompt's
full pages are in the cache (the scheduler publishes them at a request's first token), so choices 1..n-1
read them and compute only the last, partial page:

    choice 0   [prefill .......... ][t t t t t ...]
    choice 1                        [p][t t t t ...]      p: the prompt's last page, the rest from the cache
    choice 2                        [p][t t t t ...]

Each choice is an engine request of its own (id `<rid>-<i>`), with seed + i when the request has a seed
(so the choices differ and each is reproducible), and streams, finishes and fails on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator

from minakv.engine import Engine
from minakv.outputs import RequestOutput, Usage
from minakv.params import SamplingParams
from minakv.server.running import finish, start
from minakv.server.tracking import Trace

Stream = AsyncIterator[RequestOutput]


async def start_choices(
    engine: Engine, prompt, params: SamplingParams, rid: str, n: int, ops, prompt_param: str, trace: Trace
) -> list[tuple[Stream, RequestOutput]]:
    """Submit the n choices (see the module docstring); each with its stream and its first increment."""
    first = await start(engine, prompt, params, rid, ops, prompt_param, trace)
    if n == 1:
        return [first]
    rest = []
    try:
        for i in range(1, n):
            p = copy.copy(params)
            p.seed = None if params.seed is None else (params.seed + i) % 2**63
            rest.append(start(engine, prompt, p, f"{rid}-{i}", ops, prompt_param))
        started = await asyncio.gather(*rest, return_exceptions=True)
    except BaseException:
        await finish(engine, first[0], rid, False)
        raise
    failed = next((s for s in started if isinstance(s, BaseException)), None)
    if failed is not None:  # end the ones that did start, then report the failure
        await finish(engine, first[0], rid, False)
        for i, s in enumerate(started, 1):
            if not isinstance(s, BaseException):
                await finish(engine, s[0], f"{rid}-{i}", False)
        raise failed
    return [first, *started]


async def finish_choices(
    engine: Engine, choices: list[tuple[Stream, RequestOutput]], rid: str, done: bool
) -> None:
    for i, (stream, _) in enumerate(choices):
        with contextlib.suppress(Exception):
            await finish(engine, stream, rid if i == 0 else f"{rid}-{i}", done)


async def merged(choices: list[tuple[Stream, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every choice's increments as they come, tagged with the choice index (first increments first)."""
    for i, (_, first) in enumerate(choices):
        yield i, first
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Stream, first: RequestOutput) -> None:
        out = first
        try:
            while not out.finished:
                out = await stream.__anext__()
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(choices) if not f.finished]
    pending = len(tasks)
    try:
        while pending:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                pending -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def total_usage(lasts: list[RequestOutput]) -> RequestOutput:
    """An output carrying the usage of all choices: the prompt counted once (as OpenAI bills n choices),
    completions summed, and the cache figures of the whole request (what the later choices read from the
    cache shows in cached_tokens)."""
    u = lasts[0].usage
    return RequestOutput(
        lasts[0].request_id,
        [],
        usage=Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=sum(o.usage.completion_tokens for o in lasts),
            cached_tokens=sum(o.usage.cached_tokens for o in lasts),
            repos_tokens=sum(o.usage.repos_tokens for o in lasts),
            drop_skipped_tokens=u.drop_skipped_tokens,
        ),
    )
