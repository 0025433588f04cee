"""Every bad input gets its HTTP status and an OpenAI-style error naming the field, and the server answers a
good request right after each one. Also `minakv serve` itself, started as a subprocess from its CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.server import ServerThread  # the same in-process server harness

from minakv.engine import Engine
from minakv.server.app import make_app

MODEL = "tiny-minimax-m2"
NAME = "mm-errors"
KEY = "k3y"
MAX_LEN = 128
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hello"}]
THREE = [*USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "what"}]


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


class Http:
    """A minimal blocking HTTP client (urllib) that returns error replies instead of raising."""

    def __init__(self, base_url: str, engine: Engine | None = None) -> None:
        self.base_url, self.engine = base_url, engine

    def request(
        self, method: str, path: str, content: bytes | None = None, headers: dict | None = None
    ) -> Reply:
        req = urllib.request.Request(self.base_url + path, data=content, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return Reply(r.status, r.read().decode())
        except urllib.error.HTTPError as e:
            return Reply(e.code, e.read().decode())

    def get(self, path: str, headers: dict | None = None) -> Reply:
        return self.request("GET", path, None, headers)

    def post(
        self, path: str, json: dict | None = None, content: bytes | None = None, headers: dict | None = None
    ) -> Reply:
        if json is not None:
            content = _dumps(json)
        return self.request("POST", path, content, {"Content-Type": "application/json", **(headers or {})})


def _dumps(body: dict) -> bytes:
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def http():
    engine = Engine(MODEL, kv_cache_tokens=2048, max_model_len=MAX_LEN)
    server = ServerThread(make_app(engine, NAME, api_key=KEY, max_body_bytes=16 << 10))
    yield Http(f"http://127.0.0.1:{server.port}", engine)
    server.stop()


def good_request_works(http: Http) -> None:
    r = http.post(
        "/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 1}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def chat(**fields) -> dict:
    return {"model": NAME, "messages": USER, "max_tokens": 2, **fields}


LONG = [{"role": "user", "content": "hello world " * 80}]  # > MAX_LEN tokens

CASES = [
    # (name, path, body (dict, or raw bytes), status, param, words in the message)
    ("malformed json", "/v1/chat/completions", b'{"model": "x", ', 400, None, "Invalid JSON"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None, "Expected `object`"),
    ("missing messages", "/v1/chat/completions", {"model": NAME}, 400, None, "missing required field `messages`"),
    ("wrong type", "/v1/chat/completions", chat(max_tokens="ten"), 400, "max_tokens", "Expected `int | null`"),
    ("bad role", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role", "robot"),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-5"), 404, "model", "'gpt-5' does not exist"),
    ("both drop forms", "/v1/chat/completions",
     chat(messages=THREE, drop_message={"2": [0]}, drop_rule={"type": "message_drop", "drop_messages": {"2": [0]}}),
     400, "drop_rule", "give one"),
    ("cache and AKV forms", "/v1/chat/completions", chat(messages=THREE, cache={"drop": {"2": [0]}},
     drop_message={"2": [0]}), 400, "cache", "not both"),
    ("drop after trigger", "/v1/chat/completions", chat(messages=THREE, drop_message={"1": [2]}), 400,
     "drop_message", "after its trigger"),
    ("drop id not an int", "/v1/chat/completions", chat(messages=THREE, cache={"drop": {"2": ["a"]}}), 400,
     "cache.drop[...][0]", "Expected `int`"),
    ("reposition not increasing", "/v1/chat/completions", chat(messages=THREE, reposition=[1, 1]), 400,
     "reposition", "strictly increasing"),
    ("reposition of nothing", "/v1/chat/completions", chat(messages=THREE, cache={"drop": {"0": [0]},
     "reposition": [0]}), 400, "cache.reposition", "nothing is active"),
    ("unknown drop rule", "/v1/chat/completions", chat(messages=THREE, drop_rule={"type": "text_drop"}), 400,
     "drop_rule.type", "unknown drop_rule type"),
    ("thinking twice", "/v1/chat/completions", chat(messages=[*USER, {"role": "assistant", "content":
     "<think>a</think>b", "reasoning_content": "a"}, USER[0]], drop_rule={"type": "thinking_drop"}), 400,
     "messages[1]", "both"),
    ("prompt past max-model-len", "/v1/chat/completions", chat(messages=LONG), 400, "messages", "max_model_len"),
    ("bad tool-call arguments", "/v1/chat/completions", chat(messages=[*USER, {"role": "assistant", "tool_calls":
     [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ("n out of range", "/v1/chat/completions", chat(n=17), 400, "n", "n must be"),
    ("tool_choice required", "/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice",
     "needs tools"),
    ("bad temperature", "/v1/chat/completions", chat(temperature=-1), 400, "temperature", "temperature must be"),
    ("zero max_tokens", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens", "positive integer"),
    ("top_logprobs alone", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs", "logprobs=true"),
    ("completion batch", "/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt", "batched"),
    ("token id outside vocab", "/v1/completions", {"model": NAME, "prompt": [1, 10**6]}, 400, "prompt",
     "outside the vocabulary"),
    ("completion past max-model-len", "/v1/completions", {"model": NAME, "prompt": [5] * 200}, 400, "prompt",
     "max_model_len"),
    ("completion unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model", "does not exist"),
    ("body too large", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * (32 << 10)}]), 413,
     None, "too large"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input(http: Http, name, path, body, status, param, words) -> None:
    content = body if isinstance(body, bytes) else _dumps(body)
    r = http.post(path, content=content, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    good_request_works(http)


def test_stream_errors_come_before_the_stream(http: Http) -> None:
    """A streamed request that the engine rejects still gets a plain HTTP 400, not a broken stream."""
    r = http.post("/v1/chat/completions", json=chat(messages=LONG, stream=True), headers=AUTH)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    good_request_works(http)


def test_api_key(http: Http) -> None:
    for headers, words in [({}, "Missing API key"), ({"Authorization": "Bearer wrong"}, "Incorrect API key")]:
        r = http.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and words in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers=headers).status_code == 401
        good_request_works(http)
    assert http.get("/health").status_code == 200  # health and metrics need no key
    assert http.get("/metrics").status_code == 200
    # the Anthropic SDK's header: the right key passes, a wrong one is a 401
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert http.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_unknown_route_and_method(http: Http) -> None:
    r = http.get("/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.get("/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]
    good_request_works(http)
    http.engine.check()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_cli_subprocess(tmp_path: Path) -> None:
    """`serve_main` from the command line: binds 127.0.0.1, checks the key, serves the preset, exits on SIGTERM."""
    port = free_port()
    cmd = [sys.executable, "-m", "minakv.server.serve", MODEL, "--port", str(port), "--api-key", KEY,
           "--served-model-name", "cli-model", "--kv-cache-tokens", "1024", "--max-model-len", "256"]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if Http(url).get("/health").status_code == 200:
                    break
            except urllib.error.URLError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        client = Http(url)
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models["data"]] == ["cli-model"]
        body = {"model": "cli-model", "prompt": "hello", "max_tokens": 2}
        r = client.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # bound to loopback only: the port is not open on another local address of this machine
        addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        for address in addresses - {"127.0.0.1"}:
            if address.startswith("127."):
                continue
            with socket.socket() as s:
                s.settimeout(1)
                assert s.connect_ex((address, port)) != 0
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_serve_cli_bad_arguments(capsys: pytest.CaptureFixture) -> None:
    from minakv.server.serve import serve_main

    for argv, words in [
        ([MODEL, "--page-size", "0"], "--page-size: must be a positive integer, got '0'"),
        ([MODEL, "--port", "70000"], "--port: must be a port number"),
        ([MODEL, "--dtype", "int3"], "--dtype: invalid choice"),
        ([], "the following arguments are required: model"),
    ]:
        with pytest.raises(SystemExit) as info:
            serve_main(argv)
        assert info.value.code == 2 and words in capsys.readouterr().err
    assert serve_main(["no-such-model-anywhere"]) == 2
    assert "is not a local directory, a preset" in capsys.readouterr().err
