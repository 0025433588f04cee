"""Sampling fields over the OpenAI API: penalties, min_p and logit_bias reach the engine's sampler and give what
`Engine.generate` gives with the same SamplingParams (the sampler's formulas are tested in
tests/test_sampler_penalties.py); bad values are 400s naming the field."""

from __future__ import annotations

import openai
import pytest
from helpers.server import ServerThread

from minakv.engine import Engine
from minakv.params import SamplingParams
from minakv.server.app import make_app

NAME = "sampling-test"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("tiny-minimax-m2", max_model_len=256)


@pytest.fixture(scope="module")
def client(engine: Engine):
    srv = ServerThread(make_app(engine, NAME))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=60)
    srv.stop()


def test_penalties_and_bias_equal_generate(engine: Engine, client: openai.OpenAI) -> None:
    ids = engine.tokenizer.encode("the cache the cache the cache")
    fields = {"presence_penalty": 0.5, "frequency_penalty": 1.2}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "logit_bias": {str(ids[1]): 3.0}}
    resp = client.completions.create(
        model=NAME, prompt=ids, max_tokens=8, temperature=0, **fields, extra_body=extra
    )
    params = SamplingParams(
        max_tokens=8, temperature=0, repetition_penalty=1.3, logit_bias={ids[1]: 3.0}, **fields
    )
    assert resp.choices[0].text == engine.generate([ids], params)[0].text
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    forced = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0.8, seed=3,
                                       logit_bias={str(ids[2]): 100})  # fmt: skip
    assert forced.choices[0].text == engine.tokenizer.decode([ids[2]] * 4)
    assert plain.choices[0].text != forced.choices[0].text


@pytest.mark.parametrize(
    "bad,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999999999": 1}}, None),
    ],
)
def test_bad_sampling_fields_are_400(client: openai.OpenAI, bad: dict, param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="hello", max_tokens=2, **bad)
    if param is not None:
        assert err.value.body.get("param") == param, err.value.body


def test_a_degenerate_request_among_streams_hurts_nobody(engine: Engine, client: openai.OpenAI) -> None:
    """Numbers that pass validation but are numerically extreme (a temperature of 1e-300 is greedy; a tiny
    top_p keeps only the top token; a huge penalty) either succeed or fail alone: the other streams end
    normally with what they would have got anyway (issue: hardening)."""
    import concurrent.futures

    msgs = [{"role": "user", "content": "stay well"}]
    normal = {
        "model": NAME,
        "messages": msgs,
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    weird = [{"temperature": 1e-300}, {"temperature": 2.0, "top_p": 1e-9}, {"frequency_penalty": 2.0,
             "extra_body": {"repetition_penalty": 10.0, "min_p": 1.0}}]  # fmt: skip
    want = client.chat.completions.create(**normal).choices[0].message.content

    def run(kwargs: dict):
        return client.chat.completions.create(**kwargs)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        normals = [pool.submit(run, normal) for _ in range(4)]
        odd = [
            pool.submit(run, {**normal, **w, "extra_body": {"ignore_eos": True, **w.get("extra_body", {})}})
            for w in weird
        ]
        for f in normals:
            assert f.result().choices[0].message.content == want
        for f in odd:
            resp = f.result()  # succeeds (no 5xx, no error)
            assert resp.choices[0].finish_reason in ("length", "stop")
    engine.check()
