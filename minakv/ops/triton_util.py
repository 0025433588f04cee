"""Small helpers shared by minakv's Triton kernels.

Each op picks the Triton path for CUDA tensors and its torch reference otherwise. Triton decides when a
kernel is decorated (at import) whether it runs compiled or in its CPU interpreter (TRITON_INTERPRET=1),
so tests that run kernels on CPU set that variable before anything imports Triton (`interpreter_ready`).
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1. The interpreter (Triton 3.9) multiplies bf16 dots wrongly, so
    kernels take their fp32-operand dot path there (the bf16 rounding is then checked on the GPU only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_ready() -> bool:
    """Whether kernels can run in the CPU interpreter in this process. Triton jits its own stdlib (tl.max,
    tl.sum, ...) when first imported, so TRITON_INTERPRET=1 must have been set before `import triton`."""
    from triton.language import standard

    return type(standard.max).__name__ == "InterpretedFunction"


# Tests set this to run the engine through the kernels on CPU, in Triton's interpreter (see interpreting()).
TRITON_ON_CPU = False


def use_triton(x: torch.Tensor) -> bool:
    """True when an op should take its Triton path (CUDA tensors); the torch reference serves the rest."""
    return x.is_cuda or (TRITON_ON_CPU and x.device.type == "cpu")


# Programmatic dependent launch (Hopper and later; EngineConfig.pdl). A kernel launched with it may start
# while the kernel before it in the stream is still finishing; it waits (`gdc_wait`) before it touches
# memory that kernel may write, and lets the next one start (`gdc_launch_dependents`) once its own inputs
# are read. So a decode step's small kernels overlap each other's launch, ramp and tail. Set by the worker.
PDL = False


def enable_pdl(enabled: bool, device: torch.device) -> bool:
    """Turn programmatic dependent launch on for the kernels that take it (compiled, CUDA, sm_90+)."""
    global PDL
    PDL = bool(enabled and device.type == "cuda" and not interpreting())
    PDL = PDL and torch.cuda.get_device_capability(device)[0] >= 9
    return PDL


def pdl_options() -> dict:
    """A PDL-aware kernel's launch options: its USE_GDC constexpr, and Triton's launch_pdl when on."""
    return {"USE_GDC": True, "launch_pdl": True} if PDL else {"USE_GDC": False}


def ptx_loads_ok(asked: bool, x: torch.Tensor) -> bool:
    """Whether a GEMV's inline-PTX path that loads bf16 activations itself may run: asked for, compiled (the
    interpreter has no inline assembly), bf16 x whose rows start on 16 bytes (the blocks' vector loads)."""
    return asked and not interpreting() and x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (4 for the CPU interpreter): sizes split-K grids."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check(cond: bool, message: str) -> None:
    """Raise a ValueError naming the bad input (ops validate shapes before launching a kernel)."""
    if not cond:
        raise ValueError(message)
