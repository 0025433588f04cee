"""Program compilation against the walk of docs/design.md 2.3, written out literally in
tests/helpers/programs.py (acceptance 1). The plan built from a program is checked in test_cache_restore.py."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from helpers.programs import WalkError, requests, walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minakv.cache.program import NEVER, CacheOpError, compile_program
from minakv.reference.segments import segments as cut_segments


def in_window(q_pos, k_pos, window):
    return window is None or q_pos - k_pos < window


def check_program(owners, num_messages, drop, reposition, generated, window, chunks):
    try:
        seen, final, next_pos, history, dropped_at = walk(owners, num_messages, drop, reposition, generated)
    except WalkError:
        with pytest.raises(CacheOpError, match="reposition"):
            compile_program(owners, num_messages, drop, reposition)
        return
    program = compile_program(owners, num_messages, drop, reposition)
    n, total = len(owners), len(owners) + generated

    # Every query, asked one at a time (and the first decode query: the state after the prompt).
    for q in range(total):
        keys, pos = program.active_before(q)
        assert dict(zip(keys.tolist(), pos.tolist())) == {t: p for t, p in seen[q].items() if t != q}, q
        assert program.birth_positions([q])[0] == seen[q][q]
    keys, pos = program.active_before(n)
    assert dict(zip(keys.tolist(), pos.tolist())) == {t: p for t, p in final.items() if t < n}
    assert program.final_active.tolist() == sorted(t for t in final if t < n)

    # Every query, through the segments of a chunked prefill (with a window applied by position).
    bounds = [0, *sorted(c for c in set(chunks) if 0 < c < total), total]
    for a, b in pairwise(bounds):
        segments = cut_segments(program, a, b)
        assert [q for s in segments for q in s.queries.tolist()] == list(range(a, b))
        for seg in segments:
            assert (np.diff(seg.keys) > 0).all() and (np.diff(seg.key_positions) > 0).all()
            assert len(seg.keys) == 0 or (seg.keys.max() < seg.queries[0] and
                                          seg.key_positions.max() < seg.query_positions[0])  # fmt: skip
            for i, q in enumerate(seg.queries.tolist()):
                q_pos = int(seg.query_positions[i])
                got = dict(zip(seg.keys.tolist(), seg.key_positions.tolist()))
                got.update(zip(seg.queries[: i + 1].tolist(), seg.query_positions[: i + 1].tolist()))
                got = {k: p for k, p in got.items() if in_window(q_pos, p, window)}
                want = {k: p for k, p in seen[q].items() if in_window(seen[q][q], p, window)}
                assert got == want, (q, seg)

    # The state decode starts from, and when each token stops being seen.
    assert program.next_pos == next_pos - generated
    for t in range(n):
        until = program.visible_until[t]
        assert until == NEVER or all(t not in seen[q] for q in range(until, total))
        assert all(t in seen[q] for q in range(t, min(until, total)))
    for point in range(total + 1):
        ranges, _ = program.events_at(point)
        assert {t for lo, hi in ranges for t in range(lo, hi)} == dropped_at.get(point, set())
    # Each stage's survivors sit at their ranks: a token's positions over the stages are the walk's.
    for t in range(n):
        stages = [s for s in range(1, len(program.stage_starts)) if t in program.survivors[s]]
        assert [seen[t][t], *(program.survivors[s].tolist().index(t) for s in stages)] == history[t], t


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.integers(0, 30), max_size=3))
def test_program_matches_walk(request, chunks):
    check_program(*request, chunks)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(st.integers(0, 30), max_size=4))
def test_program_matches_walk_many(request, chunks):
    check_program(*request, chunks)


@settings(max_examples=150, deadline=None)
@given(requests(), st.integers(1, 16))
def test_position_limit_matches_walk(request, limit):
    owners, num_messages, drop, reposition, _, _ = request
    try:
        walk(owners, num_messages, drop, reposition, 0, max_positions=limit)
    except WalkError as e:
        field = "positions" if str(e) == "position limit" else "reposition"
        with pytest.raises(CacheOpError, match=field):
            compile_program(owners, num_messages, drop, reposition, max_positions=limit)
        return
    program = compile_program(owners, num_messages, drop, reposition, max_positions=limit)
    assert program.next_pos <= limit


def test_design_example():
    # Messages 0 (2 tokens), 1 (2), 2 (4). Drop message 0 after message 1, then reposition there.
    p = compile_program([0, 0, 1, 1, 2, 2, 2, 2], 3, {"1": [0]}, [1])
    assert p.birth_pos.tolist() == [0, 1, 2, 3, 2, 3, 4, 5]
    assert p.visible_until.tolist()[:2] == [4, 4]
    assert p.final_active.tolist() == [2, 3, 4, 5, 6, 7] and p.active_before(8)[1].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert p.next_pos == 6
    assert p.stage_starts.tolist() == [0, 4] and p.survivors[1].tolist() == [2, 3]  # 2, 3 move to 0, 1
    assert p.events_at(4) == ([(0, 2)], True)


def test_drop_alone_keeps_positions():
    p = compile_program([0, 0, 1, 1, 2], 3, {2: [0]})
    assert p.birth_pos.tolist() == [0, 1, 2, 3, 4] and p.next_pos == 5  # drop never compacts
    assert p.final_active.tolist() == [2, 3, 4] and p.active_before(5)[1].tolist() == [2, 3, 4]
    assert p.events_at(5) == ([(0, 2)], False)  # a trailing event: before the first generated token


def test_noop_reposition_makes_no_stage():
    # Nothing dropped before message 0's end: positions are already 0..A-1.
    p = compile_program([0, 0, 1, 1], 2, None, [0])
    assert len(p.stage_starts) == 1 and p.events_at(2) == ([], False)
    q = compile_program([0, 0, 1, 1], 2)
    assert p.birth_pos.tolist() == q.birth_pos.tolist()


def test_reposition_after_dropping_the_newest_message_resets_next_pos():
    # Survivors 0, 1 already sit at 0, 1, but the next token is born at 2, not 4: not a no-op.
    p = compile_program([0, 0, 1, 1, 2], 3, {1: [1]}, [1])
    assert (
        p.stage_starts.tolist() == [0, 4]
        and p.birth_pos.tolist() == [0, 1, 2, 3, 2]
        and p.events_at(4) == ([(2, 4)], True)
    )
    assert p.survivors[1].tolist() == [0, 1]  # token 0 stays at position 0 in the new stage


def test_future_events_are_ignored():
    p = compile_program([0, 1, 1], 2, {"2": [1, 2], 5: [0]}, [2, 3])
    assert p.visible_until.tolist() == [NEVER] * 3 and len(p.stage_starts) == 1 and p.next_pos == 3


def test_drop_at_shared_boundary_runs_before_reposition():
    p = compile_program([0, 1, 1, 2], 3, {1: [0]}, [1])
    assert p.survivors[1].tolist() == [1, 2] and p.birth_pos[3] == 2  # token 1: position 1, then 0


def test_already_dropped_is_ignored():
    p = compile_program([0, 1, 2, 3], 4, {1: [0], 2: [0, 1]})
    assert p.visible_until.tolist() == [2, 3, NEVER, NEVER]


def test_generated_tokens_continue_the_walk():
    p = compile_program([0, 0, 1, 1], 2, {1: [0]}, [1])  # trailing drop + reposition at the end
    assert p.final_active.tolist() == [2, 3] and p.next_pos == 2
    keys, pos = p.active_before(5)  # the second generated token
    assert keys.tolist() == [2, 3, 4] and pos.tolist() == [0, 1, 2] and p.birth_positions([5]).tolist() == [3]
    (seg,) = cut_segments(p, 4, 6)
    assert seg.keys.tolist() == [2, 3] and seg.query_positions.tolist() == [2, 3]


# -- acceptance 5: every invalid operation, one test each --------------------------------------------


def test_error_dropped_id_above_trigger():
    with pytest.raises(CacheOpError, match=r"drop\[1\]: message id 2 is above its trigger 1"):
        compile_program([0, 1, 2], 3, {"1": [2]})


def test_error_dropped_id_above_future_trigger():
    with pytest.raises(CacheOpError, match=r"drop\[4\]: message id 5 is above its trigger 4"):
        compile_program([0, 1, 2], 3, {"4": [5]})


def test_error_negative_dropped_id():
    with pytest.raises(CacheOpError, match=r"drop\[1\]: message id -1 is negative"):
        compile_program([0, 1, 2], 3, {"1": [-1]})


def test_error_negative_trigger():
    with pytest.raises(CacheOpError, match="drop trigger: message id -2 is negative"):
        compile_program([0, 1, 2], 3, {"-2": [0]})


def test_error_non_integer_dropped_id():
    with pytest.raises(CacheOpError, match=r"drop\[1\]: 0.5 is not an integer"):
        compile_program([0, 1, 2], 3, {"1": [0.5]})
    with pytest.raises(CacheOpError, match=r"drop\[1\]: True is not an integer"):
        compile_program([0, 1, 2], 3, {"1": [True]})


def test_error_non_integer_trigger():
    with pytest.raises(CacheOpError, match="drop trigger: 'one' is not an integer"):
        compile_program([0, 1, 2], 3, {"one": [0]})


def test_error_out_of_range_id():
    with pytest.raises(CacheOpError, match=r"drop\[2\]: message id 3 is out of range \(3 messages\)"):
        compile_program([0, 1, 2], 3, {"2": [3]})


def test_error_reposition_not_increasing():
    with pytest.raises(CacheOpError, match=r"reposition: \[2, 1\] is not strictly increasing"):
        compile_program([0, 1, 2], 3, None, [2, 1])
    with pytest.raises(CacheOpError, match=r"reposition: \[1, 1\] is not strictly increasing"):
        compile_program([0, 1, 2], 3, None, [1, 1])


def test_error_reposition_negative_or_non_integer():
    with pytest.raises(CacheOpError, match="reposition: message id -1 is negative"):
        compile_program([0, 1, 2], 3, None, [-1])
    with pytest.raises(CacheOpError, match="reposition: '1x' is not an integer"):
        compile_program([0, 1, 2], 3, None, ["1x"])
    with pytest.raises(CacheOpError, match="reposition: 1.0 is not an integer"):
        compile_program([0, 1, 2], 3, None, [1.0])


def test_error_reposition_nothing_active():
    with pytest.raises(CacheOpError, match="reposition: message 1: nothing is active"):
        compile_program([0, 1, 2], 3, {"1": [0, 1]}, [1])


def test_error_position_limit_at_birth():
    with pytest.raises(CacheOpError, match="positions: token 4 would be born at position 4, reaching "
                       "the position limit 4"):  # fmt: skip
        compile_program([0, 0, 1, 1, 2], 3, max_positions=4)


def test_position_limit_after_reposition():
    # Dropping alone does not help; a reposition brings the positions back under the limit.
    with pytest.raises(CacheOpError, match="position limit 5"):
        compile_program([0, 0, 0, 1, 1, 2], 3, {1: [0]}, max_positions=5)
    p = compile_program([0, 0, 0, 1, 1, 2], 3, {1: [0]}, [1], max_positions=5)
    assert p.birth_pos.tolist() == [0, 1, 2, 3, 4, 2]


def test_error_bad_owners():
    with pytest.raises(CacheOpError, match="owners: owner 0 at token 2 follows 1"):
        compile_program([0, 1, 0], 2)
    with pytest.raises(CacheOpError, match=r"owners: owner 3 is outside 0..2"):
        compile_program([0, 3], 2)


def test_error_bad_shapes():
    with pytest.raises(CacheOpError, match="drop: .* is not a mapping"):
        compile_program([0], 1, [0])
    with pytest.raises(CacheOpError, match=r"drop\[0\]: 0 is not a list"):
        compile_program([0], 1, {0: 0})
    with pytest.raises(CacheOpError, match="reposition: '0' is not a list"):
        compile_program([0], 1, None, "0")
