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

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from minakv.cache.keys import PageKey, digest_words, page_keys
from minakv.cache.kvcache import KVCache
from minakv.cache.plan import closure
from minakv.scheduler.request import Request


@dataclass
class Admission:
    pages: np.ndarray  # int64, per page of planned entries: the cached page, or -1
    matched: list[int]  # the cached pages among them
    unread: list[int]  # cached pages of r's history that nothing reads any more
    missing: list[int]  # page indices that need fresh memory (they hold entries to compute)
    todo: np.ndarray  # entries to compute, in order
    incomplete: np.ndarray  # bool per planned page: entries neither cached nor computed (never published)
    hits: int  # prompt tokens whose born entry comes from the cache
    skipped: int  # prompt tokens born but neither cached nor computed: dropped, and read by nothing now


def admission(r: Request, kv: KVCache) -> Admission:
    """Numpy over pages and entries throughout: an agent's history has thousands of pages."""
    ps, plan = kv.page_size, r.plan
    num_pages = -(-plan.size // ps)
    pages = np.full(num_pages, -1, dtype=np.int64)
    matched = kv.match(r.page_keys[: plan.last_entry // ps])  # never the last token's page: logits
    pages[: len(matched)] = matched
    have_page = pages >= 0
    have = np.repeat(have_page, ps)[: plan.size]
    todo, read = closure(plan, have)
    born = (plan.source < 0) & (plan.token < r.num_prompt)
    hits = int(np.count_nonzero(have & born))
    # a cached page nobody reads (an old stage, a dropped message) is not held: it stays a hole here
    unread = have_page & ~per_page(read, num_pages, ps)
    retired = pages[unread].tolist()
    pages[unread] = -1
    have_page &= ~unread
    have &= np.repeat(have_page, ps)[: plan.size]
    computed = np.zeros(plan.size, dtype=bool)
    computed[todo] = True
    needs = np.zeros(num_pages, dtype=bool)
    needs[todo // ps] = True
    incomplete = per_page(~have & ~computed, num_pages, ps)
    missing = np.nonzero(needs & ~have_page)[0].tolist()
    # a dropped message computed in an earlier round whose pages have left the cache since, and that no
    # query of this request reads: not computed again, so it counts as drop-skipped (not as computed)
    skipped = int(np.count_nonzero(born)) - hits - int(np.count_nonzero(born[todo]))
    return Admission(pages, pages[have_page].tolist(), retired, missing, todo, incomplete, hits, skipped)


def per_page(flags: np.ndarray, num_pages: int, page_size: int) -> np.ndarray:
    """Whether any entry of each page has the flag (entries past the plan count as unflagged)."""
    padded = np.zeros(num_pages * page_size, dtype=bool)
    padded[: len(flags)] = flags
    return padded.reshape(num_pages, page_size).any(1)


def publishable(r: Request, page_size: int) -> tuple[dict[int, PageKey], list[int]]:
    """r's own complete pages (allocated by r, every entry computed) with the keys to publish them under,
    and the cached pages r held that no live key reads any more (dropped by r's own operations). Pages r
    took from the cache are indexed already, so the hashing is proportional to what r computed, not to its
    history. Planned pages reuse the keys of planning; only pages of decode entries are hashed here.

    The live keys are the plan's `final_keys` followed by every decode entry, so their
    pages come from the plan (once per plan) and one range: no pass over a Python list of the history."""
    plan, ps, pages = r.plan, page_size, r.pages
    resolved = int(r.todo[r.cursor]) if r.cursor < len(r.todo) else r.num_entries
    known = bisect_left(r.decode_tokens, r.num_tokens)  # decode entries whose token is back (ascending)
    done = min(min(resolved, plan.size + known) // ps, len(pages))  # pages before this are resolved
    live = np.zeros(len(pages), dtype=bool)  # pages holding an entry the next token reads
    final = plan.final_pages(ps)
    live[final[final < len(pages)]] = True
    if r.decode_tokens:
        live[plan.size // ps : (r.num_entries - 1) // ps + 1] = True
    # cached pages (held, not r's own) that no live key reads
    fresh = np.asarray(r.fresh, dtype=np.int64)
    dead = (pages >= 0) & ~live
    dead[fresh] = False
    dead_cached = pages[dead].tolist()
    incomplete = np.zeros(len(pages), dtype=bool)
    incomplete[: len(r.incomplete)] = r.incomplete
    own = fresh[fresh < done]
    own = own[~incomplete[own]].tolist()
    if not own:
        return {}, dead_cached
    planned = min(len(r.page_keys), done)
    decoded: list[bytes] = []
    if done > planned:  # pages with decode entries: chain on from the last planned page's key
        decode = np.empty((known, 5), dtype=np.int64)
        decode[:, :2] = digest_words(plan.final_digest)
        decode[:, 2] = [r.token_at(t) for t in r.decode_tokens[:known]]
        decode[:, 3], decode[:, 4] = r.decode_positions[:known], -1
        rows = np.concatenate([plan.records[planned * ps :], decode])[: (done - planned) * ps]
        parent = r.page_keys[planned - 1].key if planned else None
        decoded = [k.key for k in page_keys(rows, ps, parent=parent)]

    def key(p: int) -> bytes:
        return r.page_keys[p].key if p < planned else decoded[p - planned]

    return {
        page: PageKey(key(p), not read) for p, page, read in zip(own, pages[own].tolist(), live[own].tolist())
    }, dead_cached
