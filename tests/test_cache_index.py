"""The page pool, the engine's page keys and the index of cached pages (acceptance 2 for keys, acceptance 3).

Keys are formed as the scheduler forms them: plan the request's entries (minakv/cache/plan.py), chain their
records page by page (minakv/cache/keys.py), pages the first generated token does not read are dead.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.programs import plan_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv.cache.index import PageIndex
from minakv.cache.keys import page_keys, record
from minakv.cache.plan import Entry
from minakv.cache.pool import PagePool, PoolError, PoolExhausted
from minakv.cache.program import compile_program

# -- the pool --------------------------------------------------------------------------------------------


def test_pool_allocate_incref_decref_check():
    pool = PagePool(4, page_size=3)
    a = pool.allocate(2)
    pool.check([a])
    pool.incref(a[:1])
    pool.check([a, a[:1]])
    assert pool.decref(a) == [a[1]]  # a[0] still has a holder
    pool.check([a[:1]])
    assert pool.num_free == 3 and pool.num_used == 1
    assert pool.slots([a[0]]).tolist() == [3 * a[0], 3 * a[0] + 1, 3 * a[0] + 2]
    with pytest.raises(PoolExhausted, match="need 4 pages, 3 free"):
        pool.allocate(4)
    with pytest.raises(PoolError, match="decref of free page"):
        pool.decref([a[1]])
    with pytest.raises(PoolError, match="has refcount 1 but 0 holders"):
        pool.check([])


def test_pool_check_sees_a_leak_and_a_double_free():
    pool = PagePool(3, page_size=1)
    pages = pool.allocate(2)
    pool.refcount[pages[0]] = 0  # freed behind the pool's back, never returned: a leak
    with pytest.raises(PoolError, match=r"free 1 \+ used 1 != total 3"):
        pool.check([pages[1:]])
    pool.refcount[pages[0]] = 1
    pool.free.append(pages[0])  # a page both free and referenced
    with pytest.raises(PoolError, match="is free with refcount 1"):
        pool.check([pages])


# -- keys (docs/design.md 2.5 is in test_cache_oracle.py) -------------------------------------------------------

OWNERS = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
IDS = list(range(100, 116))


def keys_of(drop=None, reposition=None, owners=OWNERS, ids=IDS, page_size=4, n=4):
    return plan_keys(compile_program(owners, n, drop, reposition), ids, page_size)[1]


def test_same_text_other_history_never_matches():
    plain, dropped = keys_of(), keys_of({"1": [0]})
    assert [k.key for k in plain[:2]] == [k.key for k in dropped[:2]]  # the drop comes after message 1
    assert all(a.key != b.key for a, b in zip(plain[2:], dropped[2:]))
    other_start = keys_of(ids=[0] * 4 + IDS[4:])  # other tokens in message 0: same text after, other KV
    assert all(a.key != b.key for a, b in zip(plain, other_start))
    index = PageIndex(PagePool(8, 4))
    pages = index.pool.allocate(4)
    index.insert(plain, pages)
    assert index.match(dropped) == [pages[0], pages[1], None, None]


def test_noop_reposition_is_no_new_version():
    assert keys_of(None, [0, 1]) == keys_of()
    assert keys_of({"1": [0]}, [1]) != keys_of({"1": [0]})  # after a drop it moves keys: a new version


def test_reposition_copies_are_pages_of_their_own():
    # Request 1: messages 0-3, drop 1 after 2. Request 2 repeats that and repositions after 2: message 2's
    # keys move from 8..11 to 4..7 in copies (entries 12..15), and message 3 is born after them.
    first = keys_of({"2": [1]})
    second = keys_of({"2": [1]}, [2])
    assert len(first) == 4 and len(second) == 5
    index = PageIndex(PagePool(16, 4))
    pages = index.pool.allocate(4)
    index.insert(first, pages)
    assert index.match(second) == pages[:3] + [None, None]  # up to the reposition: the same KV
    # message 1 is dropped, and message 2's born entries are read by nobody after the copies
    assert [k.dropped for k in second] == [False, True, True, False, False]
    index.insert(second[3:], index.pool.allocate(2))
    assert None not in index.match(keys_of({"2": [1]}, [2]))  # the repositioned version is cached too


def test_page_size_one_and_odd_sizes():
    for page_size in (1, 3, 5):
        plan, keys = plan_keys(compile_program(OWNERS, 4, {"1": [0]}, [1]), IDS, page_size)
        assert len(keys) == len(plan.entries) // page_size
        assert len({k.key for k in keys}) == len(keys)
        before_drop = keys_of(page_size=page_size)[: 8 // page_size]
        assert [k.key for k in keys[: 8 // page_size]] == [k.key for k in before_drop]


def test_generated_tokens_extend_the_chain():
    program = compile_program(OWNERS, 4, {"3": [1]}, [3])  # trailing events: before the first generated token
    prompt_plan, prompt_only = plan_keys(program, IDS, 4)
    plan, with_output = plan_keys(program, IDS + [7, 8, 9, 10], 4)
    assert len(prompt_only) == 6 and with_output[:6] == prompt_only  # 16 born + 8 copies, then the output
    assert [e.position for e in plan.entries[24:]] == [12, 13, 14, 15]
    # the scheduler's decode entries (records after the final events) make the same key as a re-plan
    decoded = np.concatenate(
        [
            prompt_plan.records,
            [
                record(prompt_plan.final_digest, token, Entry(16 + j, 12 + j))
                for j, token in enumerate([7, 8, 9, 10])
            ],
        ]
    )
    assert page_keys(decoded, 4)[6].key == with_output[6].key
    other = plan_keys(compile_program(OWNERS, 4), IDS + [7, 8, 9, 10], 4)[1]
    assert other[4].key != with_output[6].key  # the trailing events are part of its history


# -- the index: eviction and holes --------------------------------------------------------------------------


def test_eviction_takes_dropped_only_pages_first():
    keys = keys_of({"2": [0, 1]})  # pages 0 and 1 hold only dropped tokens
    index = PageIndex(PagePool(6, 4))
    pages = index.pool.allocate(4)
    index.insert(keys, pages)
    index.pool.decref(pages)  # the request ends: only the index holds them
    index.match(keys[:2])  # touched most recently, yet dropped-only
    assert sorted(index.evict(2)) == sorted(pages[:2])
    assert index.evict(1) == [pages[2]]  # then least recently used


def test_evicted_span_leaves_a_hole():
    keys = keys_of({"2": [1]})
    index = PageIndex(PagePool(6, 4))
    pages = index.pool.allocate(4)
    index.insert(keys, pages)
    index.pool.decref(pages)
    assert index.evict(1) == [pages[1]]  # message 1's page: dropped
    longer = keys_of({"2": [1]}, owners=OWNERS + [4] * 4, ids=IDS + [1, 2, 3, 4], n=5)
    assert index.match(longer) == [pages[0], None, pages[2], pages[3], None]  # the history after the hole


def test_referenced_pages_are_never_evicted():
    keys = keys_of()
    index = PageIndex(PagePool(4, 4))
    pages = index.pool.allocate(4)
    index.insert(keys, pages)  # the request still holds them
    assert index.evict(4) == []
    index.pool.decref(pages[:2])
    assert sorted(index.evict(4)) == sorted(pages[:2])
    index.pool.check([pages[2:], index.held_pages()])


def test_duplicate_insert_keeps_the_first_page():
    keys = keys_of()[:1]
    index = PageIndex(PagePool(4, 4))
    first, second = index.pool.allocate(1), index.pool.allocate(1)
    assert index.insert(keys, first) == [True]
    assert index.insert(keys, second) == [False]
    with pytest.raises(PoolError, match="already indexed"):
        index.insert(keys_of({"1": [0]})[2:3], first)
    index.pool.check([first, second, index.held_pages()])


# -- random sequences of operations (acceptance 3) ----------------------------------------------------------


def random_request(rng: random.Random):
    n = rng.randint(1, 5)
    owners = [m for m in range(n) for _ in range(rng.randint(1, 5))]
    ids = [rng.randrange(3) for _ in owners]  # a tiny vocabulary: lots of shared text
    drop = {}
    if n > 1 and rng.random() < 0.6:
        trigger = rng.randrange(1, n)
        drop[str(trigger)] = rng.sample(range(trigger), rng.randint(1, trigger))
    reposition = sorted(rng.sample(range(n), rng.randint(0, min(2, n))))
    try:
        program = compile_program(owners, n, drop, reposition)
    except ValueError:
        program = compile_program(owners, n)
    return program, ids


def run_random_operations(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 16])
    pool = PagePool(rng.randint(4, 24), page_size)
    index = PageIndex(pool)
    running: list[list[int]] = []  # page tables of live requests
    for _ in range(steps):
        op = rng.random()
        if op < 0.5:  # a request arrives: match, take what it can, allocate the rest, maybe publish
            program, ids = random_request(rng)
            keys = plan_keys(program, ids, page_size)[1]
            matches = index.match(keys)
            pool.incref([p for p in matches if p is not None])  # hold what matched before anything is evicted
            table = []
            for i, match in enumerate(matches):
                if match is not None:
                    table.append(match)
                    continue
                if pool.num_free == 0:
                    evicted = index.evict(1)
                    assert all(pool.refcount[p] == 0 for p in evicted)
                if pool.num_free == 0:  # no memory: the scheduler would preempt; here the request stops
                    pool.decref([p for p in matches[i + 1 :] if p is not None])
                    break
                table.extend(pool.allocate(1))
            assert len(set(table)) == len(table)
            if rng.random() < 0.7:
                index.insert(keys[: len(table)], table)
            running.append(table)
        elif op < 0.8 and running:  # a request finishes
            table = running.pop(rng.randrange(len(running)))
            freed = pool.decref(table)
            assert not any(p in index.by_page for p in freed)  # an indexed page is never freed
        else:  # memory pressure
            candidates = {e.page: e.dropped for e in index.by_page.values() if pool.refcount[e.page] == 1}
            evicted = index.evict(rng.randint(1, 3))
            assert set(evicted) <= set(candidates)  # nobody else held them
            assert not {p for t in running for p in t} & set(evicted)
            if any(not candidates[p] for p in evicted):  # a live page went: no dropped-only one was left
                assert all(not dropped for p, dropped in candidates.items() if p not in evicted)
        pool.check([*running, index.held_pages()])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_random_operations_keep_the_pool_consistent(seed):
    run_random_operations(seed, steps=40)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_random_operations_keep_the_pool_consistent_many(seed):
    run_random_operations(seed, steps=200)


def test_eviction_order_under_random_inserts():
    """Whatever was inserted, evicting one page at a time yields all dropped-only pages first, each
    group in LRU order."""
    rng = random.Random(7)
    pool = PagePool(64, 2)
    index = PageIndex(pool)
    for _ in range(12):
        program, ids = random_request(rng)
        keys = plan_keys(program, ids, 2)[1]
        fresh = [k for k in keys if k.key not in index.by_key]
        pages = pool.allocate(min(len(fresh), pool.num_free))
        index.insert(fresh[: len(pages)], pages)
        pool.decref(pages)
    order = []
    while True:
        expected = min(((not e.dropped, e.last_used, e.page) for e in index.by_page.values()), default=None)
        evicted = index.evict(1)
        if not evicted:
            break
        assert evicted[0] == expected[2]
        order.append(expected[0])
    assert order == sorted(order) and len(order) > 0 and order[0] is False
    pool.check([index.held_pages()])
