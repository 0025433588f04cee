"""A soak of `minakv serve`: mixed good, bad, cancelled and cache-operation traffic for a fixed time, watching
for 5xx answers, memory growth and page-accounting drift (issue: hardening).

    PYTHONUNBUFFERED=1 python bench/soak.py [--minutes 30] [--model tiny-gpt-oss] [--concurrency 8]

The server runs as a subprocess (`python -m minakv serve MODEL`), so its resident memory (VmRSS from
/proc) is the server's alone. Each of `--concurrency` client loops picks, per request, one of:

  chat       a short chat completion, streamed or not
  cache      a chat completion with drop + reposition operations over a multi-message history
  cancel     a streamed request whose client disconnects after the first chunk
  bad        a malformed or invalid request (bad JSON, a bad parameter, a bad cache operation, an unknown
             model, an over-long max_tokens): it must get a 4xx in the OpenAI error shape

Every minute: the counts of answers by status, the server's RSS, and from /metrics the pool's pages (free,
used, cached, total) read when the server is idle between two bursts. At the end the figures must hold:
no 5xx, free + used == total with used == cached at idle (only the cache holds pages), and RSS in the last
third of the run within 15% of the first third. A row per minute goes to $OUT/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Log

WORDS = [
    "the",
    "cache",
    "keeps",
    "every",
    "state",
    "exact",
    "shareable",
    "and",
    "restorable",
    "after",
    "eviction",
    "in",
    "one",
    "prefill",
]
BAD_BODIES = [
    b"{not json",
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -3}).encode(),
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}).encode(),
    json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
    json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache": {"drop": {"0": [5]}}}
    ).encode(),
    json.dumps({"model": "m", "messages": "not a list"}).encode(),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, counts: Counter) -> None:
    kind = rng.choices(["chat", "cache", "cancel", "bad"], weights=[4, 3, 2, 2])[0]
    if kind == "bad":
        body = rng.choice(BAD_BODIES)
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            ok = 400 <= r.status < 500 and (await r.json(content_type=None)).get("error") is not None
            counts[f"bad {r.status}" if ok else f"bad WRONG {r.status}"] += 1
            return
    messages = [{"role": "system", "content": text(rng, 20)}, {"role": "user", "content": text(rng, 12)}]
    body: dict = {"model": "m", "messages": messages, "max_tokens": rng.randint(2, 24), "temperature": 1.0}
    if kind == "cache":
        messages += [{"role": "assistant", "content": text(rng, 8)}, {"role": "user", "content": text(rng, 30)},
                     {"role": "assistant", "content": text(rng, 6)}, {"role": "user", "content": text(rng, 9)}]  # fmt: skip
        body["cache"] = {"drop": {"3": [1]}, "reposition": [3]}
    stream = kind == "cancel" or rng.random() < 0.5
    body["stream"] = stream
    async with session.post(url, json=body) as r:
        if kind == "cancel":
            await r.content.readany()
            r.close()  # the client goes away mid-stream
            counts[f"cancel {r.status}"] += 1
            return
        await r.read()
        counts[f"{kind} {r.status}"] += 1


async def client(url: str, seed: int, until: float, counts: Counter) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < until:
            try:
                await one(session, url, rng, counts)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                counts[f"client error {type(exc).__name__}"] += 1


async def pages(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        body = await r.text()
    out = {}
    for line in body.splitlines():
        for name in ("pages_total", "pages_free", "pages_used", "pages_cached", "running", "waiting"):
            if line.startswith(f"minakv_{name} "):
                out[name] = float(line.split()[1])
    return out


async def soak(args: argparse.Namespace, base: str, pid: int, log: Log) -> list[dict]:
    url, rows, start = base + "/v1/chat/completions", [], time.monotonic()
    total: Counter = Counter()
    for minute in range(args.minutes):
        counts: Counter = Counter()
        until = time.monotonic() + args.burst
        await asyncio.gather(
            *(client(url, 1000 * minute + i, until, counts) for i in range(args.concurrency))
        )
        await asyncio.sleep(2)  # idle: every request has ended
        pool = await pages(base)
        total.update(counts)
        row = {"minute": minute + 1, "elapsed_s": round(time.monotonic() - start, 1), "rss_mb": round(rss_mb(pid), 1),
               "answers": dict(counts), "pool": pool}  # fmt: skip
        rows.append(row)
        log.add("soak", **row)
    return rows


def verdict(rows: list[dict]) -> dict:
    fives = sum(
        n for row in rows for k, n in row["answers"].items() if k.split()[-1].startswith("5") or "WRONG" in k
    )
    drift = [r for r in rows if r["pool"].get("pages_free", 0) + r["pool"].get("pages_used", 0) != r["pool"].get("pages_total")
             or r["pool"].get("pages_used") != r["pool"].get("pages_cached")]  # fmt: skip
    third = max(1, len(rows) // 3)
    first = sum(r["rss_mb"] for r in rows[:third]) / third
    last = sum(r["rss_mb"] for r in rows[-third:]) / third
    return {"requests": sum(sum(r["answers"].values()) for r in rows), "bad_answers_5xx_or_wrong": fives,
            "accounting_drift_minutes": [r["minute"] for r in drift], "rss_first_third_mb": round(first, 1),
            "rss_last_third_mb": round(last, 1), "rss_growth": round(last / first - 1, 3),
            "ok": fives == 0 and not drift and last <= 1.15 * first}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=int, default=30)
    p.add_argument("--model", default="tiny-gpt-oss")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst", type=float, default=55.0, help="seconds of traffic per minute")
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "minakv", "serve", args.model, "--port", str(port), "--served-model-name", "m",
           "--kv-cache-tokens", "8192", "--max-model-len", "1024"]  # fmt: skip
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    log = Log()
    # the server's log goes to a file: a pipe nobody reads would fill with request logs and stall it
    with open(os.path.join(out_dir, "soak_server.log"), "w") as server_log:
        server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):  # the server builds the preset and starts
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    if server.poll() is not None:
                        raise SystemExit(f"the server exited; see {server_log.name}") from None
                    time.sleep(0.5)
            rows = asyncio.run(soak(args, base, server.pid, log))
        finally:
            server.terminate()
            server.wait(timeout=60)
    result = verdict(rows)
    log.add("soak_verdict", model=args.model, minutes=args.minutes, concurrency=args.concurrency, **result)
    log.save("soak.json")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
