"""Prometheus text exposition of `engine.stats()` plus the server's own request counts.

`engine.stats()` is a (possibly nested) dict of numbers; every number becomes one gauge named
`minakv_<path>` (nested keys joined by `_`), so a new engine statistic shows up without touching this file.
The statistics that only ever grow are typed as counters; the rest are gauges.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

HELP = {
    "requests": "requests admitted",
    "prompt_tokens": "prompt tokens received (tokens in)",
    "output_tokens": "tokens generated (tokens out)",
    "cache_hit_tokens": "prompt tokens whose KV came from the cache",
    "evictions": "cached pages evicted",
    "preemptions": "requests preempted for memory",
    "errors": "requests failed by an internal error",
    "decode_tokens": "decode steps summed over requests",
    "decode_kv_entries": "KV entries read by decode steps",
    "pages_total": "KV pool pages",
    "pages_free": "KV pool pages free",
    "pages_used": "KV pool pages in use (by requests or the cache)",
    "pages_cached": "KV pool pages holding published cache states",
    "kv_bytes_read_per_decode_token": "mean KV bytes read per decode token",
    "running": "requests running",
    "waiting": "requests waiting",
}
COUNTERS = {"requests", "prompt_tokens", "output_tokens", "cache_hit_tokens", "evictions", "preemptions",
            "errors", "decode_tokens", "decode_kv_entries"}  # fmt: skip


def flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{key}")
        if isinstance(value, dict):
            out.update(flatten(value, name + "_"))
        elif isinstance(value, (int, float)):  # bools too, as 0/1
            out[name] = float(value)
    return out


def _number(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def prometheus_text(stats: dict[str, Any], http_counts: Counter) -> str:
    lines: list[str] = []
    for name, value in sorted(flatten(stats).items()):
        metric = f"minakv_{name}"
        help_text = HELP.get(name, f"engine.stats() {name}")
        lines += [
            f"# HELP {metric} {help_text}",
            f"# TYPE {metric} {'counter' if name in COUNTERS else 'gauge'}",
        ]
        lines.append(f"{metric} {_number(value)}")
    lines += [
        "# HELP minakv_http_responses_total HTTP responses by route and status",
        "# TYPE minakv_http_responses_total counter",
    ]
    for (route, status), count in sorted(http_counts.items()):
        lines.append(f'minakv_http_responses_total{{route="{route}",status="{status}"}} {count}')
    return "\n".join(lines) + "\n"
