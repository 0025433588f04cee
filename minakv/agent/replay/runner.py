"""Replaying many tasks under several policies against one server.

For each policy in turn: C tasks run at once (asyncio; a semaphore refills a slot as soon as a task ends,
so with more trajectories than C the load stays at C), each task's turns one after another (session.py).
The server's counters are scraped before and after, so each policy's decode work and KV bytes per decode
token are its own.

Policies run one after the other on the same server, so a later one could find an earlier one's KV in
the prefix cache. To start each cold, the system prompt of policy i begins with `[replay SALT.i]`: the
policies differ from their first token on and share nothing, while the tasks of one policy still share
their system prompt, as an agent deployment's do. `salt=None` leaves the prompts as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minakv.agent.replay.metrics import counter_deltas, scrape
from minakv.agent.replay.policies import NamedPolicy
from minakv.agent.replay.session import Record, Settings, Task, run_task
from minakv.agent.replay.trajectory import Trajectory


@dataclass
class PolicyRun:
    label: str
    records: list[Record]
    wall_s: float
    server: dict = field(default_factory=dict)  # counter differences from /metrics ({} without them)


def urls(url: str) -> tuple[str, str]:
    """The API base (…/v1) and the metrics page of a server given as its root or its /v1 URL."""
    root = url.rstrip("/")
    root = root.removesuffix("/v1")
    return root + "/v1", root + "/metrics"


class Progress:
    """A progress bar over a policy's requests: tqdm when installed, else a line per 10%."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled, self.done, self.shown = total, label, enabled, 0, -1
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit="req", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, record: Record) -> None:
        self.done += 1
        if self.bar is not None:
            ttft = f"{record.ttft * 1e3:.0f}ms" if record.ttft is not None else "-"
            self.bar.set_postfix(round=record.round, ttft=ttft, refresh=False)
            self.bar.update(1)
        elif self.enabled and (tenth := 10 * self.done // max(self.total, 1)) > self.shown:
            self.shown = tenth
            print(f"{self.label}: {self.done}/{self.total} requests", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def replay_policy(
    client: Any,
    metrics_url: str | None,
    trajectories: Sequence[Trajectory],
    policy: NamedPolicy,
    settings: Settings,
    concurrency: int,
    prefix: str = "",
    counter: Any = None,
    progress: bool = True,
) -> PolicyRun:
    slots = asyncio.Semaphore(concurrency)
    total = sum(len(t.turns[: settings.rounds] if settings.rounds else t.turns) for t in trajectories)
    bar = Progress(total, policy.label, progress)
    before = await asyncio.to_thread(scrape, metrics_url) if metrics_url else {}
    t0 = time.perf_counter()

    async def one(t: Trajectory) -> list[Record]:
        async with slots:
            return await run_task(client, Task(t, prefix), policy, settings, counter, bar.update, t0)

    try:
        per_task = await asyncio.gather(*(one(t) for t in trajectories))
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape, metrics_url) if metrics_url else {}
    records = [r for rs in per_task for r in rs]
    return PolicyRun(policy.label, records, wall, counter_deltas(before, after) if before and after else {})


async def replay_async(
    url: str,
    trajectories: Sequence[Trajectory],
    policies: Sequence[NamedPolicy],
    settings: Settings,
    concurrency: int = 1,
    api_key: str | None = None,
    counter: Any = None,
    salt: str | None = "0",
    progress: bool = True,
    timeout: float = 600.0,
) -> list[PolicyRun]:
    try:
        import openai
    except ImportError:
        raise RuntimeError("the replay needs the openai client: pip install openai") from None
    base, metrics_url = urls(url)
    client = openai.AsyncOpenAI(base_url=base, api_key=api_key or "none", max_retries=0, timeout=timeout)
    runs = []
    try:
        for i, policy in enumerate(policies):
            prefix = "" if salt is None else f"[replay {salt}.{i}]\n"
            run = await replay_policy(client, metrics_url, trajectories, policy, settings, concurrency,
                                      prefix, counter, progress)  # fmt: skip
            runs.append(run)
    finally:
        await client.close()
    return runs


def replay(url: str, trajectories: Sequence[Trajectory], policies: Sequence[NamedPolicy], settings: Settings,
           **kwargs: Any) -> list[PolicyRun]:  # fmt: skip
    """Replay every trajectory under every policy (see replay_async for the keyword arguments)."""
    return asyncio.run(replay_async(url, trajectories, policies, settings, **kwargs))
