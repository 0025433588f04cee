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
    incomplete = np.unique(np.nonzero(~have & ~computed)[0] // ps)
    matched = [p for p in pages if p >= 0]
    missing = np.nonzero(needs & ~have_page)[0].tolist()
    return Admission(pages, matched, retired, missing, todo, set(incomplete.tolist()), hits)


def publishable(r: Request, page_size: int) -> list[PageKey | None]:
    """Per page of r, the key to publish it under, or None (not complete, or not r's to give). Pages of
    planned entries reuse the keys computed at planning; only pages reaching into decode entries hash."""
    plan, ps = r.plan, page_size
    resolved = int(r.todo[r.cursor]) if r.cursor < len(r.todo) else r.num_entries
    known = sum(1 for t in r.decode_tokens if t < r.num_tokens)  # decode entries whose token is back
    done = min(min(resolved, plan.size + known) // ps, len(r.pages)) * ps
    live = np.zeros(done, dtype=bool)
    keys = np.asarray(r.decode_keys, dtype=np.int64)
    live[keys[keys < done]] = True
    dead = (~live.reshape(-1, ps).any(axis=1)).tolist() if done else []
    planned = min(len(r.page_keys), done // ps)
    out = [PageKey(k.key, d) for k, d in zip(r.page_keys[:planned], dead)]
    if done // ps > planned:  # pages with decode entries: chain on from the last planned page's key
        decode = np.empty((known, 5), dtype=np.int64)
        decode[:, :2] = digest_words(plan.final_digest)
        decode[:, 2] = [r.token_at(t) for t in r.decode_tokens[:known]]
        decode[:, 3], decode[:, 4] = r.decode_positions[:known], -1
        rows = np.concatenate([plan.records[planned * ps :], decode])[: done - planned * ps]
        parent = r.page_keys[planned - 1].key if planned else None
        out += page_keys(rows, ps, dead[planned:], parent=parent)
    return [None if p in r.incomplete or r.pages[p] < 0 else key for p, key in enumerate(out)]
