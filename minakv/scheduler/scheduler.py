"""Continuous batching over the paged KV pool.

The engine drives one step as three calls, as nano-vllm's `LLMEngine` and vLLM's `EngineCore` do:

    batch = scheduler.schedule()     admit waiting requests, build one ForwardBatch (decode tokens first,
                                     then prefill chunks under the token budget)
    worker.launch(batch)             the forward and the sampled tokens (collected one step later)
    changed = scheduler.update(batch, result)   apply the tokens, finish requests

Finished requests publish their full pages to the cache index, so a later request with the same history
(tokens *and* operations) starts from them. When pages run out, unreferenced cached pages are evicted first;
if that is not enough the youngest running request is preempted (its computed pages go to the cache, and it
is recomputed later, usually from those very pages).
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Callable

import numpy as np

from minakv.cache.kvcache import KVCache
from minakv.cache.plan import plan_request
from minakv.cache.plan_memo import PlanMemo
from minakv.config import EngineConfig
from minakv.scheduler.admission import admission, publishable
from minakv.scheduler.batching import add_decode, add_masks, add_prefill
from minakv.scheduler.request import Request, Status
from minakv.scheduler.stops import apply_token
from minakv.worker.batch import ForwardBatch
from minakv.worker.worker import StepResult

# History tokens `_admit` plans in one call while other requests run (~2 ms of planning); beyond that,
# planning waits for `prepare`, which runs while the device computes the step just launched.
PLAN_INLINE_TOKENS = 8192


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_pages: int,
        kv_bytes_per_entry: int,
        tokenizer,
        max_model_len: int,
        on_allocate: Callable[[int], None] | None = None,
    ) -> None:
        """`on_allocate(page)`: told of every page handed out (the prefill/decode workers' coherence table:
        a fresh page holds nothing either side must send, minakv/worker/coherence.py)."""
        self.config = config
        self.on_allocate = on_allocate
        # separate prefill and decode workers: a penalised request's first decode step refills its penalty row
        # on the decode worker, so it waits for its first token (sampled on the prefill worker) to be known
        self.split = config.disaggregated
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = config.page_size
        self.kv = KVCache(num_pages, config.page_size, config.enable_prefix_cache)
        self.plans = PlanMemo(config.page_size)  # an agent's next round plans only what is new
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows = list(range(config.max_num_seqs))[::-1]  # free rows of the worker's key table
        self.penalty_rows = list(range(config.max_num_seqs))[::-1]  # free rows of its penalty tables
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

    def fail_all(self, message: str, publish: bool = True, lost: bool = False) -> list[Request]:
        """End every request (reason "error") so no caller waits forever; after a step that raised, pass
        publish=False: pages of that step were never computed. `lost`: a worker died (their last output is
        then `Unavailable`: the server answers 503)."""
        self.counters["errors"] += 1
        failed = [*self.waiting, *self.running]
        for r in failed:
            r.error, r.lost = message, lost
            self._finish(r, "error", publish)
        return failed

    def quarantine(self, message: str) -> list[Request]:
        """After a step raised: nobody knows which request caused it, so every running request goes back to
        the waiting queue as a suspect, keeping its output so far but publishing nothing of the failed steps
        (their KV may be half written), and each suspect then runs alone; a suspect that fails alone is the
        cause and ends with `message` (returned). The others continue as if preempted."""
        culprits = [r for r in self.running if r.suspect]  # running alone when it failed
        for r in culprits:  # (its pages of the failed step were never computed: publish nothing)
            r.error = message
            self._finish(r, "error", publish=False)
        for r in self.waiting:  # tokens of preempted requests still on the device are lost too
            r.pending = 0
        for r in reversed(list(self.running)):
            self._release(r, publish=False)
            r.status, r.plan, r.shared, r.pending, r.suspect = Status.WAITING, None, False, 0, True
            self.waiting.appendleft(r)
        return culprits

    # ----- one step: schedule, (the worker runs the batch), update -----
    def schedule(self) -> ForwardBatch:
        """Admit what fits and build the next forward batch (it may be empty: nothing to compute). The
        requests' progress is committed here, so the next batch can be scheduled before this one's tokens
        are back (the overlap loop); their tokens then reach the worker as references to device rows."""
        self.failed += self._admit()
        decoding = [r for r in self.running if r.cursor == len(r.todo) and self._decodes_next(r)]
        for r in decoding:  # reserve decode pages first: this may preempt the youngest requests
            if r.status is Status.RUNNING and (r.missing or r.num_entries >= len(r.pages) * self.page_size):
                self._ensure_pages(r, r.num_entries + 1)  # (one page a page_size steps)
        batch = ForwardBatch()
        for r in decoding:
            if r.status is Status.RUNNING:
                add_decode(batch, r, self.page_size, self.rows, self.penalty_rows, self.split)
                self.counters["decode_tokens"] += 1
                self.counters["decode_kv_entries"] += r.row_len
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        for r in self.running:
            if budget <= 0:
                break
            if r.cursor < len(r.todo):
                r.cursor, computed = add_prefill(batch, r, self.page_size, budget, self.penalty_rows)
                budget -= computed
                self.counters["prefill_tokens"] += computed
        add_masks(batch)
        return batch

    def update(self, batch: ForwardBatch, result: StepResult) -> list[Request]:
        """Apply a step's sampled tokens (in sample-row order); returns the requests with news for their
        callers (new tokens, or finished)."""
        changed, self.failed = self.failed, []
        for r, token, logprob in zip(batch.scheduled, result.tokens, result.logprobs):
            r.pending -= 1
            if r.status is Status.FINISHED:  # ended while this step ran (abort, or a token of the last step)
                continue
            self.counters["output_tokens"] += 1
            r.suspect = False  # a step of it succeeded alone: it rejoins the batch
            if apply_token(r, token, logprob, self.tokenizer, self.max_model_len):
                self._finish(r, r.finish_reason)
            elif r.status is Status.RUNNING and not r.shared and r.cursor >= len(r.todo):
                self._share(r)
            changed.append(r)
        return changed

    def _decodes_next(self, r: Request) -> bool:
        """May r (its prompt computed) decode in the next step? Not if it ends by length once its pending
        tokens arrive; not while a token is pending if it has a grammar: the tokens it may sample next
        depend on that token, so a constrained request decodes every other step under overlap."""
        if self.split and r.row < 0 and r.pending > 0 and r.params.penalized:
            return False  # its first decode refills the decode worker's penalty row: wait for the token
        return not self._done_by_length(r) and not (r.grammar is not None and r.pending > 0)

    def _done_by_length(self, r: Request) -> bool:
        """Will r end by length once its pending tokens arrive? Then it needs no further step."""
        n = len(r.output_ids) + r.pending
        limit = r.program.max_positions  # the last of the n tokens would be born at next_pos + n - 1
        return n > 0 and (
            n >= r.params.max_tokens
            or r.program.next_pos + n >= self.max_model_len
            or (limit is not None and r.program.next_pos + n - 1 >= limit)
        )

    # ----- memory -----
    def _ensure_pages(self, r: Request, num_entries: int) -> None:
        """Give r pages for `num_entries` entries (and for pages not taken from the cache), evicting
        cached pages and, if that is not enough, preempting the youngest running requests (possibly r)."""
        grow = -(-num_entries // self.page_size) - len(r.pages)
        if r.status is Status.RUNNING and grow > 0:  # (a decoding request: one page per page_size steps)
            r.missing += range(len(r.pages), len(r.pages) + grow)
            r.pages = np.concatenate([r.pages, np.full(grow, -1, dtype=np.int64)])
        while r.status is Status.RUNNING and r.missing:
            # as many as it needs at once: the same pages, in the same order, as one allocation at a time
            pages = self.kv.allocate_many(len(r.missing))
            for page in pages:
                r.fresh.append(r.missing.pop())
                r.pages[r.fresh[-1]] = page
                if self.on_allocate is not None:
                    self.on_allocate(page)
            if r.missing:  # nothing more to evict
                self._preempt(self.running[-1])

    def _admit(self) -> list[Request]:
        failed: list[Request] = []
        if not self.waiting:  # (the sum below is per running request: skip it when there is nothing to admit)
            return failed
        # prefill work already admitted: planning more than the next step can compute only delays it (the
        # rest is planned during later steps, while the device computes these)
        queued = sum(self._tokens_left(r) for r in self.running)
        planned = 0  # history tokens planned in this call
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            if queued >= self.config.max_num_batched_tokens or r.pending:
                break  # (a request preempted just now may still have a token on the device: plan it after)
            if any(x.suspect for x in self.running) or (r.suspect and self.running):
                break  # a suspect runs alone (see quarantine)
            if r.plan is None:
                # Long histories take milliseconds to plan: while others run, leave them to `prepare`,
                # right after the next launch, so the device does not wait; short prompts go at once.
                if self.running and planned + r.num_tokens > PLAN_INLINE_TOKENS:
                    break
                planned += r.num_tokens
                self._plan(r)
            a = admission(r, self.kv)
            need = len(a.missing) + 1  # +1: room to decode
            if need > self.kv.available(a.matched):
                if self.running:
                    break
                if need > self.kv.num_pages:  # can never fit: fail it rather than wait forever
                    self.waiting.popleft()
                    r.error = (f"the prompt needs {need} KV pages but the pool has {self.kv.num_pages}; "
                               "raise kv_cache_tokens")  # fmt: skip
                    failed.append(self._finish(r, "error"))
                    continue
            self.waiting.popleft()
            self.kv.acquire(a.matched)  # hold them before anything is evicted to make room
            self.kv.retire(a.unread)
            r.pages, r.missing, r.incomplete = a.pages, a.missing, a.incomplete
            r.todo, r.cursor = a.todo, 0
            if a.hits >= r.usage.cached_tokens:  # (re-admitted after a preemption: keep the best admission)
                r.usage.cached_tokens = a.hits
                r.usage.drop_skipped_tokens = r.plan.num_skipped + a.skipped
            self.counters["cache_hit_tokens"] += a.hits
            r.status = Status.RUNNING
            self.running.append(r)
            self._ensure_pages(r, r.num_entries)
            queued += self._tokens_left(r)
        return failed

    def prepare(self, limit: int = 2) -> None:
        """Plan the next waiting requests ahead of their admission. The engine calls this right after
        launching a step, so planning (a walk over a long history's events: milliseconds) overlaps the
        device's work instead of holding back the next launch. A plan depends only on the request and the
        memo, so planning early changes nothing but when it happens."""
        for r in itertools.islice(self.waiting, limit):
            if r.plan is None and not r.pending:
                self._plan(r)

    @staticmethod
    def _tokens_left(r: Request) -> int:
        """Tokens r still has to compute (re-rotation copies are not forward work)."""
        if r.cursor >= len(r.todo):  # decoding
            return 0
        return int(np.count_nonzero(r.plan.source[r.todo[r.cursor :]] < 0))

    def _plan(self, r: Request) -> None:
        """Plan the entries of r's tokens so far (the prompt, plus any output before a preemption)."""
        tokens = r.all_ids
        r.plan = plan = plan_request(r.program, tokens, self.plans)
        r.decode_tokens, r.decode_positions = array("q"), array("q")
        r.page_keys = plan.keys
        r.next_pos = int(r.program.birth_positions([len(tokens)])[0])

    def _share(self, r: Request) -> None:
        """Publish r's computed full pages as soon as its prompt is done, not only when it ends, so requests
        arriving meanwhile with the same prefix (n samples of one prompt, agents sharing a system prompt)
        read them instead of computing them again. Full pages never change, so sharing them early is safe."""
        publish, _ = publishable(r, self.page_size)
        self.kv.publish(publish)
        r.shared = True

    def _release(self, r: Request, publish: bool = True) -> None:
        """Publish r's computed full pages to the cache (unless told not to) and drop r's hold on all its
        pages."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        held = np.asarray(r.pages, dtype=np.int64)
        pages = held[held >= 0].tolist()
        if pages:
            offered, dead = publishable(r, self.page_size) if publish else ({}, [])
            self.kv.retire(dead)
            self.kv.release(pages, offered)
        r.pages, r.missing, r.fresh = np.zeros(0, dtype=np.int64), [], []
        if r.row >= 0:
            self.rows.append(r.row)
            r.row = -1
        if r.penalty_row >= 0:
            self.penalty_rows.append(r.penalty_row)
            r.penalty_row = -1

    def _preempt(self, r: Request) -> None:
        self.counters["preemptions"] += 1
        self._release(r)
        r.status, r.plan, r.shared = Status.WAITING, None, False
        self.waiting.appendleft(r)

    def _finish(self, r: Request, reason: str | None, publish: bool = True) -> Request:
        self._release(r, publish)
        r.status = Status.FINISHED
        r.finish_reason = reason
        r.usage.prompt_tokens = r.num_prompt
        r.usage.completion_tokens = len(r.output_ids)
        return r

    # ----- observability -----
    def check(self) -> None:
        self.kv.check([r.pages.tolist() for r in self.running])

    def stats(self) -> dict:
        c = self.counters
        per_token = (
            c["decode_kv_entries"] * self.kv_bytes_per_entry / c["decode_tokens"] if c["decode_tokens"] else 0
        )
        return {**self.kv.stats(), **c, "running": len(self.running), "waiting": len(self.waiting),
                "kv_bytes_read_per_decode_token": per_token}  # fmt: skip
