"""Tiny checkpoints in the real Hugging Face formats, for tests, demos and CI.

`build_tiny(preset, path)` writes a directory that transformers and minakv both load like a real model:
config.json in the form transformers 5 saves, model.safetensors with the real tensor names (GPT-OSS: fused
experts, or MXFP4 `*_blocks`/`*_scales`; MiniMax-M2: per-expert w1/w2/w3, or FP8 with `weight_scale_inv`),
generation_config.json, and a tokenizer with a chat template. Weights are random but chosen to exercise
everything: biases, sinks, norm weights and the routing correction bias are nonzero, and the scales keep
activations O(1) so greedy generation does not collapse to one token. Same seed, same bytes.

tiny-gpt-oss uses the real o200k_harmony tokenizer (201088 tokens); tiny-minimax-m2 a small synthetic
byte-level BPE with MiniMax's special tokens. The chat templates are our own short renderings of each
family's format, not the official templates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from minakv.ops.quant import quantize_fp8_block, quantize_mxfp4
from minakv.presets.tiny_text import GPT_OSS_TEMPLATE, MINIMAX_TEMPLATE, minimax_tokenizer
from minakv.text.tokenizer import gpt_oss_tokenizer_json

BUILDER_VERSION = 2  # bump when the bytes written for a seed change

GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "bos_token_id": 199998,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "dtype": "bfloat16",
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
        "rope_type": "yarn",
        "truncate": False,
    },
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "vocab_size": 201088,
}

MINIMAX_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,  # > 128 so FP8 weights have a real 128x128 scale grid
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 196608,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 5000000.0, "rope_type": "default"},
    "rotary_dim": 32,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "vocab_size": None,  # set from the synthetic tokenizer
}


def build_tiny(preset: str, path: str | Path, seed: int = 0, quant: str | None = None) -> Path:
    """Write the tiny checkpoint `preset` ("tiny-gpt-oss" or "tiny-minimax-m2") into `path`.
    quant: None (bf16), "mxfp4" (GPT-OSS experts) or "fp8" (MiniMax-M2 128x128 blocks)."""
    builders = {"tiny-gpt-oss": ("mxfp4", build_gpt_oss), "tiny-minimax-m2": ("fp8", build_minimax)}
    if preset not in builders:
        raise ValueError(f"unknown tiny preset {preset!r}; choose one of {', '.join(builders)}")
    quant_kind, build = builders[preset]
    if quant not in (None, quant_kind):
        raise ValueError(f"{preset} can be written unquantised or with quant={quant_kind!r}, not {quant!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build(path, torch.Generator().manual_seed(seed), quant is not None)
    return path


def randn(gen: torch.Generator, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std + mean


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save(path: Path, tensors: dict[str, torch.Tensor], quantized: set[str]) -> None:
    """bf16 for everything except quantised parts (u8 MXFP4, float8 + f32 scales), which keep their dtype."""
    out = {k: (v if k in quantized else v.to(torch.bfloat16)).contiguous() for k, v in tensors.items()}
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


def dims(c: dict) -> tuple[int, ...]:
    """hidden, vocab, experts, intermediate, and the q and kv projection widths of a config."""
    D = c["head_dim"]
    return (c["hidden_size"], c["vocab_size"], c["num_local_experts"], c["intermediate_size"],
            c["num_attention_heads"] * D, c["num_key_value_heads"] * D)  # fmt: skip


def build_gpt_oss(path: Path, gen: torch.Generator, mxfp4: bool) -> None:
    c = GPT_OSS_CONFIG
    H, V, E, I, q, kv = dims(c)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(gen, V, H)}
    quantized: set[str] = set()
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = randn(gen, H, std=0.1, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = randn(gen, H, std=0.1, mean=1.0)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[p + f"self_attn.{name}.weight"] = randn(gen, out, H, std=H**-0.5)
            t[p + f"self_attn.{name}.bias"] = randn(gen, out, std=0.1)
        t[p + "self_attn.o_proj.weight"] = randn(gen, H, q, std=q**-0.5)
        t[p + "self_attn.o_proj.bias"] = randn(gen, H, std=0.1)
        t[p + "self_attn.sinks"] = randn(gen, c["num_attention_heads"])
        t[p + "mlp.router.weight"] = randn(gen, E, H, std=H**-0.5)
        t[p + "mlp.router.bias"] = randn(gen, E, std=0.5)
        experts = {
            "gate_up_proj": randn(gen, E, H, 2 * I, std=H**-0.5),  # HF layout [E, in, out]
            "down_proj": randn(gen, E, I, H, std=I**-0.5),
        }
        t[p + "mlp.experts.gate_up_proj_bias"] = randn(gen, E, 2 * I, std=0.1)
        t[p + "mlp.experts.down_proj_bias"] = randn(gen, E, H, std=0.1)
        for name, w in experts.items():
            if mxfp4:  # the checkpoint stores [E, out, in] grouped along `in`
                blocks, scales = quantize_mxfp4(w.transpose(1, 2))
                t[p + f"mlp.experts.{name}_blocks"], t[p + f"mlp.experts.{name}_scales"] = blocks, scales
                quantized |= {p + f"mlp.experts.{name}_blocks", p + f"mlp.experts.{name}_scales"}
            else:
                t[p + f"mlp.experts.{name}"] = w
    t["model.norm.weight"] = randn(gen, H, std=0.1, mean=1.0)
    t["lm_head.weight"] = randn(gen, V, H, std=0.5)  # logits with a std of ~4: peaked, not uniform
    save(path, t, quantized)

    config = dict(c)
    if mxfp4:
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    write_json(path / "config.json", config)
    write_json(
        path / "generation_config.json",
        {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999},
    )
    (path / "tokenizer.json").write_bytes(gpt_oss_tokenizer_json().read_bytes())
    write_tokenizer_config(path, GPT_OSS_TEMPLATE, "<|startoftext|>", "<|return|>", "<|endoftext|>", 131072)


def build_minimax(path: Path, gen: torch.Generator, fp8: bool) -> None:
    tok = minimax_tokenizer()
    vocab = tok.get_vocab_size()  # no padding rows, so greedy output is always decodable text
    bos, eos = tok.token_to_id("]~!b["), tok.token_to_id("[e~[")
    c = dict(MINIMAX_CONFIG, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    H, V, E, I, q, kv = dims(c)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(gen, V, H)}
    linear: list[str] = []  # the weights FP8 quantises
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = randn(gen, H, std=0.1, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = randn(gen, H, std=0.1, mean=1.0)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[p + f"self_attn.{name}.weight"] = randn(gen, out, H, std=H**-0.5)
        t[p + "self_attn.o_proj.weight"] = randn(gen, H, q, std=q**-0.5)
        t[p + "self_attn.q_norm.weight"] = randn(gen, q, std=0.1, mean=1.0)
        t[p + "self_attn.k_norm.weight"] = randn(gen, kv, std=0.1, mean=1.0)
        linear += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = randn(gen, E, H, std=H**-0.5)
        t[m + "e_score_correction_bias"] = randn(gen, E, std=0.1)
        for j in range(E):
            t[m + f"experts.{j}.w1.weight"] = randn(gen, I, H, std=H**-0.5)
            t[m + f"experts.{j}.w2.weight"] = randn(gen, H, I, std=I**-0.5)
            t[m + f"experts.{j}.w3.weight"] = randn(gen, I, H, std=H**-0.5)
            linear += [m + f"experts.{j}.{w}.weight" for w in ("w1", "w2", "w3")]
    t["model.norm.weight"] = randn(gen, H, std=0.1, mean=1.0)
    t["lm_head.weight"] = randn(gen, V, H, std=0.25)
    quantized: set[str] = set()
    for name in linear if fp8 else []:
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        t[name], t[scale_name] = quantize_fp8_block(t[name])
        quantized |= {name, scale_name}
    # e_score_correction_bias is float32 in the real checkpoint.
    quantized |= {k for k in t if k.endswith("e_score_correction_bias")}
    save(path, t, quantized)

    config = dict(c)
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "float8_e4m3fn",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        }
    write_json(path / "config.json", config)
    write_json(
        path / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos},
    )
    tok.save(str(path / "tokenizer.json"))
    write_tokenizer_config(path, MINIMAX_TEMPLATE, "]~!b[", "[e~[", None, c["max_position_embeddings"])


def write_tokenizer_config(
    path: Path, template: str, bos: str, eos: str, pad: str | None, max_length: int
) -> None:
    write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        },
    )
    (path / "chat_template.jinja").write_text(template)
