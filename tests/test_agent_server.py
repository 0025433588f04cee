"""An agent replay through the real server: 2 tasks x 5 rounds on tiny-gpt-oss with the `openai` client,
each task's cache operations made by a CachePolicy and sent as `extra_body`.

Each round both tasks send their request at once; each reply's text is folded back into the history as
the assistant turn, with scripted tool calls, followed by their tool results. Checked per round:

- what the server received (recorded by a middleware) is the history and exactly the policy's operations;
- the token counter counts what the server renders (its sum is the reply's prompt_tokens);
- usage adds up: cached + computed + drop-skipped = prompt tokens, with computed measured independently
  (the engine's prefill counter over the round), and from round 1 on only about the new messages are
  computed: the cumulative operations let the server reuse every earlier round;
- the non-streamed task's tokens equal `Engine.generate` on the same prompt with the same operations.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest
from aiohttp import web
from helpers.server import ServerThread, chat_bytes, greedy, token_bytes, wait_idle

from minakv.agent import CachePolicy, TokenCounter
from minakv.engine import Engine
from minakv.server.app import make_app

MODEL = "tiny-gpt-oss"
ROUNDS = 5
CALLS = [1, 2, 1, 2, 1]  # tool calls the assistant makes in round r
MAX_TOKENS = 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@dataclass
class Task:
    name: str
    policy: CachePolicy
    stream: bool
    counter: TokenCounter | None = None
    messages: list[dict] = field(default_factory=list)
    usage: list[dict] = field(default_factory=list)  # per round: the reply's usage as a dict
    counts: list[list[int] | None] = field(default_factory=list)  # per round: the counter's counts

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": f"Find the bug in project {self.name}."},
        ]


def tool_result(task: str, r: int, k: int) -> str:
    lines = 4 + (7 * r + 3 * k) % 9  # lengths vary from result to result
    return "\n".join(f"{task} file {r}.{k} line {i}: value = {i * r + k}" for i in range(lines))


@pytest.fixture(scope="module")
def setup():
    engine = Engine(MODEL, kv_cache_tokens=16384, max_model_len=4096)
    app = make_app(engine)
    received: dict[str, list[dict]] = {}

    @web.middleware
    async def record(request: web.Request, handler):
        if request.path == "/v1/chat/completions":
            body = json.loads(await request.read())  # aiohttp keeps the body for the handler
            received.setdefault(body.get("user"), []).append(body)
        return await handler(request)

    app.middlewares.append(record)
    server = ServerThread(app)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                           timeout=120)  # fmt: skip
    yield engine, client, received
    server.stop()


def run_round(client: openai.OpenAI, task: Task, r: int) -> dict:
    """Send round r; fold the reply and round r's tool results into the history. Returns the reply's
    usage, text and (non-streamed) the reply."""
    counts = task.counter.count(task.messages, tools=TOOLS) if task.counter else None
    task.counts.append(counts)
    kwargs = {
        "model": MODEL, "messages": task.policy.messages(task.messages), "tools": TOOLS,
        "max_tokens": MAX_TOKENS, "temperature": 0, "user": task.name,
        "extra_body": task.policy.extra_body(task.messages, counts),
    }  # fmt: skip
    if task.stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage, reply = chunks[-1].usage, None  # cache operations: the usage chunk comes unasked
    else:
        reply = client.chat.completions.create(**kwargs, logprobs=True)
        text, usage = reply.choices[0].message.content or "", reply.usage
    task.usage.append(usage.model_dump())
    calls = [
        {"id": f"{task.name}_{r}_{k}", "type": "function",
         "function": {"name": "read", "arguments": json.dumps({"path": f"src/{r}_{k}.py"})}}
        for k in range(CALLS[r])
    ]  # fmt: skip
    task.messages.append({"role": "assistant", "content": text, "tool_calls": calls})
    task.messages += [
        {"role": "tool", "tool_call_id": c["id"], "content": tool_result(task.name, r, k)}
        for k, c in enumerate(calls)
    ]
    return {"reply": reply, "sent": kwargs}


def test_replay_two_tasks_five_rounds(setup) -> None:
    engine, client, received = setup
    counter = TokenCounter.from_model(MODEL)
    tasks = [
        Task("a", CachePolicy(keep_tool_results=2, target="both", reposition_every_calls=2), stream=True),
        Task(
            "b", CachePolicy(keep_tool_results=1, reposition_after_tokens=300), stream=False, counter=counter
        ),
    ]
    page = engine.config.page_size
    computed_rounds = []
    with ThreadPoolExecutor(len(tasks)) as pool:
        for r in range(ROUNDS):
            histories = [list(t.messages) for t in tasks]  # what round r sends
            before = wait_idle(engine)["prefill_tokens"]
            results = list(pool.map(lambda t, r=r: run_round(client, t, r), tasks))
            computed = wait_idle(engine)["prefill_tokens"] - before
            computed_rounds.append(computed)
            for task, history in zip(tasks, histories, strict=True):
                body = received[task.name][-1]
                assert body["messages"] == history
                assert body["cache"] == task.policy.ops(history, task.counts[r])
                assert set(body) & {"drop_message", "drop_rule", "reposition"} == set()
            usages = [t.usage[r] for t in tasks]
            prompt = sum(u["prompt_tokens"] for u in usages)
            details = [u["prompt_tokens_details"] for u in usages]
            cached = sum(d["cached_tokens"] for d in details)
            skipped = sum(d["drop_skipped_tokens"] for d in details)
            assert cached + computed + skipped == prompt, (r, usages, computed)
            if r > 0:
                assert all(d["cached_tokens"] > 0 for d in details)
                # only what is new since the last round is computed (plus the partly matched page and the
                # generation prompt the assistant turn replaces)
                new = sum(t.usage[r]["prompt_tokens"] - t.usage[r - 1]["prompt_tokens"] for t in tasks)
                assert computed <= new + len(tasks) * (page + 8), (r, computed, new)
            # the counter counts what the server renders, and the server applied exactly these operations
            b, sent = tasks[1], results[1]["sent"]
            assert sum(b.counts[r]) == b.usage[r]["prompt_tokens"]
            prompt_b = {"messages": sent["messages"], "tools": TOOLS, **sent["extra_body"]}
            assert chat_bytes(results[1]["reply"]) == token_bytes(
                engine, greedy(engine, prompt_b, MAX_TOKENS)
            )
    # both policies dropped and repositioned, and the server re-rotated keys for it
    for task in tasks:
        last = received[task.name][-1]["cache"]
        assert last["drop"] and last["reposition"], (task.name, last)
        assert sum(u["prompt_tokens_details"]["repos_tokens"] for u in task.usage) > 0
