"""A plan resumed from an earlier request's snapshot (minakv/cache/plan_memo.py) equals the plan made from
scratch: every column, block, segment's outside keys, the final keys, the digest and the page keys."""

from __future__ import annotations

import numpy as np
from helpers.programs import programs
from hypothesis import given, settings
from hypothesis import strategies as st

from minakv.cache.keys import page_keys
from minakv.cache.plan import Plan, plan_request
from minakv.cache.plan_memo import ENTRY_BYTES, PlanMemo, own_bytes
from minakv.cache.program import compile_program
from minakv.cache.validate import CacheOpError


def assert_same(resumed: Plan, fresh: Plan, page_size: int) -> None:
    for name in ("token", "position", "segment", "source", "records", "final_keys"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(fresh, name), err_msg=name)
    assert resumed.blocks == fresh.blocks
    assert len(resumed.segment_keys) == len(fresh.segment_keys)
    for a, b in zip(resumed.segment_keys, fresh.segment_keys):
        np.testing.assert_array_equal(a, b)
    assert resumed.segment_start == fresh.segment_start
    assert (resumed.last_entry, resumed.final_digest) == (fresh.last_entry, fresh.final_digest)
    assert (resumed.num_skipped, resumed.num_copies) == (fresh.num_skipped, fresh.num_copies)
    assert resumed.keys == page_keys(fresh.records, page_size)


def rounds_of(segments: list[list[int]], cache: dict, m: int) -> tuple[list[int], list[int], dict, list]:
    """The request of an agent's round that has sent the first m messages, with the operations so far."""
    drop = {t: ids for t, ids in cache["drop"].items() if int(t) < m}
    reposition = [i for i in cache["reposition"] if i < m]
    owners = [i for i, s in enumerate(segments[:m]) for _ in s]
    return owners, [t for s in segments[:m] for t in s], drop, reposition


@settings(max_examples=150, deadline=None)
@given(programs(max_messages=8, max_len=7), st.sampled_from([1, 2, 4]), st.integers(0, 2))
def test_resumed_plans_equal_fresh_ones(case, page_size: int, generated: int) -> None:
    segments, cache = case
    memo = PlanMemo(page_size)
    for m in range(1, len(segments) + 1):  # the rounds of one agent, then the same requests again
        owners, ids, drop, reposition = rounds_of(segments, cache, m)
        try:
            program = compile_program(owners, m, drop, reposition)
        except CacheOpError:
            continue
        ids = ids + list(range(generated))  # a preempted request replans with its output
        assert_same(plan_request(program, ids, memo), plan_request(program, ids), page_size)


def agent_round(
    r: int, keep: int = 2, tool: int = 12, seed: int = 7
) -> tuple[list[int], list[int], dict, list[int]]:
    """bench/agent_replay.py's kv_drop round r in miniature: tool result j drops tool result j - keep
    and repositions."""
    lengths = [5, 3] + [4, tool] * r
    owners = [i for i, n in enumerate(lengths) for _ in range(n)]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 500, len(owners)).tolist()
    drop = {str(3 + 2 * j): [3 + 2 * (j - keep)] for j in range(keep, r)}
    return owners, ids, drop, [3 + 2 * j for j in range(keep, r)]


def test_an_agents_next_round_resumes_at_its_last_cut() -> None:
    memo = PlanMemo(page_size=4)
    previous = None
    for r in range(1, 9):
        owners, ids, drop, reposition = agent_round(r)
        program = compile_program(owners, len(set(owners)), drop, reposition)
        before = memo.hits
        resumed = plan_request(program, ids, memo)
        assert_same(resumed, plan_request(program, ids), 4)
        if r > 3:  # rounds with operations: round r resumes where round r - 1 stopped ...
            assert memo.hits == before + 1
            # ... and appends to its entry columns in place (round r - 1 ended at its cut): no copy of the
            # history, unless the columns ran out of room and doubled
            grew = len(resumed.token.base) > len(previous.token.base)
            assert np.shares_memory(resumed.records, previous.records) or grew
        previous = resumed
    # another agent's history (other tokens) shares nothing
    owners, ids, drop, reposition = agent_round(8)
    other = [t + 1 for t in ids]
    before = memo.hits
    program = compile_program(owners, len(set(owners)), drop, reposition)
    assert_same(plan_request(program, other, memo), plan_request(program, other), 4)
    assert memo.hits == before


def held_bytes(memo: PlanMemo) -> int:
    """Recount from scratch: each distinct set of columns once, at its capacity, plus each snapshot's own."""
    columns = {id(s.columns): s.columns.capacity for s in memo.snapshots.values()}
    return ENTRY_BYTES * sum(columns.values()) + sum(own_bytes(s) for s in memo.snapshots.values())


def test_the_memo_holds_a_bounded_number_of_bytes() -> None:
    memo = PlanMemo(page_size=4, max_bytes=40_000)
    for r in range(4, 12):
        owners, ids, drop, reposition = agent_round(r)
        plan_request(compile_program(owners, len(set(owners)), drop, reposition), ids, memo)
        assert memo.bytes == held_bytes(memo) <= 40_000


def test_many_agents_keep_hitting_the_memo() -> None:
    """Agents interleaving their rounds share nothing, but each agent's snapshots share one set of columns,
    counted once: at a budget of a few of their histories, every agent's every round resumes."""
    memo = PlanMemo(page_size=4, max_bytes=4_000_000)
    for r in range(4, 14):
        for seed in range(6):
            owners, ids, drop, reposition = agent_round(r, seed=seed)
            before = memo.hits
            plan_request(compile_program(owners, len(set(owners)), drop, reposition), ids, memo)
            assert memo.hits == before + 1 or r == 4
    assert memo.bytes == held_bytes(memo)
