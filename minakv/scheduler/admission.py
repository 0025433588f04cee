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
    skipped: int  # prompt tokens born but neither cached nor computed: dropped, and read by nothing now


def admission(r: Request, kv: KVCache) -> Admission:
    ps, plan = kv.page_size, r.plan
    matches = kv.match(r.page_keys[: plan.last_entry // ps])  # never the last token's page: it needs logits
    num_pages = -(-plan.size // ps)
    pages = [-1] * num_pages
    for p, m in enumerate(matches):
        if m is not None:
            pages[p] = m
    have_page = np.asarray(pages, dtype=np.int64) >= 0
    have = np.repeat(have_page, ps)[: plan.size]
    todo, read = closure(plan, have)
    born = (plan.source < 0) & (plan.token < r.num_prompt)
    hits = int((have & born).sum())
    # a cached page nobody reads (an old stage, a dropped message) is not held: it stays a hole here
    unread = have_page & ~per_page(read, num_pages, ps)
    retired = []
    for p in np.nonzero(unread)[0].tolist():
        retired.append(pages[p])
        pages[p] = -1
    have_page &= ~unread
    have &= np.repeat(have_page, ps)[: plan.size]
    computed = np.zeros(plan.size, dtype=bool)
    computed[todo] = True
    needs = np.zeros(num_pages, dtype=bool)
    needs[todo // ps] = True
    incomplete = per_page(~have & ~computed, num_pages, ps)
    matched = [p for p in pages if p >= 0]
    missing = np.nonzero(needs & ~have_page)[0].tolist()
    # a dropped message computed in an earlier round whose pages have left the cache since, and that no
    # query of this request reads: not computed again, so it counts as drop-skipped (not as computed)
    skipped = int(born.sum()) - hits - int(born[todo].sum())
    incomplete_pages = set(np.nonzero(incomplete)[0].tolist())
    return Admission(pages, matched, retired, missing, todo, incomplete_pages, hits, skipped)


def per_page(flags: np.ndarray, num_pages: int, page_size: int) -> np.ndarray:
    """Whether any entry of each page has the flag (entries past the plan count as unflagged)."""
    padded = np.zeros(num_pages * page_size, dtype=bool)
    padded[: len(flags)] = flags
    return padded.reshape(num_pages, page_size).any(1)


def publishable(r: Request, page_size: int) -> tuple[dict[int, PageKey], list[int]]:
    """r's own complete pages (allocated by r, every entry computed) with the keys to publish them under,
    and the cached pages r held that no live key reads any more (dropped by r's own operations). Pages r
    took from the cache are indexed already, so the hashing is proportional to what r computed, not to its
    history. Planned pages reuse the keys of planning; only pages of decode entries are hashed here."""
    plan, ps = r.plan, page_size
    resolved = int(r.todo[r.cursor]) if r.cursor < len(r.todo) else r.num_entries
    known = sum(1 for t in r.decode_tokens if t < r.num_tokens)  # decode entries whose token is back
    done = min(min(resolved, plan.size + known) // ps, len(r.pages))  # pages before this are resolved
    live_pages = np.unique(np.asarray(r.decode_keys, dtype=np.int64) // ps)
    live = set(live_pages.tolist())
    # cached pages (held, not r's own) that no live key reads: numpy, a long history has many pages
    pages = np.asarray(r.pages, dtype=np.int64)
    dead = pages >= 0
    dead[r.fresh] = False
    dead[live_pages[live_pages < len(pages)]] = False
    dead_cached = pages[dead].tolist()
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
