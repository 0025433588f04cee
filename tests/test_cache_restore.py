"""The plan of a request (minakv/cache/plan.py) and restoring from a partial cache (acceptance 4).

The plan is checked against the literal walk: every entry a computed query reads is there at the walk's
position, and `entries_to_compute` is exactly the dependency closure, found by brute force over the walk's
reads. Executing a restore pass (the plan's segments, as the dense SegmentContext reference runs them) on a
tiny model reproduces the walk oracle's K/V and logits. tests/test_engine_walk.py restores through the
engine itself; the SegmentContext tests at the end check the reference's own segments against the oracle.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers.models import ARCHS, tiny_model
from helpers.programs import WalkError, plan_keys, requests, walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv.cache.index import PageIndex
from minakv.cache.plan import Plan, entries_to_compute, needed_tokens, plan_request
from minakv.cache.pool import PagePool
from minakv.cache.program import NEVER, compile_program
from minakv.ops.rope import apply_rope, rerotate
from minakv.reference.oracle import WalkOracle
from minakv.reference.segments import Segment, SegmentContext, StoredKV, segments

# -- the plan against the walk ------------------------------------------------------------------------------


def entry_at(plan: Plan) -> dict[tuple[int, int], int]:
    """(token, position) -> the entry holding that token's key at that position (one each)."""
    at = {(e.token_index, e.position): i for i, e in enumerate(plan.entries)}
    assert len(at) == len(plan.entries)
    return at


def brute_closure(plan: Plan, seen: list[dict[int, int]], have: list[bool]) -> list[int]:
    """Least fixed point over the walk: the last token's entry and the entries the first decode query
    reads, plus every entry a computed entry reads (a born entry: everything its query sees in the walk;
    a copy: its source). Returns the entries to compute (those not in `have`)."""
    at = entry_at(plan)
    length = len(seen) - 1  # seen[length] is the first decode query
    needed = {plan.last_entry} | {at[t, p] for t, p in seen[length].items() if t != length}
    todo = list(needed)
    while todo:
        e = todo.pop()
        if have[e]:
            continue
        entry = plan.entries[e]
        q = entry.token_index
        reads = [entry.source] if entry.is_copy else [at[t, p] for t, p in seen[q].items() if t != q]
        for r in reads:
            if r not in needed:
                needed.add(r)
                todo.append(r)
    return sorted(e for e in needed if not have[e])


def check_plan(owners, num_messages, drop, reposition, generated, have_bits):
    try:
        seen, _, _, history, _ = walk(owners, num_messages, drop, reposition, generated + 1)
    except WalkError:
        return
    program = compile_program(owners, num_messages, drop, reposition)
    length = len(owners) + generated  # a request re-planned after generating `generated` tokens
    if length == 0:
        return
    plan = plan_request(program, list(range(length)))
    at = entry_at(plan)
    # Each computed query sees its segment's outside keys and the earlier members of its segment: exactly
    # what the walk says it sees, at the walk's positions.
    members: dict[int, list[int]] = {}
    for e, entry in enumerate(plan.entries):
        if entry.is_copy:
            continue
        q = entry.token_index
        members.setdefault(entry.segment, []).append(e)
        visible = [*plan.segment_keys[entry.segment], *members[entry.segment]]
        got = {plan.entries[k].token_index: plan.entries[k].position for k in visible}
        assert got == seen[q], q
    # A token's entries follow its positions in the walk (a copy only where a reposition moves it).
    for t in {e.token_index for e in plan.entries}:
        positions = [e.position for e in plan.entries if e.token_index == t]
        assert positions == [p for i, p in enumerate(history[t]) if i == 0 or p != history[t][i - 1]], t
    assert (
        plan.entries[plan.last_entry].token_index == length - 1 and not plan.entries[plan.last_entry].is_copy
    )
    assert sorted(plan.final_keys) == sorted(at[t, p] for t, p in seen[length].items() if t != length)
    # Restoring: compute exactly the closure of what is missing.
    have = [have_bits[e % len(have_bits)] for e in range(len(plan.entries))]
    assert entries_to_compute(plan, have).tolist() == brute_closure(plan, seen, have)
    assert entries_to_compute(plan, [False] * len(have)).tolist() == brute_closure(
        plan, seen, [False] * len(have)
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.booleans(), min_size=1, max_size=7))
def test_plan_is_the_dependency_closure(request, have_bits):
    owners, num_messages, drop, reposition, generated, _ = request
    check_plan(owners, num_messages, drop, reposition, generated, have_bits)


@pytest.mark.slow
@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.booleans(), min_size=1, max_size=7))
def test_plan_is_the_dependency_closure_many(request, have_bits):
    owners, num_messages, drop, reposition, generated, _ = request
    check_plan(owners, num_messages, drop, reposition, generated, have_bits)


def test_dropped_and_unread_is_not_recomputed():
    # Message 0 is dropped after message 1; everything of message 1 is cached, so nothing reads 0 again.
    plan = plan_request(compile_program([0, 0, 1, 1, 2, 2], 3, {1: [0]}), [1, 2, 3, 4, 5, 6])
    assert [e.token_index for e in plan.entries] == [0, 1, 2, 3, 4, 5]
    have = [False, False, True, True, True, False]
    assert entries_to_compute(plan, have).tolist() == [5]
    assert plan.segment_keys[plan.entries[5].segment].tolist() == [
        2,
        3,
    ]  # 4 is an earlier member of 5's segment
    # if token 3 is missing too, its query reads 0 and 1: they come back
    have[3] = False
    assert entries_to_compute(plan, have).tolist() == [0, 1, 3, 5]


def test_unread_tokens_get_no_entry():
    # Message 0 is dropped right after it: no query that runs reads it (token 1 reads token 0, but nothing
    # reads token 1), so it is never computed.
    plan = plan_request(compile_program([0, 0, 1, 1], 2, {0: [0]}), [1, 2, 3, 4])
    assert [e.token_index for e in plan.entries] == [2, 3] and plan.num_skipped == 2


# -- executing a restore pass on tiny models -------------------------------------------------------------


def random_case(rng: random.Random):
    n = rng.randint(2, 5)
    lengths = [rng.randint(1, 4) for _ in range(n)]
    owners = [m for m, k in enumerate(lengths) for _ in range(k)] + [n] * rng.randint(0, 2)
    drop = {}
    for trigger in rng.sample(range(n), rng.randint(0, 2)):
        drop[str(trigger)] = rng.sample(range(trigger + 1), rng.randint(1, trigger + 1))
    reposition = sorted(rng.sample(range(n), rng.randint(0, 2)))
    return owners, n, drop, reposition


def stored_from_oracle(oracle, model, tokens, positions):
    """Cached KV as the pool would hold it: each key rotated at some stored position."""
    k, v = {}, {}
    for layer in model.attention_layers:
        raw_k, raw_v = oracle.raw_kv(layer.index, tokens)
        k[layer.index] = apply_rope(raw_k, *layer.rope.cos_sin(torch.as_tensor(positions)))
        v[layer.index] = raw_v
    return StoredKV(np.asarray(tokens, dtype=np.int64), np.asarray(positions, dtype=np.int64), k, v)


def pass_segments(plan: Plan, todo: list[int]) -> list[Segment]:
    """The restore pass of `todo` as reference segments: per plan segment, its computed born entries are
    the queries; the keys are its outside keys and its cached members (attention is causal by position,
    so a query sees only the members before it). A copy is no query: its key is the token's, re-rotated."""
    out = []
    for g, outside in enumerate(plan.segment_keys):
        queries = [e for e in todo if plan.entries[e].segment == g and not plan.entries[e].is_copy]
        if not queries:
            continue
        cached = [e for e, x in enumerate(plan.entries) if x.segment == g and not x.is_copy and e not in todo]
        keys = [*outside, *(e for e in cached if e < queries[-1])]
        tokens = [plan.entries[e].token_index for e in queries]
        out.append(Segment(
            np.asarray(tokens, dtype=np.int64), np.asarray([plan.entries[e].position for e in queries]),
            np.asarray([plan.entries[k].token_index for k in keys], dtype=np.int64),
            np.asarray([plan.entries[k].position for k in keys], dtype=np.int64),
        ))  # fmt: skip
    return out


def run_pass(model, oracle, plan, todo, cached_tokens, stored_at):
    """Run the pass; SegmentContext raises KeyError if a key is neither cached nor computed in it."""
    segs = pass_segments(plan, todo)
    stored = stored_from_oracle(oracle, model, cached_tokens, stored_at) if len(cached_tokens) else None
    ctx = SegmentContext(segs, stored)
    queries = np.concatenate([s.queries for s in segs]) if segs else np.zeros(0, dtype=np.int64)
    return ctx, queries


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [(arch, dtype) for arch in ARCHS for dtype in (torch.float32, torch.float64)]
    + [("gpt_oss_all_sliding", torch.float64)],
)
def test_restore_pass_reproduces_the_oracle(arch, dtype):
    windows = [3, 5, 3] if arch == "gpt_oss_all_sliding" else None
    model = tiny_model(arch.removesuffix("_all_sliding"), dtype, small=True, windows=windows)
    tol = 1e-5 if dtype == torch.float64 else 2e-4  # stored keys are re-rotated in fp32
    rng = random.Random(f"{arch}{dtype}")
    checked = 0
    while checked < 8:
        owners, n, drop, reposition = random_case(rng)
        try:
            program = compile_program(owners, n, drop, reposition)
        except ValueError:
            continue
        ids = [rng.randrange(64) for _ in owners]
        oracle = WalkOracle(model, program)
        run = oracle.run(ids, max_new_tokens=2)
        tokens = ids + run.generated
        plan = plan_request(program, tokens)  # as after a preemption: the output is part of the plan
        have = [rng.random() < 0.5 for _ in plan.entries]
        todo = entries_to_compute(plan, have).tolist()
        cached = sorted({plan.entries[e].token_index for e in range(len(have)) if have[e]})
        stored_at = [rng.randrange(200) for _ in cached]  # anywhere: the pass re-rotates them
        ctx, queries = run_pass(model, oracle, plan, todo, cached, stored_at)
        if not len(queries):
            continue
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor([tokens[t] for t in queries]), ctx))
        torch.testing.assert_close(logits, run.logits[queries], rtol=0, atol=tol)
        for layer in range(len(model.layers)):
            raw_k, raw_v = oracle.raw_kv(layer, queries)
            torch.testing.assert_close(ctx.k[layer], raw_k, rtol=0, atol=tol)
            torch.testing.assert_close(ctx.v[layer], raw_v, rtol=0, atol=tol)
        checked += 1


def test_second_round_shares_pages_steps_over_an_evicted_dropped_page_and_copies():
    """The whole flow through the index: round 1 is cached page by page; its dropped-only page is evicted
    first; round 2 repeats the drop, adds a reposition and a message: it shares every cached page, steps
    over the hole, and computes only the reposition's copies (from cached keys) and its new message, equal
    to the oracle."""
    model = tiny_model("minimax_m2", small=True)
    page = 4
    owners1, ids1 = [m for m in range(4) for _ in range(page)], [(5 * i + 2) % 64 for i in range(16)]
    round1 = compile_program(owners1, 4, {"2": [1]})
    oracle1 = WalkOracle(model, round1)
    oracle1.run(ids1)
    index = PageIndex(PagePool(8, page))
    keys1 = plan_keys(round1, ids1, page)[1]
    pages = index.pool.allocate(len(keys1))
    index.insert(keys1, pages)
    index.pool.decref(pages)  # round 1 ends
    assert index.evict(1) == [pages[1]]  # message 1: dropped, nobody reads it again

    owners2, ids2 = owners1 + [4] * page, ids1 + [9, 8, 7, 6]
    round2 = compile_program(owners2, 5, {"2": [1]}, [3])
    plan, keys2 = plan_keys(round2, ids2, page)
    matches = index.match(keys2)
    assert matches == [pages[0], None, pages[2], pages[3], None, None, None]  # copies: entries 16..23
    have = [
        matches[e // page] is not None if e // page < len(matches) else False
        for e in range(len(plan.entries))
    ]
    todo = entries_to_compute(plan, have).tolist()
    assert [plan.entries[e].is_copy for e in todo] == [True] * 8 + [False] * 4
    assert [plan.entries[e].token_index for e in todo[8:]] == [16, 17, 18, 19]

    # The cached pages as the pool would hold them: round 1's keys at their birth positions.
    cached = [t for i, m in enumerate(matches[:4]) if m is not None for t in range(i * page, (i + 1) * page)]
    ctx, queries = run_pass(model, oracle1, plan, todo, cached, round1.birth_positions(cached))
    assert queries.tolist() == [16, 17, 18, 19]
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids2[16:]), ctx))
    run2 = WalkOracle(model, round2).run(ids2)
    torch.testing.assert_close(logits, run2.logits[16:], rtol=0, atol=1e-5)


# -- the reference's own segments -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_through_segments(arch):
    """The whole request through SegmentContext chunk by chunk (stored KV between chunks at final
    positions), then decode steps: equal to the oracle."""
    model = tiny_model(arch, small=True)
    owners = [0] * 3 + [1] * 4 + [2] * 3 + [3] * 4 + [4] * 2
    program = compile_program(owners, 5, {"1": [0], "3": [1, 2]}, [1, 3])
    ids = [(7 * i + 3) % 64 for i in range(len(owners))]
    oracle = WalkOracle(model, program)
    run = oracle.run(ids, max_new_tokens=3)
    tokens = ids + run.generated
    stored = None
    for a, b in [(0, 5), (5, 11), (11, 16), (16, 17), (17, 18)]:
        ctx = SegmentContext(segments(program, a, b), stored)
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(tokens[a:b]), ctx))
        torch.testing.assert_close(logits, run.logits[a:b], rtol=0, atol=1e-5)
        new = ctx.to_stored(model.attention_layers, program.birth_positions(np.arange(a, b)))
        stored = new if stored is None else merge(stored, new)
    final = program.final_active.tolist() + [16, 17]
    for layer in range(len(model.layers)):  # the stored KV, moved to final positions, is the oracle's
        k, v = oracle.kv(layer, final)
        rows = stored.rows(np.asarray(final))
        torch.testing.assert_close(stored.v[layer][rows], v, rtol=0, atol=1e-6)
        old = model.rope.cos_sin(torch.as_tensor(stored.positions[rows]))
        new = model.rope.cos_sin(torch.as_tensor([oracle.position[t] for t in final]))
        torch.testing.assert_close(rerotate(stored.k[layer][rows], old, new), k, rtol=0, atol=1e-5)


def merge(a: StoredKV, b: StoredKV) -> StoredKV:
    return StoredKV(
        np.concatenate([a.tokens, b.tokens]),
        np.concatenate([a.positions, b.positions]),
        {i: torch.cat([a.k[i], b.k[i]]) for i in a.k},
        {i: torch.cat([a.v[i], b.v[i]]) for i in a.v},
    )


def test_two_sequences_in_one_batch():
    model = tiny_model("gpt_oss", small=True)
    p1 = compile_program([0, 0, 1, 1, 1], 2, {"0": [0]})
    p2 = compile_program([0, 0, 0, 1], 2, None, [])
    ids1, ids2 = [1, 2, 3, 4, 5], [9, 8, 7, 6]
    r1 = WalkOracle(model, p1).run(ids1)
    r2 = WalkOracle(model, p2).run(ids2)
    segs1, segs2 = segments(p1, 0, 5), segments(p2, 0, 4)
    ctx = SegmentContext(segs1 + segs2, seq_ids=[1] * len(segs1) + [2] * len(segs2))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids1 + ids2), ctx))
    torch.testing.assert_close(logits, torch.cat([r1.logits, r2.logits]), rtol=0, atol=1e-6)
    assert ctx.tokens(2).tolist() == [0, 1, 2, 3]


def scan_needed(program, n: int) -> list[bool]:
    """The definition, one token at a time from the end: t is needed if it is the last token, active at the
    end, or read by a needed query q with t < q < visible_until[t]."""
    until = program.drop_points(np.arange(n)).tolist()
    needed, nearest = [False] * n, NEVER
    for t in range(n - 1, -1, -1):
        if t == n - 1 or until[t] == NEVER or nearest < until[t]:
            needed[t], nearest = True, t
    return needed


def test_needed_tokens_by_runs_is_the_token_scan():
    rng = random.Random(0)
    checked = 0
    while checked < 400:
        m = rng.randint(1, 9)
        lengths = [rng.randint(0, 4) for _ in range(m)]
        owners = [i for i, n in enumerate(lengths) for _ in range(n)]
        drop = {
            str(t): sorted(rng.sample(range(t + 1), rng.randint(1, t + 1)))
            for t in range(m)
            if rng.random() < 0.4
        }
        try:
            program = compile_program(
                owners, m, drop, sorted(rng.sample(range(m), rng.randint(0, min(2, m))))
            )
        except ValueError:
            continue
        if not owners:
            continue
        n = len(owners) + rng.randint(0, 3)  # generated tokens too
        assert needed_tokens(program, n).tolist() == scan_needed(program, n), (lengths, drop)
        checked += 1
