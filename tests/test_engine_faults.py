"""Fault injection: random workloads with aborts, preemption (a small pool), cache operations and step
exceptions at random points. Afterwards the pool accounting is exact, every request ended (finished,
aborted or failed), and the engine serves a new request exactly as a fresh engine does. The same with
separate prefill and decode worker processes (docs/workers.md): evictions, preemptions and failed steps must
leave the workers' coherence table right, or the pages read afterwards would be stale on one side."""

from __future__ import annotations

import pytest
from helpers.models import tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minakv import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("gpt_oss")


events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(3, 40), st.booleans(), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("fail"), st.integers(1, 2)),  # the next n launches raise
        st.tuples(st.just("step"), st.integers(1, 6)),
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=events, seed=st.integers(0, 1000))
@example(script=[("add", 20, True, 8), ("add", 30, False, 10), ("step", 2), ("fail", 2), ("step", 6),
                 ("abort", 0), ("fail", 1), ("step", 6), ("add", 25, True, 5), ("step", 3)], seed=1)  # fmt: skip
def test_random_faults_leave_exact_accounting_and_a_serving_engine(model, script, seed) -> None:
    run_script(model, script, seed)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=events, seed=st.integers(0, 1000))
def test_many_random_faults(model, script, seed) -> None:
    run_script(model, script, seed)


SMALL = {"page_size": 4, "kv_cache_tokens": 160, "max_num_batched_tokens": 32, "max_num_seqs": 6}


@pytest.fixture(scope="module")
def pair():
    """A prefill/decode pair with a small pool (one for the module: each pair spawns two processes), and a
    colocated engine of the same preset for the expected tokens."""
    preset = "tiny-minimax-m2"
    pd = Engine(preset, prefill_devices=["cpu"], decode_devices=["cpu"], device="cpu", **SMALL)
    yield pd, (lambda: Engine(preset, device="cpu", **SMALL))
    pd.shutdown()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=events, seed=st.integers(0, 1000))
@example(script=[("add", 30, True, 12), ("add", 40, False, 12), ("add", 35, True, 12), ("step", 6),
                 ("fail", 1), ("step", 6), ("add", 30, True, 8), ("step", 6)], seed=3)  # fmt: skip
def test_random_faults_with_separate_prefill_and_decode_workers(pair, script, seed) -> None:
    engine, fresh = pair
    run_script(None, script, seed, engine=engine, fresh=fresh)


def run_script(model, script, seed, engine: Engine | None = None, fresh=None) -> None:
    engine = engine or Engine(model, **SMALL)
    fresh = fresh or (lambda: Engine(model, page_size=4, kv_cache_tokens=160))
    launch, fail = engine.worker.launch, {"n": 0}

    def faulty(batch):
        if fail["n"]:
            fail["n"] -= 1
            raise RuntimeError("injected")
        return launch(batch)

    engine.worker.launch = faulty
    try:
        added = play(engine, script, seed, fail)
    finally:
        engine.worker.launch = launch
    # the engine serves, and what it cached is sound: earlier prompts (cache hits) decode as on a fresh engine
    for prompt in [[5, 6, 7, 8, 9, 10], *[r.prompt_ids for r in added[:3]]]:
        expected = fresh().generate([prompt], GREEDY)[0]
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected.token_ids
    engine.check()


def play(engine: Engine, script, seed, fail: dict) -> list:
    added = []
    for i, event in enumerate(script):
        if event[0] == "add":
            _, length, ops, max_tokens = event
            tokens = [(seed + i * 7 + j) % 300 + 1 for j in range(length)]
            parts = [tokens[: length // 3], tokens[length // 3 : 2 * length // 3], tokens[2 * length // 3 :]]
            prompt = (
                {"message_tokens": parts, "cache": {"drop": {"1": [0]}, "reposition": [1]}}
                if ops and all(parts)
                else tokens
            )
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True)
            r = engine._make(prompt, params)
            engine.scheduler.add(r)
            added.append(r)
        elif event[0] == "abort" and added:
            engine.scheduler.abort(added[event[1] % len(added)].request_id)
        elif event[0] == "fail":
            fail["n"] = event[1]
        else:
            for _ in range(event[1]):
                if engine.scheduler.has_work():
                    try:
                        engine.step()
                    except RuntimeError:  # what the engine loop does with a step that raised
                        engine._inflight = None
                        engine.scheduler.quarantine("injected")
    fail["n"] = 0
    while engine.scheduler.has_work():
        engine.step()
    engine._flush()
    assert all(r.finish_reason in ("length", "abort", "error") for r in added)
    engine.check()
    return added
