"""The `Engine`: the one public entry point that the server and Python users share.

    engine = Engine("tiny-gpt-oss")
    outs = engine.generate(["Hello", [1, 2, 3], {"message_tokens": [[...], [...]], "cache": {"drop": {"1": [0]}}}])

One step is `scheduler.schedule()` -> `worker.launch(batch)` -> `scheduler.update(...)` of the step before,
so the host prepares step N + 1 while the device runs step N (`overlap=False`: of the same step).
`generate` drives steps synchronously. `stream` (async) hands requests to a background thread that
steps the scheduler whenever there is work, and delivers increments back to the event loop. Requests and
aborts reach that thread through its mailbox (minakv/mailbox.py), so the scheduler itself is only ever
touched by one thread at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Self

from minakv.cache.validate import CacheOpError
from minakv.config import EngineConfig
from minakv.gc_pauses import collect_when_due, quiet_gc
from minakv.mailbox import Mailbox, Overloaded
from minakv.model import CausalLM
from minakv.outputs import RequestOutput
from minakv.params import SamplingParams
from minakv.prompt import make_request
from minakv.scheduler.request import Request, Unavailable
from minakv.scheduler.scheduler import Scheduler
from minakv.text.tokenizer import Tokenizer
from minakv.worker.batch import ForwardBatch
from minakv.worker.build import start_worker
from minakv.worker.disagg import DisaggWorkers
from minakv.worker.process import WorkerDied, WorkerProcess
from minakv.worker.worker import Launched

logger = logging.getLogger(__name__)


__all__ = ["CacheOpError", "Engine", "Overloaded", "Unavailable", "WorkerDied"]


Prompt = str | list[int] | dict[str, Any]


class Engine:
    def __init__(
        self, model: str | CausalLM = "tiny-gpt-oss", tokenizer: Tokenizer | None = None, **kwargs: Any
    ):
        """`model`: a local Hugging Face directory, a hub repo id, a built-in preset name, or an already
        built `CausalLM` (tests and benchmarks; pass its `tokenizer` if it has one)."""
        self.config = config = EngineConfig(
            model=str(model) if isinstance(model, (str, Path)) else "custom", **kwargs
        )
        config.check()
        quiet_gc()
        started = start_worker(config, model, tokenizer)
        self.worker, self.model, self.model_name = started.worker, started.model, started.model_name
        self.tokenizer, self.max_model_len = started.tokenizer, started.max_model_len
        self.scheduler = Scheduler(
            config,
            started.num_pages,
            started.kv_bytes_per_token,
            self.tokenizer,
            self.max_model_len,
            on_allocate=started.on_allocate,
        )
        self.mailbox = Mailbox()  # new requests, aborts and stream outputs between callers and the thread
        self._step_lock = threading.Lock()  # held while the scheduler changes: stats() sees a whole step
        self._thread: threading.Thread | None = None
        self._inflight: tuple[ForwardBatch, Launched] | None = None  # the step the device is running
        self._stopped = False  # the background loop must exit

    # ----- synchronous use -----
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if self.mailbox.closing:
            raise Overloaded("the engine is shutting down")
        requests = [self._make(p, sp) for p, sp in zip(prompts, params_list)]
        if self._thread is not None:  # the background loop owns the scheduler: go through it
            return asyncio.run(self._generate_async(requests))
        for r in requests:
            self.scheduler.add(r)
        show = use_tqdm if use_tqdm is not None else len(requests) > 8
        bar = _progress(len(requests)) if show else None
        done: dict[str, RequestOutput] = {}
        start, tokens = time.perf_counter(), 0
        while len(done) < len(requests):
            collect_when_due(idle=False)
            try:
                changed = self.step()
            except Exception as exc:  # leave no half-run request behind: the engine stays usable
                self._inflight = None
                if isinstance(exc, WorkerDied):
                    self._lose_worker(exc)
                    self._restart_worker()
                else:
                    self.scheduler.fail_all(f"internal error: {exc!r}", publish=False)
                raise
            for r in changed:
                if r.finish_reason is not None:
                    done[r.request_id] = r.output(incremental=False)
                    tokens += len(r.output_ids)
                    if bar is not None:
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r.request_id] for r in requests]

    async def _generate_async(self, requests: list[Request]) -> list[RequestOutput]:
        async def collect(r: Request) -> RequestOutput:
            async for out in self._stream_request(r):
                if out.finish_reason is not None:
                    return r.output(incremental=False)
            raise RuntimeError("stream ended without finishing")

        return list(await asyncio.gather(*(collect(r) for r in requests)))

    # ----- asynchronous use -----
    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield increments (new tokens and text); the last one has `finish_reason` and the usage."""
        request = self._make(prompt, params or SamplingParams(), request_id)
        async for out in self._stream_request(request):
            yield out

    async def _stream_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self.mailbox.submit(request, queue, self.scheduler.num_waiting, self.config.max_queued_requests)
        self._ensure_thread()
        try:
            while True:
                out: RequestOutput = await queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:  # the consumer went away (client disconnected) or we finished: stop the request
            self.mailbox.close_stream(request)

    def abort(self, request_id: str) -> None:
        self.mailbox.abort(request_id)
        if self._thread is None:  # no background loop: apply it now
            self._drain()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests (submitting raises `Overloaded`), let those in flight finish for up to
        `timeout` seconds, end the rest (reason "error", saying the engine shut down; streams get that final
        output) and stop the background thread. Idempotent; the engine is not usable afterwards."""
        self.mailbox.close()
        deadline = time.monotonic() + timeout
        while self._thread is not None and time.monotonic() < deadline:
            if not (self.mailbox.has_inbox() or self.scheduler.has_work()):
                break
            time.sleep(0.02)
        self._stopped = True
        self.mailbox.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._step_lock:
            self._inflight = None
            for r in self.mailbox.take()[0]:
                self.scheduler.add(r)
            ended = self.scheduler.fail_all("the engine shut down") if self.scheduler.has_work() else []
        self.mailbox.deliver(ended)
        if isinstance(self.worker, (WorkerProcess, DisaggWorkers)):
            self.worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def arch(self) -> str:
        """The model family ("gpt_oss" or "minimax_m2"): it decides how output text is parsed."""
        return self.model.config.arch

    def stats(self) -> dict[str, Any]:
        with self._step_lock:
            stats = self.scheduler.stats()
            if isinstance(self.worker, DisaggWorkers):  # pages and bytes sent between the two workers
                stats.update(self.worker.stats())
            return stats

    def check(self) -> None:
        """Assert the pool's accounting is exact (used by tests after every scenario)."""
        with self._step_lock:
            self.scheduler.check()

    def step(self) -> list[Request]:
        """One engine step: schedule a batch, launch it on the worker, apply the results of the step before
        (overlap: the host prepares step N + 1 while the device runs step N; without it, of this very step).
        Returns the requests with news (new tokens, or finished). Only one thread steps at a time."""
        batch = self.scheduler.schedule()
        step = (batch, self.worker.launch(batch)) if batch.num_tokens or batch.num_copies else None
        self.scheduler.prepare()  # while the device runs: plan the requests admission takes next
        previous, self._inflight = self._inflight, step
        changed = self.scheduler.update(previous[0], self.worker.collect(previous[1])) if previous else []
        if not self.config.overlap:
            changed += self._flush()
        return changed

    def _flush(self) -> list[Request]:
        """Apply the step in flight, if any."""
        previous, self._inflight = self._inflight, None
        return self.scheduler.update(previous[0], self.worker.collect(previous[1])) if previous else []

    # ----- internals -----
    def _make(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        params.check()
        request = make_request(prompt, params, self.tokenizer, self.model.config, self.max_model_len)
        capacity = self.scheduler.kv.num_pages * self.config.page_size
        if request.num_prompt >= capacity:
            raise ValueError(
                f"the prompt has {request.num_prompt} tokens but the KV pool holds {capacity}; "
                "start the engine with a larger kv_cache_tokens"
            )
        if request_id is not None:
            request.request_id = request_id
        return request

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="minakv-engine", daemon=True)
            self._thread.start()

    def _drain(self) -> list[Request]:
        """Move new requests and aborts into the scheduler; returns the requests aborted."""
        inbox, aborts = self.mailbox.take()
        with self._step_lock:
            for r in inbox:
                self.scheduler.add(r)
            return [r for r in map(self.scheduler.abort, aborts) if r is not None]

    def _loop(self) -> None:
        while not self._stopped:
            changed = self._drain()
            if self.scheduler.has_work():
                try:
                    with self._step_lock:
                        changed += self.step()
                except WorkerDied as exc:  # tell its requests at once; restarting takes seconds
                    with self._step_lock:
                        changed += self._lose_worker(exc)
                    self.mailbox.deliver(changed)
                    self._restart_worker()
                    continue
                except Exception as exc:
                    logger.exception("engine step failed; its requests are retried one by one")
                    with self._step_lock:
                        self._inflight = None  # its tokens are lost; the requests sample them again
                        try:
                            changed += self.scheduler.quarantine(f"internal error: {exc!r}")
                        except Exception:  # the thread must live on: its streams wait for it
                            logger.exception("quarantine failed; ending every request")
                            changed += self.scheduler.fail_all(f"internal error: {exc!r}", publish=False)
            elif not changed:
                collect_when_due(idle=True)
                self.mailbox.wake.wait(timeout=0.5)
                self.mailbox.wake.clear()
            self.mailbox.deliver(changed)
            collect_when_due(idle=False)

    def _lose_worker(self, exc: WorkerDied) -> list[Request]:
        """The worker process died, and every KV page with it: end every request the scheduler holds
        (reason "error"; their pages of the lost steps publish nothing) and forget every cached page, so the
        accounting stays exact and nothing reads KV that is gone. Returns the ended requests."""
        action = "shutting down" if self.mailbox.closing else self.worker.restart_note
        logger.error(
            "%s: ending %d requests, clearing the KV cache, %s", exc, len(self.scheduler.running), action
        )
        self._inflight = None
        ended = self.scheduler.fail_all(f"{exc}; the engine is {action}", publish=False, lost=True)
        self.scheduler.kv.clear()
        return ended

    def _restart_worker(self) -> None:
        """Start a fresh worker process after `_lose_worker`; if that fails, refuse new requests."""
        if self.mailbox.closing:
            return
        try:  # (not under the step lock: stats() must answer meanwhile; only this thread uses the worker)
            self.worker.restart()
            logger.warning(
                "worker processes restarted (pids %s); the KV cache starts empty", self.worker.pids
            )
        except Exception:
            logger.exception("the worker processes could not be restarted: the engine takes no new requests")
            self.mailbox.close()


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
