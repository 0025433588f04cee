"""The numbers a replay reports, from the two places they come from: usage fields and server counters.

Usage fields (per request, in the response) say what the server did with each prompt token:

    prompt_tokens = cached + computed + drop_skipped       (logical prefill = prompt_tokens)
    computed      = the tokens actually prefilled           (actual prefill)
    repos_tokens  = cached keys copied and re-rotated by a reposition (part of cached)

Server counters (minakv's `/metrics`: every `engine.stats()` number as a `minakv_<name>` gauge) give what
usage cannot: decode steps actually run and the KV bytes they read. They are cumulative, so a replay
scrapes them before and after each policy and reports the differences; the mean KV bytes per decode token
over the interval comes from the two running means weighted by their decode-token counts. The server's
latency histograms (TTFT, TPOT, E2E as the server times them) give interval means the same way, from their
`_sum` and `_count`.

bench/agent_replay.py (the engine-level replay) uses the same summaries on `engine.stats()` and usage.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterable, Sequence

QUANTILES = (50, 90, 99)
PREFIX = "minakv_"
KV_PER_TOKEN = "kv_bytes_read_per_decode_token"
COUNTERS = ("prefill_tokens", "decode_tokens", "cache_hit_tokens", "prompt_tokens", "output_tokens",
            "preemptions", "evictions")  # fmt: skip
# the server's own per-request timings (Prometheus histograms; their _sum and _count give interval means)
HISTOGRAMS = {"server_ttft_ms": "minakv:time_to_first_token_seconds",
              "server_tpot_ms": "minakv:request_time_per_output_token_seconds",
              "server_e2e_ms": "minakv:e2e_request_latency_seconds"}  # fmt: skip


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(values: Iterable[float | None], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 of the values that are not None (all None when there are none), times scale."""
    v = sorted(x * scale for x in values if x is not None)
    if not v:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    return {"mean": sum(v) / len(v), **{f"p{q}": percentile(v, q) for q in QUANTILES}}


def usage_sums(usages: Iterable[dict]) -> dict[str, int]:
    """Summed flat usage (prompt, cached, drop_skipped, repos tokens) and the computed prompt tokens."""
    keys = ("prompt_tokens", "cached_tokens", "drop_skipped_tokens", "repos_tokens")
    sums = dict.fromkeys(keys, 0)
    for u in usages:
        for k in keys:
            sums[k] += u.get(k, 0)
    sums["computed_tokens"] = sums["prompt_tokens"] - sums["cached_tokens"] - sums["drop_skipped_tokens"]
    return sums


def kv_bytes_per_decode_token(before: dict, after: dict) -> float | None:
    """Mean KV bytes read per decode token between two snapshots of the running mean (None without
    decode steps in between or without the counters)."""
    if KV_PER_TOKEN not in after or "decode_tokens" not in after:
        return None
    steps = after["decode_tokens"] - before.get("decode_tokens", 0)
    if steps <= 0:
        return None
    read = after[KV_PER_TOKEN] * after["decode_tokens"] - before.get(KV_PER_TOKEN, 0) * before.get(
        "decode_tokens", 0
    )
    return read / steps


def counter_deltas(before: dict, after: dict) -> dict:
    """Differences of the cumulative counters present in both snapshots, plus the interval's KV bytes per
    decode token."""
    out: dict = {n: after[n] - before[n] for n in COUNTERS if n in after and n in before}
    if (kv := kv_bytes_per_decode_token(before, after)) is not None:
        out[KV_PER_TOKEN] = kv
    for key, family in HISTOGRAMS.items():
        count = after.get(family + "_count", 0) - before.get(family + "_count", 0)
        if count > 0:
            out[key] = 1e3 * (after[family + "_sum"] - before.get(family + "_sum", 0)) / count
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """From a Prometheus text page: the unlabelled `minakv_<name>` gauges as {name: value}, and the
    `_sum` / `_count` samples of the HISTOGRAMS families under their full names, summed over labels."""
    wanted = {f + suffix for f in HISTOGRAMS.values() for suffix in ("_sum", "_count")}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, labels, rest = line.partition("{")
        if labels:
            value = rest.partition("}")[2]
        else:
            name, _, value = line.partition(" ")
        try:
            number = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if name in wanted:
            out[name] = out.get(name, 0.0) + number
        elif name.startswith(PREFIX) and not labels:
            out[name[len(PREFIX) :]] = number
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The server's counters from `url` (its /metrics), or {} when it has none we know (another server,
    a proxy, an error): the replay then reports the usage-based numbers alone."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse_prometheus(resp.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return {}
