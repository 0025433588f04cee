"""When to reposition: at tool-batch boundaries, every few calls or once positions run long.

A drop leaves a hole in the positions: survivors keep theirs and new tokens keep counting from the raw
length (docs/design.md 2.3). A reposition closes the holes and the next token is born at A, the number of
active tokens. Repositions happen only at **boundaries**, the last result of each complete tool batch
(history.py), so the model's next turn always starts on compact positions, and a drop triggered at the
same message acts first (drops come before the reposition at one boundary).

Two schedules, which may be combined (a boundary chosen by either is repositioned):

- **call-based** (`every` = i, `first` = a): at the boundary of complete batch a, then of a + i, a + 2i, ...
  (batches counted from 1 in order of appearance).

      batch     1    2    3    4    5    6    7        a = 2, i = 2
      repos          ^         ^         ^

- **token-based** (`after_tokens` = T): at a boundary b whose **length** exceeds T while a new hole
  exists (some dropped token that no reposition has compacted yet). The length is the position the model's
  next turn would start at if the request ended at b:

      length(b) = tokens of messages 0..b + generation prompt - tokens compacted by earlier repositions

  where a reposition at b' compacts every token dropped by triggers up to b'. Without a new hole a
  reposition could not lower anything, so none is made.

Both are decided from messages up to the boundary only, so a later round repeats every earlier decision.
"""

from __future__ import annotations

from collections.abc import Sequence

REPOSITION_AFTER_TOKENS = 98_304  # AKV's benchmark setting for a 131,072-token context (96 Ki)


def reposition_points(
    boundaries: Sequence[int],
    drops: dict[int, list[int]],
    counts: Sequence[int] | None = None,
    every: int | None = None,
    first: int | None = None,
    after_tokens: int | None = None,
    generation_tokens: int = 0,
    extra_holes: Sequence[int] = (),
) -> list[int]:
    """The reposition ids (ascending) among `boundaries` (ascending message ids).

    `counts`: tokens per message (needed by the token-based schedule); `generation_tokens`: those of the
    generation prompt. `extra_holes`: messages that lose tokens the message-level drops do not show
    (thinking_drop's reasoning): one there counts as a new hole, its size unknown, so the length is an
    over-estimate and the schedule errs on the early side."""
    if after_tokens is not None and counts is None:
        raise ValueError("token-based reposition needs token counts per message")
    first = every if first is None else first
    ends = _running_sums(counts) if counts is not None else []
    triggers = sorted(drops)
    holes = sorted(extra_holes)
    points: list[int] = []
    seen: set[int] = set()
    dropped = compacted = 0  # tokens dropped so far / dropped tokens a reposition has compacted
    hole_marks = compacted_marks = 0  # the same for extra holes, counted as messages
    t = h = 0
    for c, b in enumerate(boundaries, start=1):
        while t < len(triggers) and triggers[t] <= b:
            for m in drops[triggers[t]]:
                if m not in seen:  # a message named again is ignored, as the engine does
                    seen.add(m)
                    dropped += counts[m] if counts is not None else 1
            t += 1
        while h < len(holes) and holes[h] <= b:
            hole_marks, h = hole_marks + 1, h + 1
        by_calls = every is not None and c >= first and (c - first) % every == 0
        by_tokens = False
        if after_tokens is not None:
            length = ends[b] + generation_tokens - compacted
            by_tokens = length > after_tokens and (dropped > compacted or hole_marks > compacted_marks)
        if by_calls or by_tokens:
            points.append(b)
            compacted, compacted_marks = dropped, hole_marks
    return points


def _running_sums(counts: Sequence[int]) -> list[int]:
    """ends[m] = tokens of messages 0..m."""
    out, total = [], 0
    for n in counts:
        total += n
        out.append(total)
    return out
