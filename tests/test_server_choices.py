"""`n` > 1 (minakv/server/choices.py): n choices for one prompt, whose KV is computed once. Through the
`openai` client against a real server: chat and completions, streamed and not."""

from __future__ import annotations

import openai
import pytest
from helpers.server import ServerThread, wait_idle

from minakv.engine import Engine
from minakv.params import SamplingParams
from minakv.server.app import make_app

NAME = "choices-test"
PAGE = 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("tiny-minimax-m2", kv_cache_tokens=8192, max_model_len=1024, page_size=PAGE)


@pytest.fixture(scope="module")
def client(engine: Engine):
    srv = ServerThread(make_app(engine, NAME))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=60)
    srv.stop()


def test_n_choices_share_the_prompt(engine: Engine, client: openai.OpenAI) -> None:
    wait_idle(engine)
    ids = [(13 * i) % 400 + 5 for i in range(150)]  # a fresh prompt of 150 tokens
    before = engine.stats()["prefill_tokens"]
    resp = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=1.0, seed=7, n=3,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    computed = engine.stats()["prefill_tokens"] - before
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1  # seeds 7, 8, 9
    assert computed <= len(ids) + 2 * PAGE  # the prompt once, plus each later choice's last partial page
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 18
    assert resp.usage.prompt_tokens_details.cached_tokens >= 2 * (len(ids) // PAGE * PAGE - PAGE)
    # each choice is the request it stands for: choice i equals a lone request with seed 7 + i
    for i, choice in enumerate(resp.choices):
        alone = engine.generate(
            [ids], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True)
        )
        assert choice.text == alone[0].text
    engine.check()


def test_n_chat_choices_streamed_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "three answers please"}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.message.content for c in full.choices}) == 1  # greedy: the same answer three times
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, n=3,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = {i: "" for i in range(3)}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    single = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=5, temperature=0, stream=True
    )
    one = "".join(c.choices[0].delta.content or "" for c in single if c.choices)
    assert all(t == one for t in text.values())  # each streamed choice is what n=1 streams
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_out_of_range_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=17)
