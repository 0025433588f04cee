"""Models: build one from a config (random weights) or load one from a checkpoint, and run it.

`build_model(config)` / `load_model(path_or_repo)` return a `CausalLM` (GptOssModel or MiniMaxM2Model):
`model(input_ids [T], ctx) -> hidden [T, H]`, `model.compute_logits(hidden) -> float32 [T, V]`,
`model.config`, `model.rope`, `model.layers[i].self_attn.spec` (the layer's `AttentionLayer`).

`parallel=Parallel(rank, tp, ep, group)` (minakv/parallel/) builds or loads this rank's share of a tensor-
and expert-parallel model: only that share is ever allocated on the device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minakv.model.config import ModelConfig
from minakv.model.gpt_oss import GptOssModel
from minakv.model.layers import CausalLM, RMSNorm
from minakv.model.minimax_m2 import MiniMaxM2Model
from minakv.ops.mxfp4_layout import tile_blocks
from minakv.parallel.group import SINGLE, Parallel
from minakv.parallel.shard import shard

Model = CausalLM
MODEL_CLASSES: dict[str, type[CausalLM]] = {"gpt_oss": GptOssModel, "minimax_m2": MiniMaxM2Model}

__all__ = [
    "CausalLM", "GptOssModel", "MiniMaxM2Model", "Model", "ModelConfig",
    "Parallel", "build_model", "default_device_dtype", "load_model", "make_empty_model", "make_meta_model",
]  # fmt: skip


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device_dtype(
    device: str | torch.device | None, dtype: torch.dtype | str | None
) -> tuple[torch.device, torch.dtype]:
    """cuda if available; bfloat16 on cuda, float32 on cpu, unless given (a dtype may be named)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    return device, dtype


def make_meta_model(config: ModelConfig, parallel: Parallel = SINGLE) -> CausalLM:
    """The model's modules with no storage: its names, shapes and dtypes."""
    if config.arch not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {config.arch!r} (minakv runs {', '.join(MODEL_CLASSES)})")
    with torch.device("meta"):
        return MODEL_CLASSES[config.arch](config, parallel)


def make_empty_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, parallel: Parallel = SINGLE
) -> CausalLM:
    """The model with uninitialised storage in its final dtypes (built on "meta", so no init cost)."""
    model = make_meta_model(config, parallel)
    model.to_empty(device=device)
    model.tie_weights()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for name, b in model.named_buffers():  # quantised weights and their scales keep the checkpoint's dtypes
        if b.is_floating_point() and b.dtype != torch.float8_e4m3fn and not name.endswith("_scale_inv"):
            b.data = b.data.to(dtype)
    for p in model.fp32_parameters():
        p.data = p.data.float()
    model.requires_grad_(False)
    return model.eval()


def build_model(
    config: ModelConfig,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
    device_rng: bool = False,
    parallel: Parallel = SINGLE,
) -> CausalLM:
    """A model with random weights (normal(0, 0.02); norm weights 1; MXFP4 experts as random codes with
    scale 2^-7) for tests and benchmarks. `device_rng`: draw on the device (fast for real sizes; other
    numbers than the CPU generator's). Under `parallel` each tensor is drawn whole, in the same order, and
    cut (one at a time), so a rank's weights are exactly its share of the unsharded model's."""
    device, dtype = default_device_dtype(device, dtype)
    model = make_empty_model(config, device, dtype, parallel)
    full = make_meta_model(config) if parallel.world > 1 else model  # the draws' shapes and order
    gen = torch.Generator(device=device if device_rng else "cpu").manual_seed(seed)
    ours = dict(model.named_parameters())
    norms = {n for n, m in full.named_modules() if isinstance(m, RMSNorm)}
    for name, p in full.named_parameters():
        if name.rsplit(".", 1)[0] in norms:
            ours[name].data.fill_(1.0)
        else:
            drawn = torch.randn(p.shape, generator=gen, device=gen.device) * 0.02
            ours[name].data.copy_(shard(name, drawn, parallel))
    ours = dict(model.named_buffers())
    for name, b in full.named_buffers():
        if b.dtype == torch.uint8 and name.endswith("_blocks"):  # MXFP4 codes: any byte is two valid codes
            drawn = torch.randint(0, 256, b.shape, generator=gen, device=gen.device, dtype=torch.uint8)
            # as the loader: the rank's rows, then re-laid in tiles (minakv/ops/mxfp4_layout.py)
            ours[name].copy_(tile_blocks(shard(name, drawn, parallel)))
        elif b.dtype == torch.uint8 and name.endswith("_scales"):  # 2^-7: values of std ~0.02, like the rest
            ours[name].fill_(120)
        elif b.dtype == torch.float8_e4m3fn:  # FP8 codes of std 1, with scales of 0.02 below
            drawn = torch.randn(b.shape, generator=gen, device=gen.device).to(torch.float8_e4m3fn)
            ours[name].copy_(shard(name, drawn, parallel))
        elif name.endswith("_scale_inv"):
            ours[name].fill_(0.02)
    return model


def load_model(
    model: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    parallel: Parallel = SINGLE,
) -> CausalLM:
    """Load a local Hugging Face directory, a built-in preset name or a hub repo id (this rank's share of
    it under `parallel`)."""
    from minakv.model.loader import load_model as _load

    return _load(model, device=device, dtype=dtype, parallel=parallel)
