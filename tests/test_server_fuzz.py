"""Schema-driven fuzzing (schemathesis) of the OpenAI-compatible routes, from the server's own `/openapi.json`.

Well-formed requests (positive: what the description allows) and malformed ones (negative: what it does
not) go to a server for each family's tiny preset. Every answer must be one the description documents: no
5xx, a listed status, its content type, and a body matching its schema, errors included. Afterwards the
engine's page accounting must be exact.

CI sends a bounded number of examples per route and mode, derandomized (the same examples every run), with
generation capped at a few tokens (the tiny models run on the CPU); the `slow` run sends ten times as
many random ones, uncapped.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest
import schemathesis
from helpers.server import ServerThread, wait_idle
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from minakv.engine import Engine
from minakv.server.app import make_app
from minakv.server.errors import Runner
from minakv.server.limits import Limits

FAMILIES = ("tiny-gpt-oss", "tiny-minimax-m2")
MAX_LEN = 48
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path, modes): routes without parameters or a body have no malformed form
ROUTES = [
    ("POST", "/v1/chat/completions", (POSITIVE, NEGATIVE)),
    ("POST", "/v1/completions", (POSITIVE, NEGATIVE)),
    ("GET", "/v1/models", (POSITIVE,)),
    ("GET", "/v1/models/{model}", (POSITIVE,)),
    ("GET", "/health", (POSITIVE,)),
    ("GET", "/metrics", (POSITIVE,)),
    ("GET", "/openapi.json", (POSITIVE,)),
]
CASES = [(method, path, mode) for method, path, modes in ROUTES for mode in modes]
IDS = [f"{method} {path} {mode.value}" for method, path, mode in CASES]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request):
    engine = Engine(request.param, kv_cache_tokens=4096, max_model_len=MAX_LEN, max_queued_requests=64)
    server = ServerThread(
        make_app(engine, "fuzz", limits=Limits(max_messages=16, max_tools=4)), runner=Runner
    )
    url = f"http://127.0.0.1:{server.port}"
    with urllib.request.urlopen(url + "/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    yield engine, url, doc
    server.stop()


def capped(case: schemathesis.Case) -> schemathesis.Case:
    """At most 3 generated tokens (the fuzzing is about requests, not about long generations)."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(field)
            case.body[field] = min(value, 3) if isinstance(value, int) and not isinstance(value, bool) else 3
    return case


def fuzz(
    served, method: str, path: str, mode: GenerationMode, examples: int, cap: bool, seed: bool
) -> Counter:
    """Send `examples` generated requests to one route; every answer must pass CHECKS. Returns the statuses."""
    engine, url, doc = served
    strategy = schemathesis.openapi.from_dict(doc)[path][method].as_strategy(mode)
    if cap and mode == POSITIVE:
        strategy = strategy.map(capped)
    statuses: Counter = Counter()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=120)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    one()
    wait_idle(engine, timeout=120)
    return statuses


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=IDS)
def test_fuzz(served, method, path, mode) -> None:
    examples = 40 if method == "POST" else 10
    statuses = fuzz(served, method, path, mode, examples, cap=True, seed=True)
    assert all(s < 500 for s in statuses), statuses
    if method == "POST" and mode == POSITIVE:
        assert statuses[200] > 0, statuses  # the description leads to requests that run


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=IDS)
def test_fuzz_long(served, method, path, mode) -> None:
    examples = 400 if method == "POST" else 50
    statuses = fuzz(served, method, path, mode, examples, cap=False, seed=False)
    assert all(s < 500 for s in statuses), statuses


def test_every_route_is_fuzzed(served) -> None:
    _, _, doc = served
    described = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert described == {(method, path) for method, path, _ in ROUTES}
