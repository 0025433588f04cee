"""Validate a request's owners and cache operations; every problem raises CacheOpError naming the field.

`drop: {trigger: [ids]}` (trigger keys may arrive as strings: JSON object keys) and `reposition: [ids]`
(docs/design.md 2.2). Triggers and reposition ids at or after N (the number of messages) are future events:
validated, then left out of what is returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import pairwise

import numpy as np


class CacheOpError(ValueError):
    """An invalid cache operation (or owner list); the message names the field and the value."""


def as_id(value: object, field: str) -> int:
    """A non-negative integer id; JSON object keys arrive as strings, so digit strings are accepted."""
    digits = isinstance(value, str) and value.strip().lstrip("-").isdigit()
    if digits or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
        number = int(value)
    else:
        raise CacheOpError(f"{field}: {value!r} is not an integer message id")
    if number < 0:
        raise CacheOpError(f"{field}: message id {number} is negative")
    return number


def check_owners(owners: Iterable[int], num_messages: int) -> np.ndarray:
    if isinstance(num_messages, bool) or not isinstance(num_messages, (int, np.integer)) or num_messages < 0:
        raise CacheOpError(f"num_messages: {num_messages!r} is not a non-negative integer")
    # an int64 array (pre-tokenized messages) is taken as is: converting it through a list costs per token
    arr = owners if isinstance(owners, np.ndarray) else np.asarray(list(owners))
    if arr.size and arr.dtype.kind not in "iu":
        raise CacheOpError(f"owners: {arr.dtype} values; owners must be integer message ids")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > num_messages):
        bad = int(arr[(arr < 0) | (arr > num_messages)][0])
        raise CacheOpError(f"owners: owner {bad} is outside 0..{num_messages} (N = {num_messages} messages)")
    if arr.size > 1 and (np.diff(arr) < 0).any():
        t = int(np.argmax(np.diff(arr) < 0)) + 1
        raise CacheOpError(
            f"owners: owner {int(arr[t])} at token {t} follows {int(arr[t - 1])}; not non-decreasing"
        )
    return arr


def parse_drop(drop: Mapping[int | str, Iterable[int]] | None, num_messages: int) -> dict[int, list[int]]:
    """Validate `drop`; return the drops that happen in this request (trigger < N), ascending."""
    if drop is None:
        return {}
    if not isinstance(drop, Mapping):
        raise CacheOpError(f"drop: {drop!r} is not a mapping {{trigger: [message ids]}}")
    out: dict[int, list[int]] = {}
    for key, ids in drop.items():
        trigger = as_id(key, "drop trigger")
        if trigger in out:
            raise CacheOpError(f"drop: trigger {trigger} is given twice")
        if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
            raise CacheOpError(f"drop[{trigger}]: {ids!r} is not a list of message ids")
        checked = []
        for value in ids:
            m = as_id(value, f"drop[{trigger}]")
            if trigger < num_messages and m >= num_messages:
                raise CacheOpError(
                    f"drop[{trigger}]: message id {m} is out of range ({num_messages} messages)"
                )
            if m > trigger:
                raise CacheOpError(f"drop[{trigger}]: message id {m} is above its trigger {trigger}")
            checked.append(m)
        out[trigger] = checked
    return {t: out[t] for t in sorted(out) if t < num_messages}  # triggers >= N are future events


def parse_reposition(reposition: Iterable[int] | None, num_messages: int) -> list[int]:
    """Validate `reposition`; return the ids < N (a later one is a future event, like a trigger >= N)."""
    if reposition is None:
        return []
    if isinstance(reposition, (str, bytes, Mapping)) or not isinstance(reposition, Iterable):
        raise CacheOpError(f"reposition: {reposition!r} is not a list of message ids")
    ids = [as_id(value, "reposition") for value in reposition]
    for a, b in pairwise(ids):
        if b <= a:
            raise CacheOpError(f"reposition: {ids} is not strictly increasing ({a} then {b})")
    return [m for m in ids if m < num_messages]
