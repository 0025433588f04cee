"""Load a Hugging Face checkpoint (safetensors) into a minakv model.

The model is built empty in its final dtypes, then every parameter pulls its tensor from the checkpoint
by name. Our parameter names are the checkpoint names without `model.` (MiniMax-M2 calls the MoE block
`block_sparse_moe`), so only the experts need real conversion:
  GPT-OSS: fused `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] (bf16/fp32, the transpose of ours)
           or MXFP4 `*_blocks` / `*_scales` ([E, out, in] orientation); gate/up rows interleaved -> halves.
  MiniMax-M2: one `w1` (gate) / `w3` (up) / `w2` (down) per expert, possibly FP8 with `weight_scale_inv`.
Quantised weights stay in their format (minakv.ops.quant): GPT-OSS's MXFP4 experts packed
(`GptOssExperts.packed`, re-laid in 16-row tiles: minakv/ops/mxfp4_layout.py), MiniMax-M2's FP8 attention
projections and experts with their block scales (`Fp8Linear`, `MiniMaxM2Experts.fp8`), for the kernels that
dequantise in registers. Every tensor must be used once and every parameter found: a missing, unexpected
or mis-shaped tensor is an error that names it.

Under tensor / expert parallelism (`parallel`, minakv/parallel/) a rank loads only its share: each tensor is
read on the host, cut by `minakv.parallel.shard.shard` (bf16, MXFP4 and FP8 alike, in their stored form),
and only the piece moves to the device. Expert tensors are read only for the rank's experts (a dim-0
slice of the file for GPT-OSS's fused tensors; MiniMax-M2's other experts are never read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from minakv.model import default_device_dtype, make_empty_model, make_meta_model
from minakv.model.config import ModelConfig
from minakv.model.gpt_oss import GptOssExperts
from minakv.model.layers import CausalLM, Fp8Linear, fp8_resident
from minakv.model.minimax_m2 import MiniMaxM2Experts
from minakv.ops.mxfp4_layout import tile
from minakv.ops.quant import dequantize_fp8_block
from minakv.parallel.group import SINGLE, Parallel
from minakv.parallel.shard import shard, shard_experts

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

    def get(
        self, name: str, shape: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The tensor as stored (header dtype), checked against `shape` when given; `rows`: only
        [first, first + count) of its dim 0 is read (a rank's experts)."""
        if name not in self.files:
            want = "" if shape is None else f" (expected shape {tuple(shape)})"
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}{want}")
        file = self.files[name]
        if file not in self.handles:
            if not file.exists():
                raise CheckpointError(f"tensor {name!r} is mapped to {file.name}, which does not exist")
            self.handles[file] = safe_open(file, framework="pt")
        stored = self.handles[file].get_slice(name)
        if shape is not None and tuple(stored.get_shape()) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r}: expected shape {tuple(shape)}, got {tuple(stored.get_shape())} ({file.name})"
            )
        self.used.add(name)
        if rows is None:
            return self.handles[file].get_tensor(name)
        return stored[rows[0] : rows[0] + rows[1]]

    def skip(self, name: str) -> None:
        """A tensor another rank loads: counted as used, never read."""
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}")
        self.used.add(name)

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


def staging(device: torch.device, par: Parallel) -> torch.device:
    """Where a tensor is converted (de-interleaved, dequantised) before it is cut: the device, unless the
    model is sharded; then the host, so that only the rank's piece ever reaches the device."""
    return device if par.world == 1 else torch.device("cpu")


def load_gpt_oss_experts(
    experts: GptOssExperts,
    name: str,
    ckpt: Checkpoint,
    device: torch.device,
    config: ModelConfig,
    par: Parallel,
) -> None:
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    prefix, rows = checkpoint_name(config, name), par.expert_range(e) if par.ep > 1 else None
    stage = staging(device, par)
    mxfp4 = prefix + ".gate_up_proj_blocks" in ckpt
    if mxfp4 != experts.packed:
        raise CheckpointError(
            f"{prefix}: the config says quant_method mxfp4 = {experts.packed}, the tensors disagree"
        )

    def put(ours: str, tensor: torch.Tensor) -> None:  # this rank's experts, on the host -> its slice
        getattr(experts, ours).data.copy_(shard_experts(f"{name}.{ours}", tensor, par).to(device))

    def put_packed(ours: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        # this rank's rows, re-laid in 16-row tiles (minakv/ops/mxfp4_layout.py) on the device
        blocks = shard_experts(f"{name}.{ours}_blocks", blocks, par).to(device)
        scales = shard_experts(f"{name}.{ours}_scales", scales, par).to(device)
        blocks, scales = tile(blocks, scales, parts=2 if ours == "gate_up" else 1)
        getattr(experts, f"{ours}_blocks").copy_(blocks)
        getattr(experts, f"{ours}_scales").copy_(scales)

    # MXFP4: the bytes stay packed (GptOssExperts), in tiles; the gate/up rows reordered into halves
    if mxfp4:
        for ours, theirs, out, cols in (("gate_up", "gate_up_proj", 2 * i, h), ("down", "down_proj", h, i)):
            if cols % 32:
                raise CheckpointError(f"MXFP4 {prefix}.{theirs}: input dim {cols} is not a multiple of 32")
            blocks = ckpt.get(f"{prefix}.{theirs}_blocks", (e, out, cols // 32, 16), rows).to(stage)
            scales = ckpt.get(f"{prefix}.{theirs}_scales", (e, out, cols // 32), rows).to(stage)
            if ours == "gate_up":
                blocks, scales = deinterleave(blocks), deinterleave(scales)
            put_packed(ours, blocks, scales)
    else:
        gate_up = ckpt.get(prefix + ".gate_up_proj", (e, h, 2 * i), rows).to(stage)
        put("gate_up", deinterleave(gate_up.transpose(1, 2), 1))
        put("down", ckpt.get(prefix + ".down_proj", (e, i, h), rows).to(stage).transpose(1, 2))
    put("gate_up_bias", deinterleave(ckpt.get(prefix + ".gate_up_proj_bias", (e, 2 * i), rows), 1))
    put("down_bias", ckpt.get(prefix + ".down_proj_bias", (e, h), rows))


def load_minimax_experts(
    experts: MiniMaxM2Experts,
    name: str,
    ckpt: Checkpoint,
    device: torch.device,
    config: ModelConfig,
    block: int,
    par: Parallel,
) -> None:
    """One expert at a time: w1 (gate) and w3 (up) stacked into gate_up rows, w2 as down, then the rank's
    slice; FP8 bytes and block scales stay as stored (gate half's scale rows, then up half's)."""
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    prefix, (first, count) = checkpoint_name(config, name), par.expert_range(e)
    names = (".w1.weight", ".w3.weight", ".w2.weight")
    for j in range(e):
        p = f"{prefix}.{j}"
        if not first <= j < first + count:  # another rank's expert
            for n in names:
                ckpt.skip(p + n)
                if experts.fp8:
                    ckpt.skip(p + n + "_scale_inv")
            continue
        if experts.fp8:
            w1, w3, w2 = (ckpt.get(p + n, (h, i) if n == ".w2.weight" else (i, h)) for n in names)
            s1, s3, s2 = (ckpt.get(p + n + "_scale_inv") for n in names)
            parts = {"gate_up": torch.cat([w1, w3]), "gate_up_scale_inv": torch.cat([s1, s3]),
                     "down": w2, "down_scale_inv": s2}  # fmt: skip
        else:
            w1, w3, w2 = (
                ckpt.weight(p + n, (h, i) if n == ".w2.weight" else (i, h), staging(device, par), block)
                for n in names
            )
            parts = {"gate_up": torch.cat([w1, w3]), "down": w2}
        for ours, tensor in parts.items():
            piece = shard_experts(f"{name}.{ours}", tensor[None], par)[0]
            getattr(experts, ours)[j - first].copy_(piece.to(device))


def load_fp8_linear(
    module: Fp8Linear, name: str, ckpt: Checkpoint, device: torch.device, config: ModelConfig,
    full: dict[str, tuple[int, ...]], par: Parallel,
) -> None:  # fmt: skip
    """`full`: our tensor names -> their unsharded (stored) shapes."""
    for leaf in ("weight", "weight_scale_inv"):
        tensor = ckpt.get(f"{checkpoint_name(config, name)}.{leaf}", full[f"{name}.{leaf}"])
        getattr(module, leaf).copy_(shard(f"{name}.{leaf}", tensor, par).to(device))


def load_weights(model: CausalLM, ckpt: Checkpoint, device: torch.device) -> None:
    config, par = model.config, model.parallel
    block = int(((config.quantization or {}).get("weight_block_size") or [128])[0])
    if fp8_resident(config) and block != 128:
        raise CheckpointError(f"FP8 weights need 128x128 scale blocks, the config says {block}")
    meta = make_meta_model(config) if par.world > 1 else model  # the stored shapes
    full = {n: tuple(t.shape) for n, t in (*meta.named_parameters(), *meta.named_buffers())}
    for name, module in model.named_modules():
        if isinstance(module, GptOssExperts):
            load_gpt_oss_experts(module, name, ckpt, device, config, par)
        elif isinstance(module, MiniMaxM2Experts):
            load_minimax_experts(module, name, ckpt, device, config, block, par)
        elif isinstance(module, Fp8Linear):
            load_fp8_linear(module, name, ckpt, device, config, full, par)
    for name, param in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        if ".experts." in name:
            continue
        tensor = ckpt.weight(checkpoint_name(config, name), full[name], staging(device, par), block)
        param.data.copy_(shard(name, tensor, par))
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
    model: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    parallel: Parallel = SINGLE,
) -> CausalLM:
    """Load a model directory / preset / hub repo into a CausalLM on `device` in `dtype` (defaults:
    cuda + bfloat16 when available, else cpu + float32); under `parallel`, this rank's share only."""
    path = resolve_path(model)
    config = ModelConfig.from_dir(path)
    device, dtype = default_device_dtype(device, dtype)
    result = make_empty_model(config, device, dtype, parallel)
    with torch.no_grad():
        load_weights(result, Checkpoint(path), device)
    return result
