"""Prometheus text exposition of `engine.stats()` plus the server's own request counts.

`engine.stats()` is a (possibly nested) dict of numbers; every number becomes one gauge named
`minakv_<path>` (nested keys joined by `_`), so a new engine statistic shows up without touching this file.
Keys that only ever grow (requests, tokens, hits, evictions, preemptions) are typed as counters.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

COUNTER_WORDS = ("requests", "tokens_in", "tokens_out", "hit", "evictions", "preemptions", "total")


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
        kind = "counter" if any(w in name for w in COUNTER_WORDS) else "gauge"
        metric = f"minakv_{name}"
        lines += [f"# HELP {metric} engine.stats()['{name}']", f"# TYPE {metric} {kind}"]
        lines.append(f"{metric} {_number(value)}")
    lines += [
        "# HELP minakv_http_responses_total HTTP responses by route and status",
        "# TYPE minakv_http_responses_total counter",
    ]
    for (route, status), count in sorted(http_counts.items()):
        lines.append(f'minakv_http_responses_total{{route="{route}",status="{status}"}} {count}')
    return "\n".join(lines) + "\n"
