"""The engine's configuration: one flat dataclass, filled from `Engine(...)` keywords or CLI flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str = "tiny-gpt-oss"  # local HF directory, hub repo id, or a built-in preset name
    # "auto": the checkpoint's weights; "dummy": random weights in the checkpoint's own precision, from a
    # directory's config.json or a real model's shape (gpt-oss-20b, gpt-oss-120b, minimax-m2), nothing read
    load_format: str = "auto"
    device: str | None = None  # default: cuda when available, else cpu
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    page_size: int = 16  # KV slots per page; any size >= 1
    # "auto": the model's dtype; "fp8": float8_e4m3fn K/V (unscaled, as vLLM's default fp8 cache), half the
    # bytes of bf16 per token; attention widens it in registers (tolerance: tests/test_kv_fp8.py)
    kv_cache_dtype: str = "auto"
    kv_cache_tokens: int | None = None  # pool size in tokens; default: what memory allows
    max_model_len: int | None = None  # longest prompt + generation; default: the model's limit
    max_num_seqs: int = 64  # requests decoding at once
    max_num_batched_tokens: int = 2048  # token budget of one forward (chunked prefill cuts prompts to fit)
    max_queued_requests: int = 1024  # waiting requests before submit raises Overloaded
    enable_prefix_cache: bool = True  # publish finished states and match new requests against them
    cuda_graphs: bool = True  # replay captured CUDA graphs for decode-only steps (CUDA only)
    overlap: bool = True  # prepare step N + 1 on the host while the device runs step N (same results)
    # programmatic dependent launch between the decode step's Triton kernels (norms, RoPE and KV store,
    # decode attention, routing, the one-token GEMVs; Hopper and later), so each starts while the one before
    # it finishes (minakv/ops/triton_util.py, docs/kernels.md): batch 1 ~8% faster on an H100; same results.
    pdl: bool = True
    memory_fraction: float = 0.85  # of free accelerator memory (or a share of RAM on cpu) for the KV pool
    # Tensor / expert parallelism (minakv/parallel/, docs/parallel.md): the model runs on world = max(tp, ep)
    # worker processes (ranks) per role, which the engine starts and supervises (docs/workers.md).
    tensor_parallel_size: int = 1  # attention heads split this many ways: 1 or the world
    expert_parallel_size: int = 1  # experts split this many ways: a divisor of the world
    # How the ranks' experts meet (ep > 1, docs/parallel.md): "all_reduce" sums partial outputs (fewer bytes
    # while attention is replicated: 1.0 against 2.5 T*H*b per layer for GPT-OSS at ep=2), "all_to_all"
    # sends each token only to its experts' ranks and back, then all-gathers (eager steps).
    expert_dispatch: str = "all_reduce"
    # None: the worker runs in the engine's process (unless tp/ep > 1: then worker processes on cuda:0..world-1,
    # or all on "cpu"). One list (e.g. prefill_devices=["cpu"] or ["cuda:0"]): the model and its KV run in
    # worker processes the engine starts and supervises (minakv/worker/process.py). Both lists: pools of
    # prefill and decode worker processes (minakv/worker/disagg.py), the same device allowed. A worker
    # takes one device per rank (world entries), or one device for every rank (CPU only: NCCL takes one GPU
    # per rank); with both lists, each names N (M) workers' devices one after another: N * world entries,
    # e.g. ["cpu", "cpu"] for two prefill workers at world 1.
    prefill_devices: list[str] | None = None
    decode_devices: list[str] | None = None

    def check(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must hold at least one page, got {self.kv_cache_tokens!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        from minakv.parallel import (
            Parallel,
        )  # (raises ParallelError, a ValueError, for a layout that cannot cut)

        Parallel(
            0, self.tensor_parallel_size, self.expert_parallel_size, expert_dispatch=self.expert_dispatch
        )
        world = self.world
        for name in ("prefill_devices", "decode_devices"):
            devices = getattr(self, name)
            if devices is None:
                continue
            pool = self.disaggregated and len(devices) % world == 0  # N workers of world ranks each
            if len(devices) not in (1, world) and not pool:
                raise ValueError(
                    f"{name} must name exactly one device per rank ({world} under tensor_parallel_size="
                    f"{self.tensor_parallel_size}, expert_parallel_size={self.expert_parallel_size}), or one "
                    f"device for all ranks; with both lists, {world} per worker of a pool (N * {world}); a "
                    f"list alone is one worker; got {devices!r}"
                )
            if world > 1 and len(devices) == 1 and devices[0].startswith("cuda"):
                raise ValueError(
                    f"{name}: {world} ranks on one GPU ({devices[0]}) is not built (NCCL takes one GPU per "
                    f"rank); name {world} devices"
                )
            for member in self.pool_devices(devices):
                if member[0].startswith("cuda") and len(set(member)) < len(member):
                    raise ValueError(f"{name}: the ranks of one worker need distinct GPUs, got {devices!r}")
        if self.disaggregated:
            kinds = {d.split(":")[0] for d in [*self.prefill_devices, *self.decode_devices]}
            if len(kinds) != 1:  # one process group has one backend: gloo for CPU tensors, NCCL for CUDA
                raise ValueError(
                    "prefill_devices and decode_devices must be on the same one device type (all 'cpu' or all "
                    f"'cuda'), got {self.prefill_devices!r} and {self.decode_devices!r}"
                )

    @property
    def world(self) -> int:
        """Ranks per role: the worker processes one copy of the model runs on."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def worker_processes(self) -> bool:
        """The model runs in worker processes the engine starts (not in the engine's own process)."""
        return bool(self.prefill_devices or self.decode_devices) or self.world > 1

    def role_devices(self, devices: list[str] | None) -> list[str]:
        """One device per rank of a role: the list as given, one device repeated, or the default (cuda:0..
        world-1 where `device` is CUDA or unset with a GPU present, else every rank on "cpu")."""
        if devices:
            return list(devices) * (self.world // len(devices))
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda"):
            return [f"cuda:{r}" for r in range(self.world)] if self.world > 1 else [device]
        return [device] * self.world

    def pool_devices(self, devices: list[str] | None) -> list[list[str]]:
        """The workers of a pool, each with one device per rank: `world` entries per worker, one after
        another (a single device stands for every rank of one worker)."""
        if not devices or len(devices) == 1:
            return [self.role_devices(devices)]
        w = self.world
        return [list(devices[i : i + w]) for i in range(0, len(devices), w)]

    @property
    def disaggregated(self) -> bool:
        """Separate prefill and decode worker processes (both device lists given)."""
        return bool(self.prefill_devices) and bool(self.decode_devices)
