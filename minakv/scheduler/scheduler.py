"""Continuous batching over the paged KV pool.

Each `step()` admits waiting requests while the pool can hold them, builds one forward batch (a decode token
for every request that is generating, then prefill chunks under the token budget), runs it on the worker and
applies the sampled tokens. Finished requests publish their full pages to the cache index, so a later request
with the same history (tokens *and* operations) starts from them. When pages run out, unreferenced cached
pages are evicted first; if that is not enough the youngest running request is preempted (its computed pages
go to the cache, and it is recomputed later, usually from those very pages).
"""

from __future__ import annotations

from collections import deque

from minakv.config import EngineConfig
from minakv.scheduler.batch import ForwardBatch
from minakv.scheduler.kvcache import KVCache
from minakv.scheduler.plan import Entry, plan_request, record
from minakv.scheduler.request import Request, Status
from minakv.scheduler.stops import apply_token
from minakv.scheduler.worker import Worker


class Scheduler:
    def __init__(self, config: EngineConfig, worker: Worker, num_pages: int, tokenizer, max_model_len: int):
        self.config = config
        self.worker = worker
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = config.page_size
        self.kv = KVCache(num_pages, config.page_size, config.enable_prefix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.released: list[str] = []  # finished request ids whose sampler state the worker can drop
        names = ("requests", "prompt_tokens", "output_tokens", "cache_hit_tokens", "preemptions", "decode_tokens",
                 "decode_kv_entries", "errors")  # fmt: skip
        self.counters = dict.fromkeys(names, 0)
        k = worker.k_cache
        self.kv_bytes_per_entry = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()

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

    # ----- one step -----
    def step(self) -> list[Request]:
        changed = self._admit()
        decoding = [r for r in self.running if r.num_done == len(r.entries)]
        for r in decoding:  # reserve decode pages first: this may preempt the youngest requests
            if r.status is Status.RUNNING:
                self._ensure_pages(r, len(r.entries) + 1)
        batch = ForwardBatch()
        scheduled: list[tuple[Request, int, bool]] = []  # (request, entries done after the step, samples)
        for r in decoding:
            if r.status is Status.RUNNING:
                self._schedule_decode(r, batch)
                scheduled.append((r, len(r.entries), True))
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        for r in self.running:
            if budget <= 0:
                break
            if r.num_done < len(r.entries) and r not in decoding:
                end, computed, samples = self._schedule_prefill(r, batch, budget)
                budget -= computed
                scheduled.append((r, end, samples))
        batch.release_ids, self.released = self.released, []
        result = self.worker.step(batch)
        row = 0
        for r, end, samples in scheduled:
            r.num_done = end
            if not samples:
                continue
            token, logprob = result.tokens[row], result.logprobs[row]
            row += 1
            self.counters["output_tokens"] += 1
            if apply_token(r, token, logprob, self.tokenizer, self.max_model_len):
                self._finish(r, r.finish_reason)
            changed.append(r)
        return changed

    def _schedule_decode(self, r: Request, batch: ForwardBatch) -> None:
        """Feed the last sampled token: one new entry at the next position, reading all active keys."""
        t = len(r.all_ids) - 1
        entry = Entry(t, r.next_pos)
        r.entries.append(entry)
        r.records.append(record(r.plan.final_digest, r.all_ids[t], entry))
        r.decode_keys.append(len(r.entries) - 1)
        r.next_pos += 1
        batch.input_ids.append(r.all_ids[t])
        batch.positions.append(entry.position)
        batch.slots.append(self._slot(r, len(r.entries) - 1))
        batch.add_keys([(self._slot(r, k), r.entries[k].position) for k in r.decode_keys])
        batch.num_decode += 1
        self._sample_last(batch, r)
        self.counters["decode_tokens"] += 1
        self.counters["decode_kv_entries"] += len(r.decode_keys)

    def _schedule_prefill(self, r: Request, batch: ForwardBatch, budget: int) -> tuple[int, int, bool]:
        """Copies first (re-rotations run before the forward), then computed tokens up to the budget,
        stopping before the next copy (its source may be computed in this very batch).
        Returns (entries done after the step, tokens computed, whether a token is sampled)."""
        e = r.num_done
        while e < len(r.entries) and r.entries[e].is_copy:
            entry = r.entries[e]
            src = r.entries[entry.source]
            values = (self._slot(r, entry.source), self._slot(r, e), src.position, entry.position)
            for column, value in zip(batch.rerotate, values):
                column.append(value)
            r.usage.repos_tokens += 1
            e += 1
        start, samples = e, False
        while e < len(r.entries) and not r.entries[e].is_copy and e - start < budget:
            seg, piece = r.entries[e].segment, e
            while e < len(r.entries) and r.entries[e].segment == seg and e - start < budget:
                entry = r.entries[e]
                batch.input_ids.append(r.all_ids[entry.token_index])
                batch.positions.append(entry.position)
                batch.slots.append(self._slot(r, e))
                e += 1
            # the segment's outside keys, plus its own members computed in earlier steps
            outside = r.plan.segment_keys[seg] + list(range(r.plan.segment_start[seg], piece))
            batch.add_keys([(self._slot(r, k), r.entries[k].position) for k in outside])
            batch.seg_q_indptr.append(batch.num_tokens - batch.num_decode)
            if e - 1 == r.plan.last_entry:
                samples = True
                self._sample_last(batch, r)
        return e, e - start, samples

    @staticmethod
    def _sample_last(batch: ForwardBatch, r: Request) -> None:
        batch.sample_rows.append(batch.num_tokens - 1)
        batch.sample_ids.append(r.request_id)
        batch.sample_params.append(r.params)

    def _slot(self, r: Request, entry: int) -> int:
        return r.pages[entry // self.page_size] * self.page_size + entry % self.page_size

    # ----- memory -----
    def _ensure_pages(self, r: Request, num_entries: int) -> None:
        """Give r pages for `num_entries` entries, evicting cached pages and, if that is not enough,
        preempting the youngest running requests (possibly r itself)."""
        while r.status is Status.RUNNING and len(r.pages) * self.page_size < num_entries:
            page = self.kv.allocate()
            if page is not None:
                r.pages.append(page)
            else:
                self._preempt(self.running[-1])

    def _admit(self) -> list[Request]:
        failed = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            if r.plan is None:
                self._plan(r)
            matched = self.kv.match(r.page_keys[: r.plan.last_entry // self.page_size])
            need = -(-len(r.entries) // self.page_size) - len(matched) + 1  # +1: room to decode
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
            r.pages = self.kv.acquire(matched)
            r.num_done = len(matched) * self.page_size
            hits = sum(1 for e in r.entries[: r.num_done] if not e.is_copy and e.token_index < r.num_prompt)
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
        r.decode_keys = list(plan.final_keys)
        r.next_pos = int(r.program.birth_positions([len(tokens)])[0])
        r.usage.drop_skipped_tokens = plan.num_skipped

    def _release(self, r: Request) -> None:
        """Publish r's computed full pages to the cache and drop r's hold on all its pages."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.pages:
            done = min(r.num_done // self.page_size, len(r.pages)) * self.page_size
            live = set(r.decode_keys)
            dead = [
                not live.intersection(range(p, p + self.page_size)) for p in range(0, done, self.page_size)
            ]
            positions = [e.position for e in r.entries[:done]]
            self.kv.release(r.pages, self.kv.keys(r.records[:done], positions, dead))
        r.pages = []
        self.released.append(r.request_id)

    def _preempt(self, r: Request) -> None:
        self.counters["preemptions"] += 1
        self._release(r)
        r.status, r.plan, r.num_done = Status.WAITING, None, 0
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
