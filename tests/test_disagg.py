"""Prefill/decode disaggregation (`prefill_devices=["cpu"], decode_devices=["cpu"]`: two worker processes,
gloo; docs/workers.md) against independent references:

- random drop/reposition programs, batched with chunked prefill so prefill and decode parts share steps: the
  same greedy tokens as the colocated engine, and the walk oracle's logprobs (both families, fp32);
- an agent's rounds: the decode side receives only pages it lacks, the prefill side reads the previous
  answer's KV back from the decode side instead of recomputing it (the colocated engine's computed tokens);
- a killed worker (either one) ends its requests within 5 s as `Unavailable`, the pair restarts, serves the
  same tokens, and no process is left after shutdown;
- the parts: the batch split and the coherence table, without processes.

Each disaggregated engine spawns two children that import torch (seconds each), so one engine per family
serves the module."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.processes import SMALL_STEPS, alive, assert_recovered, kill_while_decoding
from helpers.programs import (
    assert_matches_oracle,
    assert_penalties_and_grammars_match,
    mixed_prompts,
    programs,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv import Engine, SamplingParams
from minakv.config import EngineConfig
from minakv.engine import Unavailable
from minakv.worker.build import load_model_by_name
from minakv.worker.coherence import DECODE, PREFILL, Coherence
from minakv.worker.split import split_batch

SETTINGS = SMALL_STEPS
PD = {"prefill_devices": ["cpu"], "decode_devices": ["cpu"]}
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
FAMILIES = {"minimax_m2": "tiny-minimax-m2", "gpt_oss": "tiny-gpt-oss"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(the oracle's model, a colocated engine, a disaggregated engine) of one family."""
    preset = FAMILIES[request.param]
    model = load_model_by_name(EngineConfig(model=preset, device="cpu"))  # what the children load too
    local = Engine(preset, **SETTINGS)
    pd = Engine(preset, **PD, **SETTINGS)
    yield model, local, pd
    pids = pd.worker.pids
    pd.shutdown()
    local.shutdown()
    assert pids and not any(alive(pid) for pid in pids)  # shutdown leaves no worker process behind


# ----- parity -----
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.lists(programs(max_messages=5, max_len=9, vocab=384), min_size=3, max_size=5), seed=st.integers()
)
def test_random_programs_match_the_colocated_engine_and_the_walk(family, batch, seed) -> None:
    model, local, pd = family
    batch, prompts = mixed_prompts(batch, seed)
    expected = local.generate(prompts, GREEDY)
    outs = pd.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for (segments, cache), out in zip(batch, [o for i, o in enumerate(outs) if i != 1]):
        assert_matches_oracle(model, segments, cache, out, tol=1e-4)
    pd.check()


def test_penalties_and_grammars_match_the_colocated_engine(family) -> None:
    """A penalised request's counts move from the prefill worker's table to the decode worker's; a grammar's
    mask rows follow their sample rows into either part."""
    _, local, pd = family
    assert_penalties_and_grammars_match(local, pd)


# ----- what moves between the workers, across an agent's rounds -----
def test_rounds_send_only_new_pages_and_reuse_the_returned_answer(family) -> None:
    _, local, pd = family
    rng = random.Random(11)
    ps = SETTINGS["page_size"]
    history = [[rng.randrange(1, 384) for _ in range(21)], [rng.randrange(1, 384) for _ in range(6)]]
    drop: dict[str, list[int]] = {}
    reposition: list[int] = []
    params = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)
    for round_ in range(3):
        if round_ == 2:  # the third round drops the first tool result and repositions
            drop[str(len(history) - 1)] = [1]
            reposition.append(len(history) - 1)
        prompt = {"message_tokens": [list(m) for m in history], "cache": {"drop": dict(drop),
                  "reposition": list(reposition)}}  # fmt: skip
        before_local, before = local.stats(), pd.stats()
        (expected,) = local.generate([prompt], params)
        (out,) = pd.generate([prompt], params)
        after_local, after = local.stats(), pd.stats()
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        computed = delta["prefill_tokens"]
        assert out.token_ids == expected.token_ids
        assert computed == after_local["prefill_tokens"] - before_local["prefill_tokens"]  # same reuse
        # the decode side receives the pages the prefill side computed (or re-rotated), nothing older
        assert delta["kv_pages_to_decode"] <= -(-(computed + out.usage.repos_tokens) // ps) + 1
        if round_ >= 1:
            answer, new = len(history[-2]), len(history[-1])
            assert computed < answer + new  # the previous answer's full pages were not recomputed ...
            assert delta["kv_pages_to_prefill"] > 0  # ... but read back from the decode side
        if (
            round_ == 1
        ):  # the decode side still holds round 1's prompt and answer (the reposition copies them)
            assert delta["kv_pages_decode_had"] >= (sum(map(len, history[:-2])) + answer) // ps - 1
        assert delta["kv_bytes_to_decode"] == delta["kv_pages_to_decode"] * ps * pd.worker.kv_bytes_per_token
        history += [out.token_ids, [rng.randrange(1, 384) for _ in range(5)]]  # the answer, a tool result
    pd.check()


# ----- faults -----
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_killed_worker_fails_its_streams_fast_then_the_pair_serves_again(family, side) -> None:
    _, local, pd = family
    old = pd.worker.pids
    victim = old[1 if side == "decode" else 0]
    streams = kill_while_decoding(pd, victim)
    for outs in streams:
        assert (
            f"the {side} worker process (pid {victim}" in outs[-1].error
            and "restarting the workers" in outs[-1].error
        )
    assert_recovered(pd, local, old, GREEDY)


# ----- settings -----
def test_settings_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="a list alone is one worker"):
        Engine("tiny-minimax-m2", prefill_devices=["cpu", "cpu"], **SETTINGS)
    with pytest.raises(ValueError, match="same one device type"):
        Engine("tiny-minimax-m2", prefill_devices=["cpu"], decode_devices=["cuda:0"], **SETTINGS)


def test_the_server_answers_503_for_a_request_a_dead_worker_ended() -> None:
    from minakv.server.running import failure

    err = failure(Unavailable("r", [], finish_reason="error", error="the decode worker process died"))
    assert err.status == 503 and "decode worker process died" in str(err.message)


# ----- the parts, without processes -----
def test_split_batch_sends_decodes_and_their_samples_to_the_decode_worker() -> None:
    engine = Engine("tiny-minimax-m2", **SETTINGS)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5, 6]], params)  # warm: one request decodes while others prefill
    r = engine._make([1, 2, 3, 4, 5, 6, 7, 8], params)
    engine.scheduler.add(r)
    engine.step()
    engine.step()  # r decodes now
    for prompt in ([9] * 40, [4, 5, 6]):
        engine.scheduler.add(engine._make(prompt, params))
    batch = engine.scheduler.schedule()
    prefill, decode = split_batch(batch)
    assert decode is not None and prefill is not None
    assert decode.input_ids + prefill.input_ids == batch.input_ids
    assert decode.num_decode == batch.num_decode and prefill.num_decode == 0
    assert [decode.sample_rows, [x + batch.num_decode for x in prefill.sample_rows]] == [
        batch.sample_rows[: len(decode.sample_rows)],
        batch.sample_rows[len(decode.sample_rows) :],
    ]
    assert not decode.scheduled and not prefill.scheduled and not prefill.table_writes[0]
    engine.shutdown()


def test_coherence_moves_a_page_only_to_a_side_that_lacks_it() -> None:
    c = Coherence(8)
    pages = lambda *p: np.asarray(p, dtype=np.int64)
    none = pages()
    c.fresh(3)
    plan = c.plan([none, none], [pages(3), none])  # the prefill side writes page 3: no transfer (fresh)
    assert not plan.sends
    plan = c.plan([none, pages(3)], [none, pages(4)])  # the decode side reads it: sent once
    moves = plan.sends[(PREFILL, DECODE)]
    assert moves.pages.tolist() == [3] and moves.versions.tolist() == [c.version[3]] and len(plan.sends) == 1
    plan = c.plan([none, pages(3)], [none, none])  # read again: it is there
    assert not plan.sends and plan.had[DECODE] == 1
    plan = c.plan([pages(4), none], [none, none])  # the decode side wrote page 4: back to the prefill side
    assert list(plan.sends) == [(DECODE, PREFILL)] and plan.sends[(DECODE, PREFILL)].pages.tolist() == [4]
    assert (c.held[PREFILL, [3, 4]] == c.held[DECODE, [3, 4]]).all()
    with pytest.raises(RuntimeError, match="written by another worker"):
        c.plan([none, none], [pages(5), pages(5)])
