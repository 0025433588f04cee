"""What a request needs from the KV pool when it is admitted, and what it leaves to the cache when it goes.

Admission matches the request's page keys against the cache, then asks the plan which entries must really be
computed and which are read at all (`closure`). Only pages holding entries to compute get fresh memory, and
only cached pages holding entries that are read are held: a page of entries nobody reads (an old stage
superseded by a reposition, a dropped message) stays a hole (-1) in the request, cached or not, and costs it
nothing. That keeps a long agent history with many repositions as cheap in memory as its live state.

Release publishes the request's complete pages (every entry computed or cached) under their keys, marking
pages that no live key reads ("dead": dropped or superseded), which the index evicts first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minakv.cache.keys import PageKey, digest_words, page_keys
from minakv.cache.kvcache import KVCache
from minakv.cache.plan import closure
from minakv.scheduler.request import Request


@dataclass
class Admission:
    pages: list[int]  # per page of planned entries: the cached page, or -1
    matched: list[int]  # the cached pages among them
    unread: list[int]  # cached pages of r's history that nothing reads any more
    missing: list[int]  # page indices that need fresh memory (they hold entries to compute)
    todo: np.ndarray  # entries to compute, in order
    incomplete: set[int]  # pages with entries neither cached nor computed: never published
    hits: int  # prompt tokens whose born entry comes from the cache


def admission(r: Request, kv: KVCache) -> Admission:
    ps, plan = kv.page_size, r.plan
    matches = kv.match(r.page_keys[: plan.last_entry // ps])  # never the last token's page: it needs logits
    num_pages = -(-plan.size // ps)
    pages = [-1] * num_pages
    for p, m in enumerate(matches):
        if m is not None:
            pages[p] = m
    have_page = np.asarray(pages, dtype=np.int64) >= 0
    have = have_page[np.arange(plan.size) // ps]
    todo, read = closure(plan, have)
    hits = int((have & (plan.source < 0) & (plan.token < r.num_prompt)).sum())
    # a cached page nobody reads (an old stage, a dropped message) is not held: it stays a hole here
    unread = have_page & ~np.bincount(np.arange(plan.size) // ps, weights=read, minlength=num_pages).astype(
        bool
    )
    retired = []
    for p in np.nonzero(unread)[0].tolist():
        retired.append(pages[p])
        pages[p] = -1
    have_page &= ~unread
    have &= have_page[np.arange(plan.size) // ps]
    computed = np.zeros(plan.size, dtype=bool)
    computed[todo] = True
    needs = np.zeros(num_pages, dtype=bool)
    needs[todo // ps] = True
    incomplete = np.zeros(num_pages, dtype=bool)
    incomplete[np.nonzero(~have & ~computed)[0] // ps] = True  # (a mask, not np.unique: no sort)
    matched = [p for p in pages if p >= 0]
    missing = np.nonzero(needs & ~have_page)[0].tolist()
    return Admission(pages, matched, retired, missing, todo, set(np.nonzero(incomplete)[0].tolist()), hits)


def publishable(r: Request, page_size: int) -> tuple[dict[int, PageKey], list[int]]:
    """r's own complete pages (allocated by r, every entry computed) with the keys to publish them under,
    and the cached pages r held that no live key reads any more (dropped by r's own operations). Pages r
    took from the cache are indexed already, so the hashing is proportional to what r computed, not to its
    history. Planned pages reuse the keys of planning; only pages of decode entries are hashed here."""
    plan, ps = r.plan, page_size
    resolved = int(r.todo[r.cursor]) if r.cursor < len(r.todo) else r.num_entries
    known = sum(1 for t in r.decode_tokens if t < r.num_tokens)  # decode entries whose token is back
    done = min(min(resolved, plan.size + known) // ps, len(r.pages))  # pages before this are resolved
    live = set(np.unique(np.asarray(r.decode_keys, dtype=np.int64) // ps).tolist())
    held = np.nonzero(np.asarray(r.pages, dtype=np.int64) >= 0)[0].tolist()
    fresh = set(r.fresh)
    dead_cached = [r.pages[p] for p in held if p not in fresh and p not in live]
    own = [p for p in r.fresh if p < done and p not in r.incomplete]
    if not own:
        return {}, dead_cached
    keys = [k.key for k in r.page_keys[: min(len(r.page_keys), done)]]
    planned = len(keys)
    if done > planned:  # pages with decode entries: chain on from the last planned page's key
        decode = np.empty((known, 5), dtype=np.int64)
        decode[:, :2] = digest_words(plan.final_digest)
        decode[:, 2] = [r.token_at(t) for t in r.decode_tokens[:known]]
        decode[:, 3], decode[:, 4] = r.decode_positions[:known], -1
        rows = np.concatenate([plan.records[planned * ps :], decode])[: (done - planned) * ps]
        parent = keys[-1] if keys else None
        keys += [k.key for k in page_keys(rows, ps, parent=parent)]
    return {r.pages[p]: PageKey(keys[p], p not in live) for p in own}, dead_cached
