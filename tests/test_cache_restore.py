"""Restore planning and the one-pass segment executor (acceptance 4).

The plan is checked against a brute-force dependency closure built from the literal walk; executing it
with SegmentContext on a tiny model must reproduce the walk oracle's K/V and logits.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache_oracle import ARCHS, one_thread, tiny_model  # noqa: F401 (an autouse fixture)
from test_cache_program import WalkError, requests, walk

from minakv.cache.index import PageIndex
from minakv.cache.keys import page_keys
from minakv.cache.pool import PagePool
from minakv.cache.program import compile_program
from minakv.cache.restore import cached_tokens, plan_restore
from minakv.ops.rope import apply_rope, rerotate
from minakv.reference.oracle import WalkOracle
from minakv.reference.segments import SegmentContext, StoredKV


def reads(seen, q, t, window):
    """Does query q read token t (the walk's view, window by position)?"""
    return t in seen[q] and t != q and (window is None or seen[q][q] - seen[q][t] < window)


def brute_closure(seen, length, have, want, window):
    """Least fixed point: required queries, plus every missing token read by a recomputed query or by
    the next token (index `length`, the first decode query)."""
    needed = set(want)
    changed = True
    while changed:
        changed = False
        for t in range(length):
            if t in needed or have[t]:
                continue
            if any(reads(seen, q, t, window) for q in [*needed, length]):
                needed.add(t)
                changed = True
    return needed


def check_plan(owners, num_messages, drop, reposition, generated, window, have_bits, want_last):
    try:
        seen = walk(owners, num_messages, drop, reposition, generated + 1)[0]
    except WalkError:
        return
    program = compile_program(owners, num_messages, drop, reposition)
    length = len(owners) + generated
    if length == 0:
        return
    have = np.array([have_bits[t % len(have_bits)] for t in range(length)], dtype=bool)
    want = [length - 1] if want_last else []
    plan = plan_restore(program, have, want, window)
    assert set(plan.recompute.tolist()) == brute_closure(seen, length, have, want, window)
    rows = np.concatenate([s.queries for s in plan.segments]) if plan.segments else np.zeros(0)
    assert rows.tolist() == plan.recompute.tolist()
    available = set(np.nonzero(have)[0].tolist()) | set(plan.recompute.tolist())
    for seg in plan.segments:
        for i, q in enumerate(seg.queries.tolist()):
            visible = dict(zip(seg.keys.tolist(), seg.key_positions.tolist()))
            visible.update(zip(seg.queries[: i + 1].tolist(), seg.query_positions[: i + 1].tolist()))
            assert set(visible) <= available
            # everything the walk says q reads is there, at the walk's positions
            for t in seen[q]:
                if t == q or reads(seen, q, t, window):
                    assert visible.get(t) == seen[q][t], (q, t)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.booleans(), min_size=1, max_size=7), st.booleans())
def test_plan_is_the_dependency_closure(request, have_bits, want_last):
    check_plan(*request, have_bits, want_last)


@pytest.mark.slow
@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.booleans(), min_size=1, max_size=7), st.booleans())
def test_plan_is_the_dependency_closure_many(request, have_bits, want_last):
    check_plan(*request, have_bits, want_last)


def test_dropped_and_unread_is_not_recomputed():
    # Message 0 is dropped after message 1; everything of message 1 is cached, so nothing reads 0 again.
    program = compile_program([0, 0, 1, 1, 2, 2], 3, {1: [0]})
    have = np.array([False, False, True, True, True, False])
    plan = plan_restore(program, have)
    assert plan.recompute.tolist() == [5]
    assert plan.segments[0].keys.tolist() == [2, 3, 4]
    # if token 3 is missing too, its query reads 0 and 1: they come back
    have[3] = False
    assert plan_restore(program, have).recompute.tolist() == [0, 1, 3, 5]


def test_window_limits_the_closure():
    program = compile_program([0] * 8, 1)
    have = np.array([False] * 4 + [True] * 3 + [False])
    assert plan_restore(program, have, window=3).recompute.tolist() == [7]
    assert plan_restore(program, have, window=None).recompute.tolist() == [0, 1, 2, 3, 7]
    # A reposition after dropping 4..6 brings 3 back into the window of token 9 (and 3 reads 0..2).
    owners = [0] * 4 + [1] * 3 + [2] * 2 + [3]
    have = np.array([False] * 4 + [True] * 5 + [False])
    assert plan_restore(compile_program(owners, 4, {2: [1]}), have, window=4).recompute.tolist() == [9]
    repositioned = compile_program(owners, 4, {2: [1]}, [2])
    assert plan_restore(repositioned, have, window=4).recompute.tolist() == [0, 1, 2, 3, 9]


# -- executing plans on tiny models --------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [(arch, dtype) for arch in ARCHS for dtype in (torch.float32, torch.float64)]
    + [("gpt_oss_all_sliding", torch.float64)],
)
def test_restore_pass_reproduces_the_oracle(arch, dtype):
    windows = [3, 5, 3] if arch == "gpt_oss_all_sliding" else None
    model = tiny_model(arch.removesuffix("_all_sliding"), dtype, windows)
    window = None if any(w is None for w in model.config.layer_windows) else max(model.config.layer_windows)
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
        length = len(ids) + 2
        tokens = ids + run.generated
        have = np.array([rng.random() < 0.5 for _ in range(length)])
        plan = plan_restore(program, have, window=window)
        cached = np.nonzero(have)[0]
        stored_at = [rng.randrange(200) for _ in cached]  # anywhere: the pass re-rotates them
        ctx = SegmentContext(plan.segments, stored_from_oracle(oracle, model, cached, stored_at))
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor([tokens[t] for t in plan.recompute]), ctx))
        torch.testing.assert_close(logits, run.logits[plan.recompute], rtol=0, atol=tol)
        for layer in range(len(model.layers)):
            raw_k, raw_v = oracle.raw_kv(layer, plan.recompute)
            torch.testing.assert_close(ctx.k[layer], raw_k, rtol=0, atol=tol)
            torch.testing.assert_close(ctx.v[layer], raw_v, rtol=0, atol=tol)
        checked += 1


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_through_segments(arch):
    """The whole request through SegmentContext chunk by chunk (stored KV between chunks at final
    positions), then decode steps: equal to the oracle."""
    model = tiny_model(arch)
    owners = [0] * 3 + [1] * 4 + [2] * 3 + [3] * 4 + [4] * 2
    program = compile_program(owners, 5, {"1": [0], "3": [1, 2]}, [1, 3])
    ids = [(7 * i + 3) % 64 for i in range(len(owners))]
    oracle = WalkOracle(model, program)
    run = oracle.run(ids, max_new_tokens=3)
    tokens = ids + run.generated
    stored = None
    for a, b in [(0, 5), (5, 11), (11, 16), (16, 17), (17, 18)]:
        ctx = SegmentContext(program.segments(a, b), stored)
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
    model = tiny_model("gpt_oss")
    p1 = compile_program([0, 0, 1, 1, 1], 2, {"0": [0]})
    p2 = compile_program([0, 0, 0, 1], 2, None, [])
    ids1, ids2 = [1, 2, 3, 4, 5], [9, 8, 7, 6]
    r1 = WalkOracle(model, p1).run(ids1)
    r2 = WalkOracle(model, p2).run(ids2)
    segs1, segs2 = p1.segments(0, 5), p2.segments(0, 4)
    ctx = SegmentContext(segs1 + segs2, seq_ids=[1] * len(segs1) + [2] * len(segs2))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids1 + ids2), ctx))
    torch.testing.assert_close(logits, torch.cat([r1.logits, r2.logits]), rtol=0, atol=1e-6)
    assert ctx.tokens(2).tolist() == [0, 1, 2, 3]


def test_second_round_reuses_rerotated_pages_and_skips_an_evicted_dropped_page():
    """The whole flow: round 1 is cached page by page; its dropped-only page is evicted first; round 2
    repeats the drop, adds a reposition and a message: it shares page 0, re-rotates pages 2-3, steps over
    the hole, and computes only its new message, equal to the oracle."""
    model = tiny_model("minimax_m2")
    page = 4
    owners1, ids1 = [m for m in range(4) for _ in range(page)], [(5 * i + 2) % 64 for i in range(16)]
    round1 = compile_program(owners1, 4, {"2": [1]})
    oracle1 = WalkOracle(model, round1)
    oracle1.run(ids1)
    index = PageIndex(PagePool(8, page))
    keys1 = page_keys(round1, ids1, page)
    pages = index.pool.allocate(len(keys1))
    index.insert(keys1, pages)
    index.pool.decref(pages)  # round 1 ends
    assert index.evict(1) == [pages[1]]  # message 1: dropped, nobody reads it again

    owners2, ids2 = owners1 + [4] * page, ids1 + [9, 8, 7, 6]
    round2 = compile_program(owners2, 5, {"2": [1]}, [3])
    matches = index.match(page_keys(round2, ids2, page))
    assert [m.kind if m else None for m in matches] == ["exact", None, "rerotate", "rerotate", None]
    have = cached_tokens(matches, page, len(ids2))
    plan = plan_restore(round2, have)
    assert plan.recompute.tolist() == [16, 17, 18, 19]

    # The cached pages as the pool would hold them: round 1's keys at the positions their keys record.
    cached = [t for i, m in enumerate(matches) if m for t in range(i * page, (i + 1) * page)]
    stored_at = [p for m in matches if m for p in m.old_positions]
    stored = stored_from_oracle(oracle1, model, cached, stored_at)
    ctx = SegmentContext(plan.segments, stored)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids2[16:]), ctx))
    run2 = WalkOracle(model, round2).run(ids2)
    torch.testing.assert_close(logits, run2.logits[16:], rtol=0, atol=1e-5)
