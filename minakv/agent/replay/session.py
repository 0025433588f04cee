"""One agent task replayed through the OpenAI chat API: serial turns, streamed, the model's answer kept.

Each turn is one streamed `chat.completions` request with the history so far (as the policy shapes it:
the whole list plus cache operations, or a shortened list). When the answer is complete the client does
what an agent does: it appends the model's assistant message, then the turn's tool results, and sends the
next turn. So every request carries the model's real output, as the server generated it, and the server's
prefix cache sees the same growth it would see under a live agent.

The tool results come from the trajectory, so every policy gets the same ones, in the same number. The
assistant message keeps the model's text and reasoning; its `tool_calls` are the model's own when it made
exactly as many calls as the turn has results (their ids answered by the results), and otherwise the
trajectory's recorded calls: a random model rarely calls tools, and a real one may call a different
number of them, but the policies' tool batches must match the results the trajectory supplies.

Timing, as AKV's (and SGLang's bench_serving) client measures it: TTFT is request sent to the first
streamed token (content, reasoning or a tool call), E2E is request sent to the end of the stream, and
TPOT = (E2E - TTFT) / (completion tokens - 1). A server that sends the whole answer in one chunk (minakv
holds text back until its output parser is sure of the channel, and a random model never settles) has no
measurable TPOT on the client: it is None then, and the server's own histogram (report.py) still has it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from minakv.agent.history import Message
from minakv.agent.replay.policies import NamedPolicy
from minakv.agent.replay.trajectory import Trajectory

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "drop_skipped_tokens", "repos_tokens")


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: flat_usage(None))  # flat: USAGE_FIELDS
    start: float = 0.0
    first: float | None = None  # first token's arrival
    chunks: int = 0  # chunks that carried tokens (a server may send a whole answer in one)
    end: float = 0.0


@dataclass
class Record:
    """One request of a replay."""

    policy: str
    task: str
    round: int
    start: float  # seconds since the policy's replay began
    e2e: float
    ttft: float | None
    tpot: float | None
    usage: dict[str, int]
    active_tokens: int  # prompt tokens still in attention after the request's operations
    active_exact: bool  # counted by a TokenCounter (else estimated for dropped messages)


def flat_usage(usage: Any) -> dict[str, int]:
    """An openai `CompletionUsage` (or its dict) -> USAGE_FIELDS, missing ones 0."""
    d = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage or {})
    details = d.get("prompt_tokens_details") or {}
    merged = {**details, **{k: v for k, v in d.items() if k != "prompt_tokens_details"}}
    return {k: int(merged.get(k) or 0) for k in USAGE_FIELDS}


async def stream_chat(client: Any, request: dict) -> Reply:
    """Send one streamed chat request and gather the answer, its usage and its token times."""
    reply = Reply(start=time.perf_counter())
    text: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict] = {}
    stream = await client.chat.completions.create(**request)
    async for chunk in stream:
        if chunk.usage is not None:
            reply.usage = flat_usage(chunk.usage)
        for choice in chunk.choices:
            delta, got = choice.delta, False
            if delta.content:
                text.append(delta.content)
                got = True
            think = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
            if think:
                reasoning.append(think)
                got = True
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
                got = True
            if got:
                reply.chunks += 1
                reply.first = reply.first or time.perf_counter()
    reply.end = time.perf_counter()
    reply.content, reply.reasoning = "".join(text), "".join(reasoning)
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    return reply


class Task:
    """One trajectory's history as it grows, and what its next request looks like."""

    def __init__(self, trajectory: Trajectory, system_prefix: str = "") -> None:
        self.trajectory = trajectory
        self.history: list[Message] = [
            {"role": "system", "content": system_prefix + trajectory.system_text()},
            {"role": "user", "content": trajectory.user_text()},
        ]
        # per message, its length in tokens where the trajectory says it (token-length contents), for
        # estimating what a drop removes when no TokenCounter is at hand
        self.known: dict[int, int] = {}

    def fold(self, reply: Reply, turn: int) -> None:
        """Append the model's answer and turn `turn`'s tool results."""
        t = self.trajectory
        results = t.turns[turn].tool_results
        message: Message = {"role": "assistant", "content": reply.content}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if results:
            # the model's own calls when they match the results in number, else the recorded ones
            if len(reply.tool_calls) == len(results):
                calls = [(c["id"], c["name"], c["arguments"]) for c in reply.tool_calls]
            else:
                calls = [(None, r.name, r.arguments) for r in results]
            message["tool_calls"] = [
                {
                    "id": id_ or f"call_{turn}_{k}",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for k, (id_, name, args) in enumerate(calls)
            ]
        self.history.append(message)
        for k, (result, call) in enumerate(zip(results, message.get("tool_calls", []), strict=True)):
            if isinstance(result.content, int):
                self.known[len(self.history)] = result.content
            self.history.append(
                {"role": "tool", "tool_call_id": call["id"], "content": t.result_text(turn, k)}
            )

    def estimate(self, i: int) -> int:
        """Message i's tokens: the trajectory's length for it, else about 4 characters per token."""
        if i in self.known:
            return self.known[i]
        m = self.history[i]
        text = (m.get("content") or "") + (m.get("reasoning_content") or "")
        return len(text) // 4 + sum(len(c["function"]["arguments"]) // 4 for c in m.get("tool_calls", []))


@dataclass
class Settings:
    """What every request of a replay shares."""

    model: str
    max_tokens: int = 64  # for turns whose length the trajectory does not record
    temperature: float = 0.0
    ignore_eos: bool = True  # decode exactly the recorded (or default) length, as AKV's replay does
    rounds: int | None = None  # replay only the first R turns of each trajectory


async def run_task(
    client: Any,
    task: Task,
    policy: NamedPolicy,
    settings: Settings,
    counter: Any = None,
    on_record: Any = None,
    t0: float = 0.0,
) -> list[Record]:
    """Replay one task's turns in order; `on_record(record)` after each (a progress bar)."""
    t = task.trajectory
    records = []
    for r, turn in enumerate(t.turns[: settings.rounds] if settings.rounds else t.turns):
        history = list(task.history)
        dropped = policy.dropped(history)
        counts = None
        if policy.needs_counts or (counter is not None and dropped):
            if counter is None:
                raise ValueError(f"policy {policy.label!r} needs token counts: pass a TokenCounter")
            # rendering is CPU work: off the event loop, so other tasks' token times stay honest
            counts = await asyncio.to_thread(counter.count, history, tools=t.tools)
        extra = policy.extra_body(history, counts)
        if settings.ignore_eos:
            extra = {**extra, "ignore_eos": True}
        request = {
            "model": settings.model, "messages": policy.messages(history), "tools": t.tools,
            "max_tokens": turn.output_tokens or settings.max_tokens, "temperature": settings.temperature,
            "user": f"{policy.label}/{t.id}", "stream": True, "stream_options": {"include_usage": True},
            "extra_body": extra,
        }  # fmt: skip
        reply = await stream_chat(client, request)
        usage = reply.usage
        if counts is not None:
            gone = sum(counts[i] for i in dropped)
        else:
            gone = sum(task.estimate(i) for i in dropped)
        n, first = usage.get("completion_tokens", 0), reply.first
        streamed = first is not None and n > 1 and reply.chunks > 1
        record = Record(
            policy=policy.label, task=t.id, round=r, start=reply.start - t0, e2e=reply.end - reply.start,
            ttft=None if first is None else first - reply.start,
            tpot=(reply.end - first) / (n - 1) if streamed else None,
            usage=usage, active_tokens=max(0, usage.get("prompt_tokens", 0) - gone),
            active_exact=counts is not None or not dropped,
        )  # fmt: skip
        records.append(record)
        if on_record is not None:
            on_record(record)
        task.fold(reply, r)
    return records
