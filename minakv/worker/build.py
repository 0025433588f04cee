"""Building a worker: the model a name refers to, the size of its KV pool, and the `Worker` around them.

The engine (its worker in process) and the worker processes (minakv/worker/child.py) both build through
here, so a worker process holds exactly what an in-process engine would. `start_worker` is the engine's
one call: in process, or in worker processes (one, or a prefill/decode pair) that load the model
themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minakv.config import EngineConfig
from minakv.model import CausalLM, default_device_dtype, load_model
from minakv.ops.triton_util import enable_pdl
from minakv.parallel import SINGLE, Parallel
from minakv.presets.real import build_dummy, dummy_tokenizer
from minakv.text.tokenizer import Tokenizer
from minakv.worker.disagg import DisaggWorkers
from minakv.worker.process import WorkerProcess
from minakv.worker.worker import Worker, kv_bytes_per_token


def pool_tokens(config: EngineConfig, model_bytes_per_token: int, device: torch.device) -> int:
    """How many KV tokens to allocate when the caller did not say."""
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.memory_fraction
    else:  # a share of RAM, capped: a CPU engine is for tests and small models
        budget = min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.1, 2 << 30)
    return max(config.page_size, int(budget // model_bytes_per_token))


def load_model_by_name(config: EngineConfig, parallel: Parallel = SINGLE) -> CausalLM:
    """The model `config.model` names (a preset, a directory, a hub id; random weights if load_format is
    "dummy") on `config.device` in `config.dtype`; under `parallel`, this rank's share only. The engine and
    worker processes both load through here."""
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype
    device, dtype = default_device_dtype(config.device, dtype)
    if config.load_format == "dummy":
        return build_dummy(config.model, device, dtype, parallel=parallel)
    from minakv.presets import resolve_model

    return load_model(resolve_model(config.model), device=device, dtype=dtype, parallel=parallel)


def load_tokenizer(config: EngineConfig, arch: str) -> Tokenizer | None:
    """The tokenizer of `config.model`, or None (the engine then takes token ids)."""
    if config.load_format == "dummy":
        return dummy_tokenizer(arch)
    from minakv.presets import resolve_model

    path = resolve_model(config.model)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None


def make_worker(config: EngineConfig, model: CausalLM) -> tuple[Worker, int, int, int]:
    """The worker for `model` with its KV pool sized from `config`: (worker, pages, KV bytes per token,
    max_model_len). Under tensor / expert parallelism every rank of the model takes the smallest pool any
    of them can hold, so a page number means the same slots on each; CUDA graphs stay off there for now
    (graphs around NCCL collectives are untested)."""
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    enable_pdl(config.pdl, device)  # (a process-wide switch: the kernels read it at launch)
    limit = model.config.max_position_embeddings
    max_model_len = min(config.max_model_len or limit, limit)
    kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else dtype
    per_token = kv_bytes_per_token(model, kv_dtype)
    par = getattr(model, "parallel", SINGLE)
    num_pages = max(1, par.min_over_ranks(pool_tokens(config, per_token, device)) // config.page_size)
    num_slots = num_pages * config.page_size
    max_keys = min(num_slots, max_model_len) + 1  # the most keys one decode token can read
    graphs = config.cuda_graphs and par.world == 1
    worker = Worker(model, num_slots, config.max_num_seqs, max_keys, kv_dtype, cuda_graphs=graphs)
    return worker, num_pages, per_token, max_model_len


@dataclass
class Started:
    """What the engine needs from its worker(s): the worker, the model (in process: the model itself; in
    worker processes: a stand-in with its config), the tokenizer, and the KV pool's size."""

    worker: Worker | WorkerProcess | DisaggWorkers
    model: Any
    model_name: str
    tokenizer: Tokenizer | None
    num_pages: int
    kv_bytes_per_token: int
    max_model_len: int
    on_allocate: Callable | None = None  # the scheduler's hook for fresh pages (a prefill/decode pair)


def start_worker(config: EngineConfig, model: str | CausalLM, tokenizer: Tokenizer | None) -> Started:
    """The engine's worker for `model` (a name, or an already built `CausalLM` for in-process use)."""
    if config.worker_processes:  # the model and its KV live in worker processes (one per rank)
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError("a worker process loads its model by name: pass a preset, directory or hub id")
        # start the children and wait until their models are loaded: one worker, or a prefill/decode pair
        # whose transfers follow the pages the scheduler hands out (docs/workers.md); either one is
        # world = max(tp, ep) ranks under tensor / expert parallelism (docs/parallel.md)
        worker = DisaggWorkers(config) if config.disaggregated else WorkerProcess(config)
        return Started(
            worker, worker.model, str(model), tokenizer or load_tokenizer(config, worker.model.config.arch),
            worker.num_pages, worker.kv_bytes_per_token, worker.max_model_len,
            on_allocate=worker.fresh if config.disaggregated else None,
        )  # fmt: skip
    if isinstance(model, CausalLM):
        name = "custom"
    else:
        model, name = load_model_by_name(config), str(model)
        tokenizer = tokenizer or load_tokenizer(config, model.config.arch)
    worker, num_pages, per_token, max_model_len = make_worker(config, model)
    return Started(worker, model, name, tokenizer, num_pages, per_token, max_model_len)
