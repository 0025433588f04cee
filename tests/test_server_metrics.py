"""`/metrics` and the request log against a real server: requests go in over a socket (streamed and not,
chat and completions, with cache operations), then `/metrics` is parsed with prometheus_client's own text
parser and checked against what the responses said: every histogram counts every request, and every token
counter is the sum of the usage fields the clients got back. The log test checks the one line per request
and that the prompt stays out of it unless asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from itertools import pairwise

import aiohttp
import openai
import pytest
from helpers.server import ServerThread, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from minakv.engine import Engine
from minakv.server.app import make_app
from minakv.server.serve import parser as serve_parser

MODEL = "tiny-gpt-oss"
NAME = "metrics-test"
LABEL = {"model_name": NAME}
MESSAGES = [
    {"role": "system", "content": "you help with the weather and nothing else at all today"},
    {"role": "user", "content": "what is the weather in the city of paris this afternoon please"},
    {"role": "assistant", "content": "it is sunny and warm in paris this afternoon with a light breeze"},
    {"role": "user", "content": "and tomorrow morning in the same city"},
]
HISTOGRAMS = (
    "minakv:time_to_first_token_seconds",
    "minakv:request_time_per_output_token_seconds",
    "minakv:e2e_request_latency_seconds",
    "minakv:request_prompt_tokens",
    "minakv:request_generation_tokens",
)
# counter -> the usage field it sums
COUNTERS = {
    "minakv:prompt_tokens_total": "prompt_tokens",
    "minakv:generation_tokens_total": "completion_tokens",
    "minakv:prompt_tokens_cached_total": "cached_tokens",
    "minakv:rerotated_tokens_total": "repos_tokens",
    "minakv:drop_skipped_tokens_total": "drop_skipped_tokens",
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(MODEL, kv_cache_tokens=4096, max_model_len=512, max_queued_requests=64)


@pytest.fixture(scope="module")
def server(engine: Engine):
    srv = ServerThread(make_app(engine, NAME))
    srv.url = f"http://127.0.0.1:{srv.port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def scrape(url: str) -> tuple[dict, dict[tuple, float]]:
    """The families by name, and every sample's value by (sample name, labels)."""
    with urllib.request.urlopen(url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    return families, samples


def value(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({**LABEL, **labels}.items()))), 0.0)


def usage_of(response) -> dict[str, int]:
    u = response.usage
    details = u.prompt_tokens_details.model_dump()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        **{k: details[k] for k in ("cached_tokens", "repos_tokens", "drop_skipped_tokens")},
    }


def send_mix(client: openai.OpenAI) -> list[dict[str, int]]:
    """Six requests, each generating 3 tokens (so each has a time per output token): chat and completions,
    streamed and not, and two with cache operations. Returns the usage each client got back."""

    def chat(stream: bool = False, **extra):
        return client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=3, temperature=0, stream=stream,
            extra_body={"ignore_eos": True, **extra},
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )  # fmt: skip

    def complete(stream: bool = False):
        return client.completions.create(
            model=NAME, prompt="the weather in paris", max_tokens=3, stream=stream,
            extra_body={"ignore_eos": True},
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )  # fmt: skip

    usages = [usage_of(chat())]
    usages.append(usage_of(list(chat(stream=True))[-1]))  # the same conversation: its prefix is cached
    usages.append(usage_of(complete()))
    usages.append(usage_of(list(complete(stream=True))[-1]))
    # message 1 leaves after message 2 and the survivors are renumbered there: keys are re-rotated
    usages.append(usage_of(chat(cache={"drop": {"2": [1]}, "reposition": [2]})))
    # message 1 dropped right after it ends: no query reads it, so it is never computed
    usages.append(usage_of(list(chat(stream=True, cache={"drop": {"1": [1]}}))[-1]))
    return usages


def test_metrics_count_every_request_and_sum_usage(engine: Engine, server, client: openai.OpenAI) -> None:
    wait_idle(engine)
    _, before = scrape(server.url)
    usages = send_mix(client)
    # refused requests never ran, so they are counted nowhere: an invalid cache operation, and a token id
    # outside the vocabulary (which only the engine checks, on the stream's first step)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=3, extra_body={"cache": {"drop": {"1": [3]}}}
        )
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=NAME, prompt=[1, 10**9], max_tokens=3)
    wait_idle(engine)
    families, after = scrape(server.url)
    n = len(usages)

    for name in HISTOGRAMS:
        assert name in families, sorted(families)
        assert families[name].type == "histogram", name
        count = value(after, name + "_count") - value(before, name + "_count")
        assert count == n, name
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (sample, labels), v in after.items()
            if sample == name + "_bucket" and dict(labels)["model_name"] == NAME
        )
        assert buckets[-1] == (float("inf"), value(after, name + "_count")), name
        assert all(a[1] <= b[1] for a, b in pairwise(buckets)), f"{name}: buckets not cumulative"
    assert value(after, "minakv:e2e_request_latency_seconds_sum") > value(
        before, "minakv:e2e_request_latency_seconds_sum"
    )

    for name, field in COUNTERS.items():
        assert families[name.removesuffix("_total")].type == "counter", name
        assert value(after, name) - value(before, name) == sum(u[field] for u in usages), name
    # the mix really exercised the cache: hits, re-rotated keys and skipped tokens
    assert all(
        sum(u[f] for u in usages) > 0 for f in ("cached_tokens", "repos_tokens", "drop_skipped_tokens")
    )
    ended = value(after, "minakv:request_success_total", finished_reason="length")
    assert ended - value(before, "minakv:request_success_total", finished_reason="length") == n

    # gauges read from engine.stats() at the scrape: nothing runs now
    for name in ("minakv:num_requests_running", "minakv:num_requests_waiting", "minakv:kv_cache_usage_perc"):
        assert families[name].type == "gauge", name
        assert (name, tuple(LABEL.items())) in after, name
    assert value(after, "minakv:num_requests_running") == value(after, "minakv:num_requests_waiting") == 0
    assert 0 <= value(after, "minakv:kv_cache_usage_perc") <= 1
    assert families["minakv:num_preemptions"].type == "counter"
    # the raw engine.stats() snapshot and the HTTP responses stay as they were
    stats = engine.stats()
    assert after[("minakv_pages_total", ())] == stats["pages_total"]
    assert after[("minakv_requests", ())] == stats["requests"]
    ok = ("minakv_http_responses_total", (("route", "/v1/chat/completions"), ("status", "200")))
    assert after[ok] - before.get(ok, 0) == 4


def test_client_gone_counts_as_abort(engine: Engine, server) -> None:
    wait_idle(engine)
    _, before = scrape(server.url)
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    async def cut() -> None:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.url + "/v1/chat/completions", json=body)
            assert resp.status == 200
            await resp.content.readline()
            resp.close()

    asyncio.run(cut())
    deadline = time.monotonic() + 30
    while True:  # the server notices at its next write
        _, after = scrape(server.url)
        aborted = value(after, "minakv:request_success_total", finished_reason="abort")
        if aborted - value(before, "minakv:request_success_total", finished_reason="abort") == 1:
            break
        assert time.monotonic() < deadline, "the cut stream was never counted"
        time.sleep(0.05)
    e2e = "minakv:e2e_request_latency_seconds_count"
    assert value(after, e2e) - value(before, e2e) == 1
    generated = value(after, "minakv:generation_tokens_total") - value(
        before, "minakv:generation_tokens_total"
    )
    assert 1 <= generated < 400
    wait_idle(engine)


def log_lines(caplog, request_id: str, timeout: float = 10) -> list[str]:
    """The request log's lines about `request_id` (a streamed response may end before its line is out)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "minakv.server.requests"]
        mine = [line for line in lines if request_id in line]
        if mine or time.monotonic() > deadline:
            return mine
        time.sleep(0.02)


def test_request_log_line_without_prompt(server, client: openai.OpenAI, caplog) -> None:
    caplog.set_level(logging.INFO, logger="minakv.server.requests")
    secret = "zebra unicorn quartz"
    resp = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": secret}], max_tokens=3, temperature=0
    )
    [line] = log_lines(caplog, resp.id)
    u = usage_of(resp)
    assert line.startswith(f"finished {resp.id} reason={resp.choices[0].finish_reason} ")
    for field in (
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "repos_tokens",
        "drop_skipped_tokens",
    ):
        assert f" {field}={u[field]} " in line, field
    assert " ttft=" in line and " duration=" in line
    assert all(word not in r.getMessage() for r in caplog.records for word in secret.split())

    stream = client.completions.create(
        model=NAME, prompt=secret, max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)  # read to the end: the request has finished
    rid = chunks[0].id
    [line] = log_lines(caplog, rid)
    assert f"finished {rid} reason=length " in line and " completion_tokens=3 " in line
    assert all(word not in r.getMessage() for r in caplog.records for word in secret.split())


def test_log_prompts_flag_and_own_registry(engine: Engine, server, caplog) -> None:
    """A second server on the same engine: its prompts are logged, and its metrics are its own."""
    assert serve_parser().parse_args(["m", "--log-prompts"]).log_prompts is True
    assert serve_parser().parse_args(["m"]).log_prompts is False
    caplog.set_level(logging.INFO, logger="minakv.server.requests")
    _, first_before = scrape(server.url)
    other = ServerThread(make_app(engine, "other", log_prompts=True))
    try:
        url = f"http://127.0.0.1:{other.port}"
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        resp = c.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "zebra crossing"}], max_tokens=2
        )
        [line] = log_lines(caplog, resp.id)
        assert "zebra crossing" in line and " prompt=" in line
        _, mine = scrape(url)
        assert mine[("minakv:e2e_request_latency_seconds_count", (("model_name", "other"),))] == 1
    finally:
        other.stop()
    _, first_after = scrape(server.url)
    e2e = "minakv:e2e_request_latency_seconds_count"
    assert value(first_after, e2e) == value(first_before, e2e)
