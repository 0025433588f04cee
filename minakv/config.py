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
    memory_fraction: float = 0.85  # of free accelerator memory (or a share of RAM on cpu) for the KV pool
    # None: the worker runs in the engine's process. A device list (e.g. ["cpu"], ["cuda:0"]): the model and
    # its KV run in a worker process the engine starts and supervises (minakv/worker/process.py). Separate
    # prefill and decode workers are not built yet: the two lists must name the same one device.
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
        if self.prefill_devices is not None or self.decode_devices is not None:
            prefill, decode = (
                self.prefill_devices or self.decode_devices,
                self.decode_devices or self.prefill_devices,
            )
            if list(prefill) != list(decode) or len(prefill) != 1:
                raise ValueError(
                    "prefill_devices and decode_devices must name the same one device for now (one worker "
                    f"process does both; separate workers are not built yet), got {prefill!r} and {decode!r}"
                )
