"""What a hostile client can send, and what it gets: the template-variable allow-list and the sandbox, the
limits, the OpenAI error shape for every error (aiohttp's own included, and no internal text in a 500),
`/v1/models/{id}`, and the event loop staying free while a 30 MB body is decoded and refused.

One server for the module, on tiny-gpt-oss with a short context and small limits, served by the same
runner class `minakv serve` uses (errors.Runner), so malformed HTTP is answered as in production.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import gzip
import json
import logging
import os
import socket
import time
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import msgspec
import openai
import pytest
from helpers.server import ServerThread, wait_idle

from minakv.engine import Engine
from minakv.server.app import make_app
from minakv.server.errors import Runner
from minakv.server.limits import Limits

MODEL = "tiny-gpt-oss"
NAME = "hardened"
MAX_LEN = 64
LIMITS = Limits(max_messages=8, max_tools=2, max_stop=2, max_stop_chars=8, max_stop_token_ids=4)
USER = [{"role": "user", "content": "hello"}]
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(MODEL, kv_cache_tokens=2048, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(engine: Engine):
    srv = ServerThread(make_app(engine, NAME, limits=LIMITS), runner=Runner)
    srv.url = f"http://127.0.0.1:{srv.port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    """POST with the standard library; returns (status, JSON body)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(server.url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(**fields) -> dict:
    return {"model": NAME, "messages": USER, "max_tokens": 2, **fields}


def assert_error(
    status: int, body: dict, want_status: int, param: str | None = None, words: str = ""
) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def good_request_works(server) -> None:
    status, body = post(server, "/v1/chat/completions", chat(max_tokens=1))
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body


# ---------------------------------------------------------------------------------------------------------
# The template is the model's


BAD_TEMPLATE_KWARGS = [
    (
        {"template": "{{ cycler.__init__.__globals__.os.popen('id').read() }}"},
        "chat_template_kwargs.template",
    ),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"tools": [{"type": "function"}]}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"bos_token": "<|x|>"}, "chat_template_kwargs.bos_token"),
    ({"reasoning_effort": "max"}, "chat_template_kwargs.reasoning_effort"),
    ({"builtin_tools": ["shell"]}, "chat_template_kwargs.builtin_tools"),
    ({"model_identity": {"a": 1}}, "chat_template_kwargs.model_identity"),
    ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_TEMPLATE_KWARGS, ids=[p for _, p in BAD_TEMPLATE_KWARGS])
def test_template_kwargs_outside_the_allow_list_are_400(server, kwargs, param) -> None:
    status, body = post(server, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    assert_error(status, body, 400, param, "chat_template_kwargs")


def test_allowed_template_kwargs_render(server, engine, monkeypatch) -> None:
    kwargs = {"reasoning_effort": "low", "model_identity": "You are {{ 7 * 7 }}", "builtin_tools": ["python"],
              "enable_thinking": False}  # fmt: skip
    status, body = post(server, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    assert status == 200, body
    path = TEMPLATES / "gpt-oss.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    # the server's own way to tokens, with the official template, which reads these variables (its
    # preamble alone is longer than this server's context): a value is text, never a template
    from minakv.server.prepare import chat_tokens
    from minakv.server.prompts import chat_prompt
    from minakv.server.protocol import ChatCompletionRequest

    monkeypatch.setattr(engine.tokenizer, "chat_template", path.read_text())
    body = chat(chat_template_kwargs=kwargs)
    prompt, ops, _ = chat_prompt(msgspec.convert(body, ChatCompletionRequest), body)
    tokens = chat_tokens(SimpleNamespace(tokenizer=engine.tokenizer, max_model_len=4096), prompt, ops)
    text = engine.tokenizer.decode([t for part in tokens.prompt["message_tokens"] for t in part])
    assert "You are {{ 7 * 7 }}" in text and "Reasoning: low" in text and "49" not in text
    assert "## python" in text  # the builtin tool's section


def test_templates_render_sandboxed(engine: Engine) -> None:
    """Content is data, never template code; and a model's template cannot reach Python internals."""
    from minakv.text.chat import ChatError, render

    rendered = render([{"role": "user", "content": "{{ 7 * 7 }}{% raw %}"}], engine.tokenizer)
    assert "{{ 7 * 7 }}{% raw %}" in rendered.text
    for attack in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__ }}",
                   "{% set x = messages.append(1) %}"):  # fmt: skip
        with pytest.raises(ChatError):
            render(
                USER, engine.tokenizer, template=attack + "{% for m in messages %}{{ m.content }}{% endfor %}"
            )


# ---------------------------------------------------------------------------------------------------------
# Limits

THREE = [*USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "what"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

LIMIT_CASES = [
    ("messages", chat(messages=USER * 9), 400, "messages", "at most 8 messages"),
    ("tools", chat(tools=[TOOL] * 3), 400, "tools", "at most 2 tools"),
    ("stop strings", chat(stop=["a", "b", "c"]), 400, "stop", "at most 2 stop strings"),
    ("stop length", chat(stop=["a", "x" * 9]), 400, "stop[1]", "at most 8 characters"),
    ("one long stop", chat(stop="x" * 9), 400, "stop", "at most 8 characters"),
    ("stop token ids", chat(stop_token_ids=[1, 2, 3, 4, 5]), 400, "stop_token_ids", "at most 4"),
    ("max_tokens past the context", chat(max_tokens=10**12), 400, "max_tokens", "room for"),
    ("max_completion_tokens past it", chat(max_completion_tokens=MAX_LEN), 400, "max_completion_tokens", "room for"),
    ("cache entries", chat(messages=THREE, reposition=list(range(30))), 400, "reposition", "at most 24"),
    ("prompt too long", chat(messages=[{"role": "user", "content": "hello world " * 40}]), 400, "messages",
     "max_model_len"),
    ("text too long to tokenize", chat(messages=[{"role": "user", "content": "x" * 200_000}]), 400, "messages",
     "characters long"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "words"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES]
)
def test_limits(server, name, body, status, param, words) -> None:
    code, reply = post(server, "/v1/chat/completions", body)
    assert_error(code, reply, status, param, words)
    good_request_works(server)


def test_completion_limits(server) -> None:
    status, body = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 10**12})
    assert_error(status, body, 400, "max_tokens", "room for")
    status, body = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "stop": ["a", "b", "c"]})
    assert_error(status, body, 400, "stop", "at most 2")
    status, body = post(server, "/v1/completions", {"model": NAME, "prompt": "x" * 100_000})
    assert_error(status, body, 400, "prompt", "characters long")


def test_max_tokens_default_is_the_context_left(server, client, engine) -> None:
    """No max_tokens: chat runs until the context is full (vLLM's default), and asking for exactly the room
    left is accepted; legacy completions default to 16."""
    body = chat(ignore_eos=True, temperature=0)
    del body["max_tokens"]
    status, reply = post(server, "/v1/chat/completions", body)
    usage = reply["usage"]
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN
    room = MAX_LEN - usage["prompt_tokens"]
    status, reply = post(
        server, "/v1/chat/completions", chat(max_tokens=room, ignore_eos=True, temperature=0)
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == room
    status, reply = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 16
    wait_idle(engine)


def test_repositioned_history_longer_than_the_context(server, engine) -> None:
    """max_model_len bounds positions: a history longer than the context runs when drops and a reposition
    keep its positions compact, and max_tokens is checked against the positions left."""
    long = "hello world " * 18  # each long message fits in the context; both do not
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": long},
            {"role": "assistant", "content": long}, {"role": "user", "content": "what"}]  # fmt: skip
    ops = {"drop_message": {"1": [1], "2": [2]}, "reposition": [1, 2]}  # each leaves after itself
    status, reply = post(server, "/v1/chat/completions", chat(messages=msgs, max_tokens=10**6, **ops))
    assert_error(status, reply, 400, "max_tokens", "positions")
    body = chat(messages=msgs, ignore_eos=True, temperature=0, **ops)
    del body["max_tokens"]
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 200, reply
    usage = reply["usage"]
    assert usage["prompt_tokens"] > MAX_LEN and reply["choices"][0]["finish_reason"] == "length"
    assert 1 <= usage["completion_tokens"] < MAX_LEN
    wait_idle(engine)


# ---------------------------------------------------------------------------------------------------------
# Every error in the OpenAI shape


def raw_http(server, data: bytes) -> tuple[int, str, dict]:
    """Send raw bytes; returns (status, content type, JSON body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < length(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("Content-Type", ""), json.loads(body)


def length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def request(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


CHAT = "POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n"
GOOD = json.dumps(chat(max_tokens=1)).encode()

HTTP_CASES = [
    ("bad header", request("GET /health HTTP/1.1\nHost: x\nBad Header: y\n"), 400),
    ("bad content-length", request(CHAT + "Content-Length: abc\n"), 400),
    ("bad chunk size", request(CHAT + "Transfer-Encoding: chunked\n", b"zz\r\nabc\r\n0\r\n\r\n"), 400),
    ("header too long", request("GET /health HTTP/1.1\nHost: x\nX: " + "a" * 9000 + "\n"), 400),
    ("bad method token", request("G@T /health HTTP/1.1\nHost: x\n"), 400),
    ("unknown content encoding", request(CHAT + "Content-Encoding: br\nContent-Length: 4\n", b"abcd"), 400),
    ("broken gzip", request(CHAT + "Content-Encoding: gzip\nContent-Length: 10\n", b"0123456789"), 400),
    ("broken deflate", request(CHAT + "Content-Encoding: deflate\nContent-Length: 4\n", b"abcd"), 400),
    ("not utf-8", request(CHAT + "Content-Length: 3\n", b"\xff\xfe\xfd"), 400),
    ("bad json", request(CHAT + "Content-Length: 9\n", b'{"model":'), 400),
    ("unknown route", request("GET /v1/nothing HTTP/1.1\nHost: x\n"), 404),
    ("wrong method", request("GET /v1/chat/completions HTTP/1.1\nHost: x\n"), 405),
    ("wrong method on models", request("DELETE /v1/models HTTP/1.1\nHost: x\n"), 405),
]


@pytest.mark.parametrize(("name", "data", "status"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_errors_are_openai_shaped(server, name, data, status) -> None:
    code, content_type, body = raw_http(server, data)
    assert code == status and content_type.startswith("application/json"), (code, content_type, body)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert "b'" not in body["error"]["message"]  # the parser's description, not the raw bytes it quotes
    good_request_works(server)


def test_gzip_body_is_read(server) -> None:
    data = gzip.compress(GOOD)
    code, _, body = raw_http(
        server, request(CHAT + f"Content-Encoding: gzip\nContent-Length: {len(data)}\n", data)
    )
    assert code == 200 and body["usage"]["completion_tokens"] == 1


def test_internal_error_text_stays_in_the_log(server, monkeypatch, caplog) -> None:
    from minakv.server import prompts

    def broken(req):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(prompts, "chat_logprobs", broken)
    with caplog.at_level(logging.ERROR, logger="minakv.server"):
        status, body = post(server, "/v1/chat/completions", chat())
    assert_error(status, body, 500, None, "internal error (id ")
    assert "secret" not in json.dumps(body) and body["error"]["code"] == "internal_error"
    error_id = body["error"]["message"].split("(id ")[1].split(")")[0]
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert error_id in caplog.text and "secret internal detail" in caplog.text, logged
    monkeypatch.undo()
    good_request_works(server)


def test_internal_error_mid_stream_ends_the_stream(server, engine, monkeypatch) -> None:
    """A bug after the stream has started: the stream ends with an error event and [DONE]."""
    from minakv.server import output

    real, calls = output.ChatParser.deltas, []

    def broken(self, out):
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("secret internal detail")
        return real(self, out)

    monkeypatch.setattr(output.ChatParser, "deltas", broken)
    body = json.dumps(chat(max_tokens=10, ignore_eos=True, stream=True, logprobs=True)).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request(CHAT + f"Content-Length: {len(body)}\nConnection: close\n", body))
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    events = [line[6:] for line in reply.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and b"secret" not in reply
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    monkeypatch.undo()
    wait_idle(engine)
    good_request_works(server)


# ---------------------------------------------------------------------------------------------------------
# Models


def test_models_by_id_and_unknown_model(server, client, engine) -> None:
    assert client.models.retrieve(NAME).id == NAME
    card = client.models.retrieve(MODEL)  # the model argument is accepted as a name too
    assert card.id == MODEL and card.max_model_len == MAX_LEN and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-5")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=USER, max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)


def test_openapi_document(server) -> None:
    import urllib.request

    with urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health"} <= set(
        doc["paths"]
    )
    chat_schema = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (
        chat_schema["model"]["enum"][0] == NAME and chat_schema["messages"]["maxItems"] == LIMITS.max_messages
    )


# ---------------------------------------------------------------------------------------------------------
# The event loop stays free


def test_health_answers_while_a_30mb_body_is_refused(server, engine) -> None:
    """A 30 MB request is read, decoded and refused (its rendered text cannot fit in the context) while
    /health answers within 0.5 s every time and a concurrent stream keeps producing tokens."""
    big = json.dumps(
        chat(messages=[{"role": "user", "content": "hello world " * ((30 << 20) // 12)}])
    ).encode()
    assert len(big) > 25 << 20

    async def scenario() -> tuple[list[float], list[float], tuple[int, dict], float]:
        async with aiohttp.ClientSession() as session:
            stream_times: list[float] = []
            health_times: list[float] = []
            done = asyncio.Event()

            async def stream() -> None:
                body = chat(
                    max_tokens=MAX_LEN - 20, ignore_eos=True, stream=True, logprobs=True
                )  # a chunk a token
                async with session.post(server.url + "/v1/chat/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            stream_times.append(time.monotonic())

            async def health() -> None:
                while not done.is_set():
                    start = time.monotonic()
                    async with session.get(server.url + "/health") as r:
                        assert r.status == 200
                    health_times.append(time.monotonic() - start)
                    await asyncio.sleep(0.05)

            streaming = asyncio.create_task(stream())
            while len(stream_times) < 3:  # the stream is producing
                await asyncio.sleep(0.01)
            polling = asyncio.create_task(health())
            start = time.monotonic()
            async with session.post(server.url + "/v1/chat/completions", data=big,
                                    headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                refused = (r.status, await r.json())
            elapsed = time.monotonic() - start
            done.set()
            await polling
            await streaming
            return stream_times, health_times, refused, elapsed

    stream_times, health_times, (status, body), elapsed = asyncio.run(scenario())
    assert_error(status, body, 400, "messages", "characters long")
    # within 0.5 s, allowing one late answer on a loaded 2-core CI machine (a blocked loop would take the
    # whole parse, many seconds, for every answer)
    late = sorted(health_times)[-2] if len(health_times) > 1 else health_times[0]
    assert health_times and late < 0.5 and max(health_times) < 2.0, health_times
    gaps = [b - a for a, b in pairwise(stream_times)]
    # the stream may pause while the request thread holds the GIL (~0.15 s alone; up to ~1.2 s measured
    # late in a full CI run on 2 cores), but never for the whole parse-and-tokenize of 30 MB (many seconds)
    assert len(stream_times) > 10 and max(gaps) < 2.0, (max(gaps), elapsed)
    wait_idle(engine)


def memory_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def release_freed_memory() -> None:
    """Collect garbage and hand the C allocator's freed pages back to the system. glibc keeps freed heap
    memory after large frees (its mmap threshold grows with them), so resident size alone would count
    memory nobody holds; late in a full test session that was one more 30 MB copy of the body."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: resident size as it is
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_30mb_body_costs_a_small_multiple_of_its_size_and_is_given_back(server, engine) -> None:
    """Peak memory while a 30 MB body is refused stays within a few times its size (the server runs in this
    process, the client's copy of the body included), and what it took is returned afterwards."""
    big = json.dumps(
        chat(messages=[{"role": "user", "content": "hello world " * ((30 << 20) // 12)}])
    ).encode()
    size = len(big) / 2**20
    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = memory_mb("VmRSS")
    r = requests_post(server.url + "/v1/chat/completions", big)
    assert r == 400
    release_freed_memory()
    peak, after = memory_mb("VmHWM") - before, memory_mb("VmRSS") - before
    assert peak < 8 * size, (peak, size)
    assert after < 2 * size, (after, size)


def requests_post(url: str, body: bytes) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code
