"""Restore planning: recompute only the missing KV that some later query reads, in one forward pass.

Given which tokens' KV is available (`have`, from exact or re-rotatable cache hits), a missing token must
be recomputed iff a query that will run reads it: a required query (by default the last token, whose
logits start generation), the future decode queries (they read the final active set), or another token
being recomputed (its query reads everything active before it). Scanning tokens backwards decides each
one after all its possible readers (DESIGN.md 3.3):

    token:     0  1  2  3  4  5  6  7      (drop {1: [0]} before token 4; token 7 = last)
    have:      .  x  .  x  x  .  x  .      x = cached
    needed:    n  -  n  -  -  n  -  n      0 is dropped before 4 but read by 2's query; 7 for its logits

With a sliding window, a query reads only keys within the window of ITS position, and a reposition can
bring an old key back into the window; so per stage we keep the first (smallest) recomputed query and test
the distance there. The window is the largest over layers (None if any layer attends fully), because a
page holds every layer's KV.

The recomputed tokens become segments of ONE pass: runs of consecutive recomputed tokens, cut at drop and
reposition points. Each segment's keys are the tokens active there that are cached or recomputed in the
same pass (a missing key left out is, by construction, outside every reading query's window).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from minakv.cache.program import NEVER, Program, Segment


@dataclass(frozen=True)
class RestorePlan:
    recompute: np.ndarray  # int64 token indices to run as queries, increasing
    segments: list[Segment]  # the one forward pass, rows in order


def needed_tokens(
    program: Program,
    have: np.ndarray,
    want: Iterable[int] | None = None,
    window: int | None = None,
) -> np.ndarray:
    """Boolean mask over the first len(have) tokens: run these as queries (the dependency closure)."""
    have = np.asarray(have, dtype=bool)
    length = len(have)
    want_set = {length - 1} if want is None else {int(t) for t in want}
    tokens = np.arange(length + 1)
    stage = program.stage_of(tokens)
    birth = program.birth_positions(tokens)
    until = program.drop_points(tokens)
    first_reader = np.full(program.num_stages, NEVER, dtype=np.int64)  # per stage: smallest query so far
    first_reader[stage[length]] = length  # the next token (decode) reads the final active set
    needed = np.zeros(length, dtype=bool)
    for t in range(length - 1, -1, -1):
        if t in want_set or (
            not have[t] and _is_read(program, t, stage, birth, until[t], first_reader, window)
        ):
            needed[t] = True
            first_reader[stage[t]] = t
    return needed


def _is_read(
    program: Program,
    t: int,
    stage: np.ndarray,
    birth: np.ndarray,
    until: int,
    first_reader: np.ndarray,
    window: int | None,
) -> bool:
    for s in range(stage[t], program.num_stages):
        q = first_reader[s]
        if q == NEVER or q >= until:
            continue  # no reader in this stage, or t is dropped before it
        if window is None or birth[q] - program.positions_at([t], s)[0] < window:
            return True
    return False


def plan_restore(
    program: Program,
    have: np.ndarray,
    want: Iterable[int] | None = None,
    window: int | None = None,
) -> RestorePlan:
    """What to recompute and the segments of the single pass that does it."""
    have = np.asarray(have, dtype=bool)
    needed = needed_tokens(program, have, want, window)
    queries = np.nonzero(needed)[0].astype(np.int64)
    available = have | needed
    segments = []
    for run in np.split(queries, np.nonzero(np.diff(queries) != 1)[0] + 1) if len(queries) else []:
        for seg in program.segments(int(run[0]), int(run[-1]) + 1):
            keep = available[seg.keys] if len(seg.keys) else np.zeros(0, dtype=bool)
            segments.append(
                Segment(seg.queries, seg.query_positions, seg.keys[keep], seg.key_positions[keep])
            )
    return RestorePlan(queries, segments)
