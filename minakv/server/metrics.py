"""`/metrics`: Prometheus families in the names vLLM users already scrape, with a `minakv:` prefix.

Two kinds of numbers meet here:

- per request, observed once when it ends (tracking.py hands over a `Finished`): latency histograms and
  token counters, summed from the usage each response reports, so the counters equal what clients saw;
- per scrape, read from `engine.stats()` by a collector: running and waiting requests, KV pool usage,
  preemptions, and every engine statistic as a plain `minakv_<name>` gauge (nested keys joined by `_`),
  so a new engine statistic shows up without touching this file.

Each app has its own `CollectorRegistry`, so several servers in one process (the tests) never share or
collide on a metric. Families carry a `model_name` label (the served name), as vLLM's do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from minakv.engine import Engine

# the text format every Prometheus server reads (the body generate_latest writes)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
# from 1 ms: a small model decodes a token in a few milliseconds
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]  # fmt: skip

# help texts of the raw engine.stats() gauges; a statistic without one gets a generic text
STATS_HELP = {
    "requests": "requests admitted (ever)",
    "prompt_tokens": "prompt tokens received (ever)",
    "output_tokens": "tokens generated (ever)",
    "cache_hit_tokens": "prompt tokens whose KV came from the cache (ever)",
    "prefill_tokens": "prompt tokens computed (ever)",
    "evictions": "cached pages evicted (ever)",
    "preemptions": "requests preempted for memory (ever)",
    "errors": "requests failed by an internal error (ever)",
    "decode_tokens": "decode steps summed over requests (ever)",
    "decode_kv_entries": "KV entries read by decode steps (ever)",
    "pages_total": "KV pool pages",
    "pages_free": "KV pool pages free",
    "pages_used": "KV pool pages in use (by requests or the cache)",
    "pages_cached": "KV pool pages holding published cache states",
    "kv_bytes_read_per_decode_token": "mean KV bytes read per decode token",
    "running": "requests running",
    "waiting": "requests waiting",
}


@dataclass
class Finished:
    """One request as it ended: what the metrics and the request log are made of."""

    request_id: str
    finish_reason: str  # "stop", "length", "error", or "abort" (also: the client went away)
    prompt_tokens: int
    cached_tokens: int
    repos_tokens: int
    drop_skipped_tokens: int
    completion_tokens: int
    ttft: float | None  # seconds from arrival to the first token; None if no token came
    duration: float  # seconds from arrival to the end
    prompt: Any = None  # the prompt, only when prompts are logged


def flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{key}")
        if isinstance(value, dict):
            out.update(flatten(value, name + "_"))
        elif isinstance(value, (int, float)):  # bools too, as 0/1
            out[name] = float(value)
    return out


def one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class EngineCollector:
    """Reads `engine.stats()` once per scrape (it takes the engine's step lock: scrape off the event loop)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield self.gauge("minakv:num_requests_running", "Requests in the running batch.", stats["running"])
        yield self.gauge("minakv:num_requests_waiting", "Requests waiting to be admitted.", stats["waiting"])
        # pages only the cache holds count as used: they can be evicted, but the engine does not report
        # how many there are (vLLM counts such blocks as free)
        usage = stats["pages_used"] / stats["pages_total"] if stats["pages_total"] else 0.0
        yield self.gauge(
            "minakv:kv_cache_usage_perc", "KV pool pages in use (cached ones included); 1 means full.", usage
        )
        preemptions = CounterMetricFamily(
            "minakv:num_preemptions", "Requests preempted for memory.", labels=list(self.labels)
        )
        preemptions.add_metric(list(self.labels.values()), stats["preemptions"])
        yield preemptions
        # the raw snapshot, unlabelled, in the names earlier versions exported; a gauge even where the
        # statistic only grows, since a counter's sample must end in _total and these names do not
        for name, value in sorted(flatten(stats).items()):
            yield GaugeMetricFamily(f"minakv_{name}", STATS_HELP.get(name, f"engine.stats() {name}"), value)


class ServerMetrics:
    """The app's registry and its families; `observe` a finished request, `render` for a scrape."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        self.ttft = histogram(
            "minakv:time_to_first_token_seconds", "Seconds from arrival to the first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "minakv:request_time_per_output_token_seconds",
            "Per request: seconds from the first token to the last, per token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "minakv:e2e_request_latency_seconds",
            "Seconds from arrival to the end of the request.",
            E2E_BUCKETS,
        )
        token_buckets = one_two_five(engine.max_model_len)
        self.prompt_len = histogram(
            "minakv:request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.output_len = histogram(
            "minakv:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.prompt_tokens = counter("minakv:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("minakv:generation_tokens", "Tokens generated.")
        self.cached_tokens = counter(
            "minakv:prompt_tokens_cached", "Prompt tokens whose KV came from the cache."
        )
        self.repos_tokens = counter(
            "minakv:rerotated_tokens", "Keys re-rotated by repositions (usage repos_tokens)."
        )
        self.skipped_tokens = counter(
            "minakv:drop_skipped_tokens", "Prompt tokens never computed because no query reads them (drops)."
        )
        self.finished = Counter(
            "minakv:request_success", "Requests ended, by finish reason.", [*label, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self.model_name = model_name
        self.responses = Counter(
            "minakv_http_responses",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=registry,
        )
        registry.register(EngineCollector(engine, model_name))

    def observe(self, done: Finished) -> None:
        if done.ttft is not None:
            self.ttft.observe(done.ttft)
        if done.ttft is not None and done.completion_tokens > 1:  # a time *between* tokens needs two
            self.tpot.observe((done.duration - done.ttft) / (done.completion_tokens - 1))
        self.e2e.observe(done.duration)
        if done.prompt_tokens:  # 0: unknown (the engine reports it when a request finishes, not on abort)
            self.prompt_len.observe(done.prompt_tokens)
        self.output_len.observe(done.completion_tokens)
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.repos_tokens.inc(done.repos_tokens)
        self.skipped_tokens.inc(done.drop_skipped_tokens)
        self.finished.labels(self.model_name, done.finish_reason).inc()

    def count_response(self, route: str, status: int) -> None:
        self.responses.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
