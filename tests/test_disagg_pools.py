"""Pools of prefill and decode workers (`prefill_devices=["cpu"] * N, decode_devices=["cpu"] * M`: N + M
worker processes over gloo; docs/workers.md, "Pools") against independent references, at 2:1, 1:2 and 2:2:

- random drop/reposition programs, batched with chunked prefill so prefill and decode parts share steps
  (and several requests prefill or decode at once on different workers): the colocated engine's greedy
  tokens and the walk oracle's logprobs; penalties and grammars too;
- two agents' rounds at once: each decode worker receives only the pages it lacks (a request goes back to
  the decode worker that holds its history), and the prefill workers read the previous answers' KV back
  instead of recomputing them;
- a killed member of a pool ends the requests within 5 s as `Unavailable`, every worker restarts and
  serves the same tokens;
- the placement without processes: prefill work sticks to the worker with its pages, new work goes to the
  least loaded worker, decode requests spread over the decode pool.

Each layout's engine spawns N + M children that import torch (seconds each), so one engine per layout
serves the module (at most four processes at a time)."""

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
from minakv.worker.build import load_model_by_name
from minakv.worker.coherence import Coherence
from minakv.worker.placement import Placement
from minakv.worker.split import prefill_pages, split_batch, take_prefill

SETTINGS = SMALL_STEPS
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
LAYOUTS = {"2:1": (2, 1, "tiny-gpt-oss"), "1:2": (1, 2, "tiny-minimax-m2"), "2:2": (2, 2, "tiny-minimax-m2")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    """(N, M, the oracle's model, a colocated engine, an engine with N prefill and M decode workers)."""
    n, m, preset = LAYOUTS[request.param]
    model = load_model_by_name(EngineConfig(model=preset, device="cpu"))  # what the children load too
    local = Engine(preset, **SETTINGS)
    pools = Engine(preset, prefill_devices=["cpu"] * n, decode_devices=["cpu"] * m, **SETTINGS)
    yield n, m, model, local, pools
    pids = pools.worker.pids
    pools.shutdown()
    local.shutdown()
    assert len(pids) == n + m and not any(alive(pid) for pid in pids)


# ----- parity -----
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.lists(programs(max_messages=5, max_len=9, vocab=384), min_size=3, max_size=5), seed=st.integers()
)
def test_random_programs_match_the_colocated_engine_and_the_walk(layout, batch, seed) -> None:
    _, _, model, local, pools = layout
    batch, prompts = mixed_prompts(batch, seed)
    expected = local.generate(prompts, GREEDY)
    outs = pools.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for (segments, cache), out in zip(batch, [o for i, o in enumerate(outs) if i != 1]):
        assert_matches_oracle(model, segments, cache, out, tol=1e-4)
    pools.check()


def test_penalties_and_grammars_match_the_colocated_engine(layout) -> None:
    """A penalised request's counts move to the decode worker it is pinned to; a grammar's mask rows follow
    their sample rows into whichever worker samples them."""
    _, _, _, local, pools = layout
    assert_penalties_and_grammars_match(local, pools)


# ----- what moves between the workers, across two agents' rounds -----
def test_rounds_send_each_decode_worker_only_what_it_lacks_and_reuse_the_answers(layout) -> None:
    _, m, _, local, pools = layout
    rng = random.Random(5)
    ps = SETTINGS["page_size"]
    agents = [[[rng.randrange(1, 384) for _ in range(n)], [rng.randrange(1, 384) for _ in range(6)]]
              for n in (21, 14)]  # fmt: skip
    params = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)
    for round_ in range(3):
        prompts = []
        for history in agents:
            cache = (
                {"drop": {str(len(history) - 1): [1]}, "reposition": [len(history) - 1]}
                if round_ == 2
                else {}
            )
            prompts.append({"message_tokens": [list(x) for x in history], "cache": cache})
        before_local, before = local.stats(), pools.stats()
        expected = local.generate(prompts, params)
        outs = pools.generate(prompts, params)
        after_local, after = local.stats(), pools.stats()
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        computed = delta["prefill_tokens"]
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert computed == after_local["prefill_tokens"] - before_local["prefill_tokens"]  # the same reuse
        # the decode workers receive the pages the prefill workers computed (or re-rotated), nothing older:
        # each agent went back to the decode worker that holds its history
        repos = sum(o.usage.repos_tokens for o in outs)
        assert delta["kv_pages_to_decode"] <= -(-(computed + repos) // ps) + 2 * len(agents)
        if round_ >= 1:
            answers_and_new = sum(len(h[-2]) + len(h[-1]) for h in agents)
            assert computed < answers_and_new  # the previous answers' full pages were not recomputed ...
            assert delta["kv_pages_to_prefill"] > 0  # ... but read back from the decode workers
        if round_ == 1:  # the decode workers still hold round 1's prompts and answers
            held = sum((sum(map(len, h[:-2])) + len(h[-2])) // ps - 1 for h in agents)
            assert delta["kv_pages_decode_had"] >= held
        for history, out in zip(agents, outs):
            history += [out.token_ids, [rng.randrange(1, 384) for _ in range(5)]]  # the answer, a tool result
    if m > 1:  # both agents decoding at once: one on each decode worker
        assert len(set(pools.worker.placement.home.values())) == m
    pools.check()


# ----- faults -----
def test_a_killed_pool_member_fails_the_streams_fast_then_every_worker_serves_again(layout) -> None:
    n, m, _, local, pools = layout
    old = pools.worker.pids
    side, member = ("prefill", 1) if n > 1 and m == 1 else ("decode", 1 if n == 1 else 0)
    victim = old[member if side == "prefill" else n + member]
    streams = kill_while_decoding(pools, victim)
    for outs in streams:
        error = outs[-1].error
        assert f"the {side} worker {member} process (pid {victim}" in error
        assert f"restarting the workers ({n} prefill and {m} decode: the KV of all is lost)" in error
    assert_recovered(pools, local, old, GREEDY)


# ----- settings -----
def test_pool_devices_are_workers_of_world_ranks() -> None:
    config = EngineConfig(prefill_devices=["cpu"] * 2, decode_devices=["cpu"] * 3)
    assert config.pool_devices(config.prefill_devices) == [["cpu"], ["cpu"]]
    config = EngineConfig(tensor_parallel_size=2, prefill_devices=["cpu"] * 4, decode_devices=["cpu"])
    config.check()
    assert config.pool_devices(config.prefill_devices) == [["cpu", "cpu"]] * 2
    assert config.pool_devices(config.decode_devices) == [["cpu", "cpu"]]
    with pytest.raises(ValueError, match="2 per worker of a pool"):
        EngineConfig(tensor_parallel_size=2, prefill_devices=["cpu"] * 3, decode_devices=["cpu"]).check()
    with pytest.raises(ValueError, match="ranks of one worker need distinct GPUs"):
        EngineConfig(tensor_parallel_size=2, prefill_devices=["cuda:0", "cuda:1", "cuda:2", "cuda:2"],
                     decode_devices=["cuda:3", "cuda:4"]).check()  # fmt: skip


# ----- the placement, without processes -----
def test_prefill_sticks_to_its_pages_and_decodes_spread_over_the_pool() -> None:
    engine = Engine("tiny-minimax-m2", **{**SETTINGS, "max_num_batched_tokens": 40})
    ps = SETTINGS["page_size"]
    table = Coherence(engine.scheduler.kv.num_pages, 4)  # prefill workers 0 and 1, decode workers 2 and 3
    engine.scheduler.on_allocate = table.fresh
    place = Placement([0, 1], [2, 3])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a, b = engine._make([1] * 30, params), engine._make([2] * 30, params)
    engine.scheduler.add(a)
    engine.scheduler.add(b)

    def run_prefill(batch) -> list[list[int]]:
        """Place the step's prefill part, plan its transfers; the pieces each prefill worker got."""
        prefill, _ = split_batch(batch)
        cut = place.place_prefill(prefill, table, ps)
        used = [prefill_pages(take_prefill(prefill, p, c)[0], ps) for p, c in cut]
        empty = np.zeros(0, dtype=np.int64)
        table.plan([r for r, _ in used] + [empty, empty], [w for _, w in used] + [empty, empty])
        return [p for p, _ in cut]

    # step 1: a's 30 tokens and b's first 10; nobody holds anything yet: the least loaded worker
    assert run_prefill(engine.scheduler.schedule()) == [[0], [1]]
    # step 2: b's last 20 tokens read its first 10, which only prefill worker 1 holds: they stay there
    batch = engine.scheduler.schedule()
    assert run_prefill(batch) == [[], [0]]
    _, decode = split_batch(batch)  # a decodes: the first of the decode pool (both idle, both lack it all)
    assert place.place_decodes(decode, table, ps) == [[0], []] and place.home == {a.row: 0}
    _, decode = split_batch(engine.scheduler.schedule())  # b decodes too: on the idle decode worker
    assert place.place_decodes(decode, table, ps) == [[0], [1]] and place.home == {a.row: 0, b.row: 1}
    engine.shutdown()
