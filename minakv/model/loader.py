"""Load a Hugging Face checkpoint (safetensors) into a minakv model.

The model is built empty in its final dtypes, then every parameter pulls its tensor from the checkpoint
by name. Our parameter names are the checkpoint names without `model.` (MiniMax-M2 calls the MoE block
`block_sparse_moe`), so only the experts need real conversion:
  GPT-OSS: fused `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] (bf16/fp32, the transpose of ours)
           or MXFP4 `*_blocks` / `*_scales` ([E, out, in] orientation); gate/up rows interleaved -> halves.
  MiniMax-M2: one `w1` (gate) / `w3` (up) / `w2` (down) per expert, possibly FP8 with `weight_scale_inv`.
Quantised weights stay in their format (minakv.ops.quant): GPT-OSS's MXFP4 experts packed
(`GptOssExperts.packed`), MiniMax-M2's FP8 attention projections and experts with their block scales
(`Fp8Linear`, `MiniMaxM2Experts.fp8`), for the kernels that dequantise in registers. Every tensor must be used once and every parameter found: a
missing, unexpected or mis-shaped tensor is an error that names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from minakv.model import default_device_dtype, make_empty_model
from minakv.model.config import ModelConfig
from minakv.model.gpt_oss import GptOssExperts
from minakv.model.layers import CausalLM, Fp8Linear, fp8_resident
from minakv.model.minimax_m2 import MiniMaxM2Experts
from minakv.ops.quant import dequantize_fp8_block

IGNORED = re.compile(r"(^|\.)mtp\.|rotary_emb\.inv_freq$")  # MiniMax MTP heads (unused), RoPE caches


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor and what was expected."""


class Checkpoint:
    """The tensors of a safetensors checkpoint (single file or sharded), read lazily by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: path / file for name, file in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {path}")
            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        self.handles: dict[Path, object] = {}
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor as stored (header dtype), checked against `shape` when given."""
        if name not in self.files:
            want = "" if shape is None else f" (expected shape {tuple(shape)})"
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}{want}")
        file = self.files[name]
        if file not in self.handles:
            if not file.exists():
                raise CheckpointError(f"tensor {name!r} is mapped to {file.name}, which does not exist")
            self.handles[file] = safe_open(file, framework="pt")
        tensor = self.handles[file].get_tensor(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r}: expected shape {tuple(shape)}, got {tuple(tensor.shape)} ({file.name})"
            )
        self.used.add(name)
        return tensor

    def weight(self, name: str, shape: tuple[int, ...], device: torch.device, block: int) -> torch.Tensor:
        """A plain weight, dequantised if it is FP8 with a `<name>_scale_inv` beside it."""
        tensor = self.get(name, shape)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in self:
                raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r} beside it")
            return dequantize_fp8_block(tensor.to(device), self.get(scale_name), block)
        return tensor

    def unused(self) -> list[str]:
        return sorted(n for n in self.files if n not in self.used and not IGNORED.search(n))


def checkpoint_name(config: ModelConfig, name: str) -> str:
    """Our parameter name -> its name in a Hugging Face checkpoint."""
    if name == "lm_head.weight":
        return name
    if config.arch == "minimax_m2":
        name = name.replace(".mlp.", ".block_sparse_moe.")
    return "model." + name


def deinterleave(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """GPT-OSS rows (gate, up, gate, up, ...) -> (gate..., up...)."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def load_gpt_oss_experts(experts: GptOssExperts, prefix: str, ckpt: Checkpoint, device: torch.device) -> None:
    e, two_i = experts.gate_up_bias.shape
    h, i = experts.down_bias.shape[1], two_i // 2
    mxfp4 = prefix + ".gate_up_proj_blocks" in ckpt
    if mxfp4 != experts.packed:
        raise CheckpointError(
            f"{prefix}: the config says quant_method mxfp4 = {experts.packed}, the tensors disagree"
        )
    if mxfp4:  # the bytes stay packed (GptOssExperts); only the gate/up rows are reordered into halves
        for ours, theirs, rows, cols in (("gate_up", "gate_up_proj", 2 * i, h), ("down", "down_proj", h, i)):
            if cols % 32:
                raise CheckpointError(f"MXFP4 {prefix}.{theirs}: input dim {cols} is not a multiple of 32")
            blocks = ckpt.get(f"{prefix}.{theirs}_blocks", (e, rows, cols // 32, 16)).to(device)
            scales = ckpt.get(f"{prefix}.{theirs}_scales", (e, rows, cols // 32)).to(device)
            if ours == "gate_up":
                blocks, scales = deinterleave(blocks), deinterleave(scales)
            getattr(experts, f"{ours}_blocks").copy_(blocks)
            getattr(experts, f"{ours}_scales").copy_(scales)
    else:
        gate_up = ckpt.get(prefix + ".gate_up_proj", (e, h, 2 * i)).to(device)
        experts.gate_up.data.copy_(deinterleave(gate_up.transpose(1, 2), 1))
        experts.down.data.copy_(ckpt.get(prefix + ".down_proj", (e, i, h)).to(device).transpose(1, 2))
    experts.gate_up_bias.data.copy_(deinterleave(ckpt.get(prefix + ".gate_up_proj_bias", (e, 2 * i)), 1))
    experts.down_bias.data.copy_(ckpt.get(prefix + ".down_proj_bias", (e, h)))


def load_minimax_experts(
    experts: MiniMaxM2Experts, prefix: str, ckpt: Checkpoint, device: torch.device, block: int
) -> None:
    e, two_i, h = experts.gate_up.shape
    i = two_i // 2
    if experts.fp8:  # the bytes and block scales stay as stored (gate half's scale rows, then up half's)
        g = -(-i // 128)
        for j in range(e):
            p = f"{prefix}.{j}"
            for name, rows, into, scales in ((".w1", slice(0, i), experts.gate_up, slice(0, g)),
                                             (".w3", slice(i, 2 * i), experts.gate_up, slice(g, 2 * g)),
                                             (".w2", slice(None), experts.down, slice(None))):  # fmt: skip
                shape = (h, i) if name == ".w2" else (i, h)
                into[j, rows].copy_(ckpt.get(p + name + ".weight", shape).to(device))
                scale = experts.gate_up_scale_inv if name != ".w2" else experts.down_scale_inv
                scale[j, scales].copy_(ckpt.get(p + name + ".weight_scale_inv").to(device))
        return
    for j in range(e):
        p = f"{prefix}.{j}"
        experts.gate_up.data[j, :i].copy_(ckpt.weight(p + ".w1.weight", (i, h), device, block))
        experts.gate_up.data[j, i:].copy_(ckpt.weight(p + ".w3.weight", (i, h), device, block))
        experts.down.data[j].copy_(ckpt.weight(p + ".w2.weight", (h, i), device, block))


def load_fp8_linear(module: Fp8Linear, name: str, ckpt: Checkpoint, device: torch.device) -> None:
    module.weight.copy_(ckpt.get(name + ".weight", tuple(module.weight.shape)).to(device))
    scale = ckpt.get(name + ".weight_scale_inv", tuple(module.weight_scale_inv.shape))
    module.weight_scale_inv.copy_(scale.to(device))


def load_weights(model: CausalLM, ckpt: Checkpoint, device: torch.device) -> None:
    config = model.config
    block = int(((config.quantization or {}).get("weight_block_size") or [128])[0])
    if fp8_resident(config) and block != 128:
        raise CheckpointError(f"FP8 weights need 128x128 scale blocks, the config says {block}")
    for name, module in model.named_modules():
        if isinstance(module, GptOssExperts):
            load_gpt_oss_experts(module, checkpoint_name(config, name), ckpt, device)
        elif isinstance(module, MiniMaxM2Experts):
            load_minimax_experts(module, checkpoint_name(config, name), ckpt, device, block)
        elif isinstance(module, Fp8Linear):
            load_fp8_linear(module, checkpoint_name(config, name), ckpt, device)
    for name, param in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        if ".experts." in name:
            continue
        tensor = ckpt.weight(checkpoint_name(config, name), tuple(param.shape), device, block)
        param.data.copy_(tensor)
    if config.tie_word_embeddings:
        ckpt.used.add("lm_head.weight")  # some tied checkpoints still carry a copy
    extra = ckpt.unused()
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(f"checkpoint {ckpt.path} has unexpected tensors: {', '.join(extra[:5])}{more}")


def resolve_path(model: str | Path) -> Path:
    """A local directory, a built-in preset name or a hub repo id -> a local checkpoint directory
    (minakv.presets owns that mapping; imported here lazily, since it pulls in the tokenizer)."""
    from minakv.presets import resolve_model

    return Path(resolve_model(model))


def load_model(
    model: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None
) -> CausalLM:
    """Load a model directory / preset / hub repo into a CausalLM on `device` in `dtype` (defaults:
    cuda + bfloat16 when available, else cpu + float32)."""
    path = resolve_path(model)
    config = ModelConfig.from_dir(path)
    device, dtype = default_device_dtype(device, dtype)
    result = make_empty_model(config, device, dtype)
    with torch.no_grad():
        load_weights(result, Checkpoint(path), device)
    return result
