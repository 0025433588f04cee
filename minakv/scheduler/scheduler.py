"""Continuous batching over the paged KV pool.

The engine drives one step as three calls, as nano-vllm's `LLMEngine` and vLLM's `EngineCore` do:

    batch = scheduler.schedule()     admit waiting requests, build one ForwardBatch (decode tokens first,
                                     then prefill chunks under the token budget)
    result = worker.step(batch)      the forward and the sampled tokens
    changed = scheduler.update(batch, result)   apply the tokens, finish requests

Finished requests publish their full pages to the cache index, so a later request with the same history
(tokens *and* operations) starts from them. When pages run out, unreferenced cached pages are evicted first;
if that is not enough the youngest running request is preempted (its computed pages go to the cache, and it
is recomputed later, usually from those very pages).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from minakv.cache.kvcache import KVCache
from minakv.cache.plan import Entry, entries_to_compute, plan_request, record
from minakv.config import EngineConfig
from minakv.scheduler.request import Request, Status
from minakv.scheduler.stops import apply_token
from minakv.worker.batch import ForwardBatch
from minakv.worker.worker import StepResult


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_pages: int, kv_bytes_per_entry: int, tokenizer, max_model_len: int
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = config.page_size
        self.kv = KVCache(num_pages, config.page_size, config.enable_prefix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows = list(range(config.max_num_seqs))[::-1]  # free rows of the worker's key table
        names = ("requests", "prompt_tokens", "output_tokens", "cache_hit_tokens", "prefill_tokens",
                 "preemptions", "decode_tokens", "decode_kv_entries", "errors")  # fmt: skip
        self.counters = dict.fromkeys(names, 0)
        self.kv_bytes_per_entry = kv_bytes_per_entry
        self.failed: list[Request] = []  # requests that ended at admission, reported by the next update

    # ----- queue management -----
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, r: Request) -> None:
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += r.num_prompt
        self.waiting.append(r)

    def abort(self, request_id: str) -> Request | None:
        for r in [*self.waiting, *self.running]:
            if r.request_id == request_id:
                return self._finish(r, "abort")
        return None

    def fail_all(self, message: str) -> list[Request]:
        """After an internal error: end every request (reason "error") so no caller waits forever."""
        self.counters["errors"] += 1
        failed = [*self.waiting, *self.running]
        for r in failed:
            r.error = message
            self._finish(r, "error")
        return failed

    # ----- one step: schedule, (the worker runs the batch), update -----
    def schedule(self) -> ForwardBatch:
        """Admit what fits and build the next forward batch (it may be empty: nothing to compute). The
        requests' progress is committed here, so the next batch can be scheduled before this one's tokens
        are back (the overlap loop); their tokens then reach the worker as references to device rows."""
        self.failed += self._admit()
        decoding = [r for r in self.running if r.cursor == len(r.todo) and not self._done_by_length(r)]
        for r in decoding:  # reserve decode pages first: this may preempt the youngest requests
            if r.status is Status.RUNNING:
                self._ensure_pages(r, len(r.entries) + 1)
        batch = ForwardBatch()
        for r in decoding:
            if r.status is Status.RUNNING:
                self._schedule_decode(r, batch)
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        for r in self.running:
            if budget <= 0:
                break
            if r.cursor < len(r.todo):
                r.cursor, computed = self._schedule_prefill(r, batch, budget)
                budget -= computed
                self.counters["prefill_tokens"] += computed
        return batch

    def update(self, batch: ForwardBatch, result: StepResult) -> list[Request]:
        """Apply a step's sampled tokens (in sample-row order); returns the requests with news for their
        callers (new tokens, or finished)."""
        changed, self.failed = self.failed, []
        for (r, _), token, logprob in zip(batch.scheduled, result.tokens, result.logprobs):
            r.pending -= 1
            if r.status is Status.FINISHED:  # ended while this step ran (abort, or a token of the last step)
                continue
            self.counters["output_tokens"] += 1
            if apply_token(r, token, logprob, self.tokenizer, self.max_model_len):
                self._finish(r, r.finish_reason)
            changed.append(r)
        return changed

    def _done_by_length(self, r: Request) -> bool:
        """Will r end by length once its pending tokens arrive? Then it needs no further step."""
        n = len(r.output_ids) + r.pending
        limit = r.program.max_positions  # the last of the n tokens would be born at next_pos + n - 1
        return n > 0 and (
            n >= r.params.max_tokens
            or r.num_prompt + n >= self.max_model_len
            or (limit is not None and r.program.next_pos + n - 1 >= limit)
        )

    def _schedule_decode(self, r: Request, batch: ForwardBatch) -> None:
        """Feed the last sampled token: one new entry at the next position, reading all active keys."""
        t = r.num_tokens + r.pending - 1
        entry = Entry(t, r.next_pos)
        r.entries.append(entry)
        e = len(r.entries) - 1
        slot = self._slot(r, e)
        if r.row < 0:  # first decode step since (re)admission: the row gets all keys at once
            r.row = self.rows.pop()
            keys = np.asarray(r.decode_keys, dtype=np.int64)
            pages = np.asarray(r.pages, dtype=np.int64)
            slots = pages[keys // self.page_size] * self.page_size + keys % self.page_size
            positions = np.fromiter((r.entries[k].position for k in r.decode_keys), np.int64, len(keys))
            batch.write_row(r.row, 0, slots, positions)
            r.row_len = len(keys)
        r.decode_keys.append(e)
        batch.write_row(r.row, r.row_len, [slot], [entry.position])
        r.row_len += 1
        r.next_pos += 1
        # the input: a known token, or the one the previous step samples for r (still on the device)
        batch.input_ids.append(r.token_at(t) if r.pending == 0 else -(r.sample_row + 1))
        batch.positions.append(entry.position)
        batch.slots.append(slot)
        batch.decode_rows.append(r.row)
        batch.decode_lens.append(r.row_len)
        batch.num_decode += 1
        self._sample_last(batch, r)
        self.counters["decode_tokens"] += 1
        self.counters["decode_kv_entries"] += r.row_len

    def _schedule_prefill(self, r: Request, batch: ForwardBatch, budget: int) -> tuple[int, int]:
        """The next entries to compute: copies first (re-rotations run before the forward), then computed
        tokens up to the budget, stopping before the next copy (its source may be computed in this very
        batch). A piece of queries is a run of consecutive entries of one segment; cached entries between
        them (a restore around holes) split pieces. Returns (new cursor, tokens computed)."""
        todo, entries, i = r.todo, r.entries, r.cursor
        while i < len(todo) and entries[todo[i]].is_copy:
            e = todo[i]
            src = entries[entries[e].source]
            values = (self._slot(r, entries[e].source), self._slot(r, e), src.position, entries[e].position)
            for column, value in zip(batch.rerotate, values):
                column.append(value)
            r.usage.repos_tokens += 1
            i += 1
        start = i
        pages = np.asarray(r.pages, dtype=np.int64)
        while i < len(todo) and not entries[todo[i]].is_copy and i - start < budget:
            first = e = todo[i]
            seg = entries[e].segment
            while i < len(todo) and todo[i] == e and entries[e].segment == seg and i - start < budget:
                batch.input_ids.append(r.token_at(entries[e].token_index))
                batch.positions.append(entries[e].position)
                batch.slots.append(self._slot(r, e))
                i, e = i + 1, e + 1
            # the segment's outside keys, plus its members before this piece (cached or computed earlier)
            if seg not in r.segment_arrays:
                r.segment_arrays[seg] = np.asarray(r.plan.segment_keys[seg], dtype=np.int64)
            outside = np.concatenate([r.segment_arrays[seg], np.arange(r.plan.segment_start[seg], first)])
            slots = pages[outside // self.page_size] * self.page_size + outside % self.page_size
            batch.add_segment_keys(slots, r.entry_pos[outside])
            batch.seg_q_indptr.append(batch.num_tokens - batch.num_decode)
            if e - 1 == r.plan.last_entry:
                self._sample_last(batch, r)
        return i, i - start

    def _sample_last(self, batch: ForwardBatch, r: Request) -> None:
        r.sample_row = len(batch.sample_rows)
        batch.sample_rows.append(batch.num_tokens - 1)
        batch.sample_params.append(r.params)
        batch.sample_seeds.append(r.seed)
        batch.sample_counters.append(len(r.output_ids) + r.pending)
        batch.scheduled.append((r, True))
        r.pending += 1

    def _slot(self, r: Request, entry: int) -> int:
        return r.pages[entry // self.page_size] * self.page_size + entry % self.page_size

    # ----- memory -----
    def _ensure_pages(self, r: Request, num_entries: int) -> None:
        """Give r pages for `num_entries` entries (and for pages not taken from the cache), evicting
        cached pages and, if that is not enough, preempting the youngest running requests (possibly r)."""
        while r.status is Status.RUNNING and len(r.pages) * self.page_size < num_entries:
            r.missing.append(len(r.pages))
            r.pages.append(-1)
        while r.status is Status.RUNNING and r.missing:
            page = self.kv.allocate()
            if page is None:
                self._preempt(self.running[-1])
            else:
                r.pages[r.missing.pop()] = page

    def _admit(self) -> list[Request]:
        failed = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            if r.plan is None:
                self._plan(r)
            ps = self.page_size
            matches = self.kv.match(r.page_keys[: r.plan.last_entry // ps])  # a page or None, per page
            num_pages = -(-len(r.entries) // ps)
            matched = [p for p in matches if p is not None]
            need = num_pages - len(matched) + 1  # +1: room to decode
            if need > self.kv.available(matched):
                if self.running:
                    break
                if need > self.kv.num_pages:  # can never fit: fail it rather than wait forever
                    self.waiting.popleft()
                    r.error = (f"the prompt needs {need} KV pages but the pool has {self.kv.num_pages}; "
                               "raise kv_cache_tokens")  # fmt: skip
                    failed.append(self._finish(r, "error"))
                    continue
            self.waiting.popleft()
            self.kv.acquire(matched)  # hold them before anything is evicted to make room
            have = [p < len(matches) and matches[p] is not None for p in range(num_pages)]
            r.pages = [matches[p] if have[p] else -1 for p in range(num_pages)]
            r.missing = [p for p in range(num_pages) if not have[p]]
            have_entry = [have[e // ps] for e in range(len(r.entries))]
            r.todo, r.cursor = entries_to_compute(r.plan, have_entry), 0
            resolved = set(r.todo)
            r.incomplete = {e // ps for e in range(len(r.entries)) if not have_entry[e] and e not in resolved}
            hits = sum(
                1
                for e, ok in zip(r.entries, have_entry)
                if ok and not e.is_copy and e.token_index < r.num_prompt
            )
            r.usage.cached_tokens = max(r.usage.cached_tokens, hits)
            self.counters["cache_hit_tokens"] += hits
            r.status = Status.RUNNING
            self.running.append(r)
            self._ensure_pages(r, len(r.entries))
        return failed

    def _plan(self, r: Request) -> None:
        """Plan the entries of r's tokens so far (the prompt, plus any output before a preemption)."""
        tokens = r.all_ids
        plan = plan_request(r.program, tokens)
        r.plan = plan
        r.entries, r.records = list(plan.entries), list(plan.records)
        r.page_keys = self.kv.keys(r.records, [e.position for e in r.entries])
        r.entry_pos = np.fromiter((e.position for e in plan.entries), np.int64, len(plan.entries))
        r.segment_arrays = {}
        r.decode_keys = list(plan.final_keys)
        r.next_pos = int(r.program.birth_positions([len(tokens)])[0])
        r.usage.drop_skipped_tokens = plan.num_skipped

    def _release(self, r: Request) -> None:
        """Publish r's computed full pages to the cache and drop r's hold on all its pages."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        pages = [p for p in r.pages if p >= 0]
        if pages:
            ps = self.page_size
            resolved = r.todo[r.cursor] if r.cursor < len(r.todo) else len(r.entries)
            for e in r.entries[len(r.records) : resolved]:  # decode entries: their tokens are known now
                if e.token_index >= r.num_tokens:
                    break
                r.records.append(record(r.plan.final_digest, r.token_at(e.token_index), e))
            done = min(min(resolved, len(r.records)) // ps, len(r.pages)) * ps
            live = set(r.decode_keys)
            dead = [not live.intersection(range(p, p + ps)) for p in range(0, done, ps)]
            keys = self.kv.keys(r.records[:done], [e.position for e in r.entries[:done]], dead)
            publish = [None if p in r.incomplete or r.pages[p] < 0 else key for p, key in enumerate(keys)]
            self.kv.release(pages, dict(zip((r.pages[p] for p in range(len(publish))), publish)))
        r.pages, r.missing = [], []
        if r.row >= 0:
            self.rows.append(r.row)
            r.row = -1

    def _preempt(self, r: Request) -> None:
        self.counters["preemptions"] += 1
        self._release(r)
        r.status, r.plan = Status.WAITING, None
        self.waiting.appendleft(r)

    def _finish(self, r: Request, reason: str | None) -> Request:
        self._release(r)
        r.status = Status.FINISHED
        r.finish_reason = reason
        r.usage.prompt_tokens = r.num_prompt
        r.usage.completion_tokens = len(r.output_ids)
        return r

    # ----- observability -----
    def check(self) -> None:
        self.kv.check([r.pages for r in self.running])

    def stats(self) -> dict:
        c = self.counters
        per_token = (
            c["decode_kv_entries"] * self.kv_bytes_per_entry / c["decode_tokens"] if c["decode_tokens"] else 0
        )
        return {**self.kv.stats(), **c, "running": len(self.running), "waiting": len(self.waiting),
                "kv_bytes_read_per_decode_token": per_token}  # fmt: skip
