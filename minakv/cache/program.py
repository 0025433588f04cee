"""Compile a request into a program: where every token sits, and what every query sees.

A request is a token sequence whose tokens have owners (message ids), plus cache operations:
`drop: {trigger: [ids]}` and `reposition: [ids]` (docs/design.md 2.2). Compilation runs the walk of docs/design.md
2.3 once, in bulk, and keeps just enough to answer every later question cheaply:

    token:          0   1   2   3   4   5   6   7        drop {1: [0]}, reposition [1]
    owner:          0   0   1   1   2   2   2   2        (messages 0, 1, 2)
    visible until:  4   4   -   -   -   -   -   -   <- tokens 0,1 are dropped before token 4 is born
    birth position: 0   1   2   3   2   3   4   5   <- then the reposition moves 2,3 to positions 0,1,
                                                       so token 4 is born at 2 (stage 1)

- `birth_pos[t]`: the position token t is born at; `visible_until[t]`: the first query that no longer sees
  it (`NEVER` if no drop in this request removes it).
- Stages: each effective reposition starts a new stage. A reposition is a no-op (ignored: no stage, no
  cache version) when it would change no position: every active token already sits at its rank AND next_pos
  already equals the active count. Dropping the newest messages and repositioning is NOT a no-op: the
  survivors keep their positions but the next token is born at A instead of after the gap. In stage s the tokens that were active at its start
  (`survivors[s]`, in logical order) sit at positions 0..A-1, and tokens born in the stage follow. So the
  position of any token in any stage is one `searchsorted` away, and nothing is stored per (token, stage).

Generated tokens continue the walk: token T + j (T = prompt length) is born at `next_pos + j`, in the last
stage, and is never dropped. Every method taking token indices accepts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from minakv.cache.validate import CacheOpError, check_owners, parse_drop, parse_reposition

NEVER = np.iinfo(np.int64).max  # visible_until of a token no drop of this request removes


@dataclass(frozen=True)
class Program:
    owners: np.ndarray  # int64 [T], non-decreasing, in 0..num_messages
    num_messages: int  # N; owner N is the generation prompt
    drops: dict[int, list[int]]  # validated drops with trigger < N, ascending triggers
    repositions: list[int]  # validated reposition ids < N (no-ops included)
    birth_pos: np.ndarray  # int64 [T]
    visible_until: np.ndarray  # int64 [T]: first query index that no longer sees the token, or NEVER
    drop_ranges: dict[int, list[tuple[int, int]]]  # drop point -> token ranges [lo, hi) newly dropped there
    stage_starts: np.ndarray  # int64 [S]: 0, then the point of each effective reposition
    survivors: list[np.ndarray]  # [S]: tokens active at each stage's start, position = index (empty for 0)
    next_pos: int  # position of the first generated token
    max_positions: int | None

    # -- per-token facts ------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.owners)

    def stage_of(self, tokens: Iterable[int] | np.ndarray) -> np.ndarray:
        """The stage each query lives in (the number of effective repositions before it)."""
        return np.searchsorted(self.stage_starts, np.asarray(tokens, dtype=np.int64), side="right") - 1

    def birth_positions(self, tokens: Iterable[int] | np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.int64)
        prompt = t < self.num_tokens
        generated = self.next_pos + (t - self.num_tokens)
        return np.where(prompt, self.birth_pos[np.where(prompt, t, 0)] if self.num_tokens else 0, generated)

    def drop_points(self, tokens: Iterable[int] | np.ndarray) -> np.ndarray:
        """visible_until for any token index (generated tokens: NEVER)."""
        t = np.asarray(tokens, dtype=np.int64)
        prompt = t < self.num_tokens
        if not self.num_tokens:
            return np.full(t.shape, NEVER, dtype=np.int64)
        return np.where(prompt, self.visible_until[np.where(prompt, t, 0)], NEVER)

    # -- what queries see -----------------------------------------------------------------------------

    def active_before(self, query: int) -> tuple[np.ndarray, np.ndarray]:
        """The earlier tokens query `query` sees and their positions at that point (docs/design.md 2.3).

        Those are the survivors of the query's stage (at their ranks) and the tokens born in the stage
        before it (at their birth positions), minus what was dropped since."""
        stage = int(self.stage_of([query])[0])
        start = int(self.stage_starts[stage])
        survivors = self.survivors[stage]
        alive = self.visible_until[survivors] > query
        born = np.arange(start, min(query, self.num_tokens), dtype=np.int64)
        born = born[self.visible_until[born] > query]
        generated = np.arange(max(start, self.num_tokens), query, dtype=np.int64)
        keys = np.concatenate([survivors[alive], born, generated])
        positions = np.concatenate([
            np.nonzero(alive)[0], self.birth_pos[born], self.next_pos + generated - self.num_tokens
        ]).astype(np.int64)  # fmt: skip
        return keys, positions

    # -- the state after the prompt ---------------------------------------------------------------------

    @cached_property
    def final_active(self) -> np.ndarray:
        """Prompt tokens the first generated token sees (after the events at the end of the prompt)."""
        return np.nonzero(self.visible_until == NEVER)[0].astype(np.int64)

    def events_at(self, point: int) -> tuple[list[tuple[int, int]], bool]:
        """The events just before token `point` is born: dropped token ranges, and an effective reposition."""
        return self.drop_ranges.get(point, []), bool(point > 0 and point in self.stage_starts)


# -- compilation ------------------------------------------------------------------------------------------


def compile_program(
    owners: Iterable[int],
    num_messages: int,
    drop: Mapping[int | str, Iterable[int]] | None = None,
    reposition: Iterable[int] | None = None,
    max_positions: int | None = None,
) -> Program:
    """Run the walk of docs/design.md 2.3 in bulk. Raises CacheOpError on any invalid operation."""
    owner_arr = check_owners(owners, num_messages)
    drops = parse_drop(drop, num_messages)
    repositions = parse_reposition(reposition, num_messages)
    n = len(owner_arr)

    def first_token_of(m: int) -> int:
        return int(np.searchsorted(owner_arr, m, side="left"))

    def first_token_after(m: int) -> int:
        return int(np.searchsorted(owner_arr, m, side="right"))

    # Drops: where each message stops being visible. An id dropped by an earlier trigger is ignored.
    visible_until = np.full(n, NEVER, dtype=np.int64)
    ranges: dict[int, list[tuple[int, int]]] = {}
    dropped: set[int] = set()
    for trigger, ids in drops.items():
        point = first_token_after(trigger)
        for m in ids:
            if m in dropped:
                continue
            dropped.add(m)
            lo, hi = first_token_of(m), first_token_after(m)
            if lo < hi:
                visible_until[lo:hi] = point
                ranges.setdefault(point, []).append((lo, hi))
    drop_ranges = {p: _merge(r) for p, r in sorted(ranges.items())}

    # Repositions: births advance one position per token; an effective reposition starts a new stage. Every
    # reposition point leaves its active tokens at positions 0..A-1 (an effective one renumbers them, a
    # no-op is one where they sit there already), so the active set is carried from point to point: the
    # tokens still visible keep their rank at the last point, and the ones born since their birth position.
    # That costs the active tokens and the new ones per reposition, not a pass over the whole prefix.
    birth = np.empty(n, dtype=np.int64)
    starts, survivors = [0], [np.zeros(0, dtype=np.int64)]
    next_pos, done = 0, 0
    active = np.zeros(0, dtype=np.int64)  # tokens active at the last reposition point, in order
    for m in repositions:
        point = first_token_after(m)
        birth[done:point] = np.arange(next_pos, next_pos + point - done)
        _check_limit(birth, done, point, max_positions)
        kept = visible_until[active] > point
        recent = np.arange(done, point, dtype=np.int64)[visible_until[done:point] > point]
        next_pos, done = next_pos + point - done, point
        active = np.concatenate([active[kept], recent])
        if len(active) == 0:
            raise CacheOpError(f"reposition: message {m}: nothing is active to reposition at that point")
        current = np.concatenate([np.nonzero(kept)[0], birth[recent]])
        if next_pos == len(active) and np.array_equal(current, np.arange(len(active))):
            continue  # a no-op: no active position and not next_pos would change: no stage, no new version
        starts.append(point)
        survivors.append(active)
        next_pos = len(active)
    birth[done:n] = np.arange(next_pos, next_pos + n - done)
    _check_limit(birth, done, n, max_positions)
    next_pos += n - done
    return Program(owner_arr, num_messages, drops, repositions, birth, visible_until, drop_ranges,
                   np.asarray(starts, dtype=np.int64), survivors, next_pos, max_positions)  # fmt: skip


def _check_limit(birth: np.ndarray, lo: int, hi: int, max_positions: int | None) -> None:
    """Births of tokens [lo, hi) must stay below the model's limit (repositions only lower positions)."""
    if max_positions is None or hi <= lo or birth[hi - 1] < max_positions:
        return
    t = lo + int(np.argmax(birth[lo:hi] >= max_positions))
    raise CacheOpError(
        f"positions: token {t} would be born at position {int(birth[t])}, reaching the position limit "
        f"{max_positions} (max_model_len, at most max_position_embeddings; drop and reposition earlier)"
    )


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
