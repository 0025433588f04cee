"""Restore planning: recompute only the missing KV that some later query reads, in one forward pass.

Given which tokens' KV is available (`have`, from exact or re-rotatable cache hits), a missing token must
be recomputed iff a query that will run reads it: a required query (by default the last token, whose
logits start generation), the future decode queries (they read the final active set), or another token
being recomputed (its query reads everything active before it). Scanning tokens backwards decides each
one after all its possible readers (docs/design.md 3.3):

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from minakv.cache.index import Match
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
    needed = np.zeros(length, dtype=bool)
    required = ([length - 1] if length else []) if want is None else [int(t) for t in want]
    needed[required] = True
    tokens = np.arange(length + 1)
    stage = program.stage_of(tokens)
    birth = program.birth_positions(tokens)
    until = program.drop_points(tokens)
    # Per stage, the smallest query decided so far (scanning backwards, that is the last one added); the
    # next token (the first decode step, index `length`) reads the final active set.
    first_reader = np.full(program.num_stages, NEVER, dtype=np.int64)
    first_reader[stage[length]] = length
    next_reader = length  # the smallest query so far over all stages
    missing = np.nonzero(~have)[0]
    positions = _stage_positions(program, missing) if window is not None else None
    row = {int(t): r for r, t in enumerate(missing)}
    for t in np.nonzero(~have | needed)[0][::-1].tolist():
        if not needed[t]:
            if window is None:  # read iff some later query comes before its drop point
                needed[t] = next_reader < until[t]
            else:  # per stage, the first query there is the closest in position
                needed[t] = any(
                    first_reader[s] < until[t] and birth[first_reader[s]] - positions[row[t], s] < window
                    for s in range(stage[t], program.num_stages)
                )
        if needed[t]:
            first_reader[stage[t]] = next_reader = t
    return needed


def _stage_positions(program: Program, tokens: np.ndarray) -> np.ndarray:
    """[len(tokens), stages] position of each token in each stage (-1 where it does not exist yet)."""
    out = np.full((len(tokens), program.num_stages), -1, dtype=np.int64)
    stage = program.stage_of(tokens)
    for s in range(program.num_stages):
        survivors = program.survivors[s]
        if len(survivors):
            rank = np.searchsorted(survivors, tokens)
            alive = (rank < len(survivors)) & (survivors[np.minimum(rank, len(survivors) - 1)] == tokens)
            alive &= tokens < program.stage_starts[s]
            out[alive, s] = rank[alive]
        out[stage == s, s] = program.birth_positions(tokens[stage == s])
    return out


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


def cached_tokens(matches: Sequence[Match | None], page_size: int, length: int) -> np.ndarray:
    """`have` for plan_restore from PageIndex.match: tokens of matched pages (exact or re-rotatable)."""
    have = np.zeros(length, dtype=bool)
    for index, match in enumerate(matches):
        if match is not None:
            have[index * page_size : (index + 1) * page_size] = True
    return have
