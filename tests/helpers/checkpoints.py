"""Tiny transformers checkpoints on disk, for the parity, loader and GPU model tests.

transformers builds and initialises each model; `randomise` gives a random value to the parameters it
starts at 0 or 1 (expert and attention biases, correction bias, norm weights) and to the sinks, so every
term matters; `save_pretrained` writes it. `quantise_checkpoint` rewrites one in its family's real
quantised format (MXFP4 for GPT-OSS, FP8 blocks for MiniMax-M2) with minakv's quantisers.
Needs transformers: import it after `pytest.importorskip("transformers")`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from minakv.ops.quant import quantize_fp8_block, quantize_mxfp4

WINDOW = 5  # GPT-OSS's sliding window


def gpt_oss_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256,
        sliding_window=WINDOW, max_position_embeddings=131072, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def minimax_config() -> transformers.MiniMaxM2Config:
    # hidden 256 / intermediate 128 give FP8 scale grids larger than 1x1. The partial rotary is given in
    # both spellings: older transformers 5.x read only rope_parameters' partial_rotary_factor.
    return transformers.MiniMaxM2Config(
        num_hidden_layers=3, hidden_size=256, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Give a random value to what transformers initialises to a constant."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        noise = torch.randn(t.shape, generator=gen)
        if "norm" in name:
            t.copy_(1.0 + 0.3 * noise)
        elif name.endswith(("bias", "sinks")):
            t.copy_(0.5 * noise)
        elif name.endswith("experts.gate_up_proj") and t.dim() == 3:
            t.mul_(5.0)  # GPT-OSS: push gate/up past the swiglu limit (7) so both clamps act


def save_hf(arch: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    if arch == "gpt_oss":
        model = transformers.GptOssForCausalLM(gpt_oss_config())
    else:
        model = transformers.MiniMaxM2ForCausalLM(minimax_config())
    randomise(model, seed)
    model.save_pretrained(path)
    return path


def quantise_checkpoint(src: Path, dst: Path) -> Path:
    """Rewrite a saved tiny model in its family's real quantised format (models.md 3.3)."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    if config["model_type"] == "gpt_oss":
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
            else:
                out[name] = t
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
            ],
        }  # fmt: skip
    else:
        for name, t in tensors.items():
            if name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
                out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
            else:
                out[name] = t
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        }  # fmt: skip
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def load_hf(path: Path) -> torch.nn.Module:
    """transformers' model in float32 on CPU. Quantised checkpoints are dequantised (on a CPU-only box
    transformers does that anyway; with a GPU present it would pick its own quantised kernels)."""
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    extra = {}
    if quant.get("quant_method") == "mxfp4":
        extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    elif quant.get("quant_method") == "fp8":
        extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", device_map="cpu", **extra
    )
    # Some 5.x versions keep dequantised MXFP4 experts in bf16 whatever `dtype` says; the values are
    # exact in bf16, so casting up is lossless and makes the reference compute in fp32.
    return model.float().eval()
