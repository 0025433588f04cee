"""The engine against the walk oracle (docs/design.md 2.3): random drop/reposition programs, batched with unrelated
requests, with chunked prefill, at page sizes 1, 16 and 7, and with a pool small enough that cached states are
evicted and restored."""

from __future__ import annotations

import random

import pytest
from helpers.models import tiny_model
from helpers.programs import assert_matches_oracle, compiles, programs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minakv import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
ENGINE_SHAPES = {  # page size, chunk budget, pool tokens
    "page1": {"page_size": 1, "max_num_batched_tokens": 512, "kv_cache_tokens": 4096},
    "page16-chunked": {"page_size": 16, "max_num_batched_tokens": 7, "kv_cache_tokens": 4096},
    "page7-small-pool": {"page_size": 7, "max_num_batched_tokens": 13, "kv_cache_tokens": 140},
}


@pytest.fixture(scope="module", params=["gpt_oss", "minimax_m2"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module", params=list(ENGINE_SHAPES))
def engine(request, model):
    engine = Engine(model, **ENGINE_SHAPES[request.param])
    yield engine
    engine.check()
    assert engine.stats()["running"] == 0


def unrelated(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(n)]


@settings(max_examples=17, deadline=None, suppress_health_check=list(HealthCheck))  # x6 engines: 102
@given(data=programs(), seed=st.integers(0, 2**16))
# two repositions in a row: copies of copies, which must not run in the same re-rotation call
@example(data=([[0]] * 6, {"drop": {"1": [0], "4": [1, 4]}, "reposition": [3, 4]}), seed=0)
def test_random_programs_match_the_walk(engine, model, data, seed):
    segments, cache = data
    if not compiles(segments, cache):
        return
    rng = random.Random(seed)
    others = unrelated(rng, 2)
    prompts = [others[0], {"message_tokens": segments, "cache": cache}, others[1]]
    outs = engine.generate(prompts, GREEDY)
    assert_matches_oracle(model, segments, cache, outs[1])
    engine.check()
    # the same request again, alone: served from the cache (when it fits) and still exact
    again = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[0]
    assert again.token_ids == outs[1].token_ids
    assert [x.logprob for x in again.logprobs] == pytest.approx(
        [x.logprob for x in outs[1].logprobs], abs=1e-6
    )
    engine.check()


def test_multi_round_agent_reuses_the_cache_and_matches_a_cold_engine(model):
    """Each round re-sends the history plus new messages and cumulative operations."""
    rng = random.Random(7)
    warm = Engine(model, page_size=4, max_num_batched_tokens=64, kv_cache_tokens=2048)
    history: list[list[int]] = [[rng.randrange(384) for _ in range(12)]]  # system + user
    drop: dict[str, list[int]] = {}
    reposition: list[int] = []
    for round_ in range(4):
        history.append([rng.randrange(384) for _ in range(rng.randint(5, 15))])  # a new tool result
        if round_ >= 1:
            drop[str(len(history) - 1)] = [len(history) - 3]  # drop the previous tool result
        if round_ == 2:
            reposition.append(len(history) - 1)
        cache = {"drop": dict(drop), "reposition": list(reposition)}
        prompt = {"message_tokens": [list(s) for s in history], "cache": cache}
        out = warm.generate([prompt], GREEDY)[0]
        assert_matches_oracle(model, history, cache, out)
        cold = Engine(model, page_size=4, kv_cache_tokens=2048).generate([prompt], GREEDY)[0]
        assert out.token_ids == cold.token_ids
        if round_ > 0:
            previous = sum(len(s) for s in history[:-2])  # everything before the last assistant turn
            assert out.usage.cached_tokens >= previous - 4, (round_, out.usage)
        history.append(out.token_ids)  # the assistant's answer joins the history
    warm.check()


def test_eviction_and_restore_between_rounds(model):
    """A pool that holds about one request: other traffic evicts the first request's state, which is then
    recomputed exactly."""
    rng = random.Random(3)
    engine = Engine(model, page_size=4, max_num_batched_tokens=32, kv_cache_tokens=96)
    segments = [[rng.randrange(384) for _ in range(10)] for _ in range(4)]
    cache = {"drop": {"2": [1]}, "reposition": [2]}
    first = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[0]
    for other in unrelated(rng, 3):
        engine.generate([other * 3], GREEDY)
    assert engine.stats()["evictions"] > 0
    second = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[0]
    assert first.token_ids == second.token_ids
    assert_matches_oracle(model, segments, cache, second)
    engine.check()


def test_restore_around_an_evicted_dropped_message(model):
    """The pages of a dropped tool result are evicted first; re-sending the history reuses the pages after
    the hole and recomputes only the last page: the dropped message is read by no query that still runs."""
    rng = random.Random(9)
    engine = Engine(model, page_size=4, kv_cache_tokens=256)
    segments = [[rng.randrange(384) for _ in range(8)] for _ in range(4)]  # 8 tokens = 2 pages each
    cache = {"drop": {"2": [1]}}  # message 1 is read by message 2, then dropped
    first = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[0]
    index = engine.scheduler.kv.index
    dropped_pages = {e.page for e in index.by_page.values() if e.dropped}
    assert len(dropped_pages) == 2
    assert set(index.evict(2)) == dropped_pages  # dropped-only pages go first
    before = engine.stats()["prefill_tokens"]
    second = engine.generate([{"message_tokens": segments, "cache": cache}], GREEDY)[0]
    assert engine.stats()["prefill_tokens"] - before == 4  # the page holding the last token, nothing else
    assert second.usage.cached_tokens == 32 - 8 - 4  # all but the dropped message and the last page
    assert second.token_ids == first.token_ids
    assert_matches_oracle(model, segments, cache, second)
    engine.check()


def test_preemption_recomputes_exactly(model):
    """More decode growth than the pool holds: requests are preempted and recomputed, outputs unchanged."""
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(6)] for _ in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=0, ignore_eos=True)
    tight = Engine(model, page_size=2, kv_cache_tokens=64)
    outs = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_matches_oracle(model, [prompt], {}, out)
    tight.check()


def test_history_dependence_three_requests(model):
    """docs/design.md 2.5: the same tokens A, B, C with three histories give the oracle's three outputs, in any
    order and concurrently."""
    rng = random.Random(11)
    a, b, c = ([rng.randrange(384) for _ in range(5)] for _ in range(3))
    histories = [
        ([a, b, c], {"drop": {"2": [0]}}),  # append A, B, C, drop A
        ([a, b, c], {"drop": {"1": [0]}}),  # append A, B, drop A, append C
        ([b, c], {}),  # append B, C
    ]
    expected = []
    engine = Engine(model, page_size=1, kv_cache_tokens=1024)
    prompts = [{"message_tokens": s, "cache": cache} for s, cache in histories]
    together = engine.generate(prompts, GREEDY)
    reversed_ = engine.generate(prompts[::-1], GREEDY)[::-1]
    one_by_one = [engine.generate([p], GREEDY)[0] for p in prompts]
    for (segments, cache), outs in zip(histories, zip(together, reversed_, one_by_one)):
        for out in outs:
            assert_matches_oracle(model, segments, cache, out)
        expected.append(outs[0].token_ids)
        assert all(o.token_ids == outs[0].token_ids for o in outs)
    first_logprobs = [o.logprobs[0].logprob for o in together]
    assert len({round(x, 6) for x in first_logprobs}) == 3, "the three histories must differ"
    engine.check()
