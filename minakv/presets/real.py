"""The real models' shapes, for `load_format="dummy"`: run and benchmark gpt-oss-20b, gpt-oss-120b and
MiniMax-M2 with random weights in each checkpoint's own precision, offline, with nothing downloaded.

The configs are the published `config.json` fields minakv reads (docs: ../shared/reference/models.md in the
project's source tree; the model cards for parameter counts). With `load_format="dummy"`, `Engine(name)`
builds the model straight on the device from one of these (or from a local directory's config.json), with
random weights in the checkpoint's precision: GPT-OSS experts as packed MXFP4 bytes, MiniMax-M2's attention
projections and experts as FP8 with 128x128 block scales, everything else in the engine's dtype. Only the tokenizer of GPT-OSS can be built offline (DESIGN: o200k_harmony from the
quicktok-v1 package); without it a dummy engine takes token ids only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from minakv.model import CausalLM, ModelConfig, build_model
from minakv.parallel import SINGLE, Parallel

_GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "bos_token_id": 199998,
    "eos_token_id": [200002, 199999, 200012],  # generation_config.json: <|return|>, <|endoftext|>, <|call|>
    "pad_token_id": 199999,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4"},
}


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {**_GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts, "layer_types": types}


REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "minimax-m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "hidden_size": 3072,
        "num_hidden_layers": 62,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 1536,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "rotary_dim": 64,
        "rope_theta": 5000000,
        "rms_norm_eps": 1e-06,
        "vocab_size": 200064,
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 200034,
        "eos_token_id": 200020,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "float8_e4m3fn",
            "weight_block_size": [128, 128],
        },
    },
}
# Hub ids people pass for the same models
ALIASES = {"openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
           "MiniMaxAI/MiniMax-M2": "minimax-m2"}  # fmt: skip


def real_config(name: str) -> dict[str, Any] | None:
    """The config of a real model by preset name or hub id, or None."""
    return REAL_CONFIGS.get(ALIASES.get(name, name))


def dummy_tokenizer(arch: str):
    """GPT-OSS's tokenizer (built offline from the quicktok-v1 package), or None where it cannot be built
    or the family's tokenizer is not available offline (MiniMax-M2): the engine then takes token ids."""
    if arch != "gpt_oss":
        return None
    try:
        from tokenizers import Tokenizer as HFTokenizer

        from minakv.presets.tiny_text import GPT_OSS_TEMPLATE
        from minakv.text.tokenizer import Tokenizer, gpt_oss_tokenizer_json

        tok = HFTokenizer.from_file(str(gpt_oss_tokenizer_json()))
        return Tokenizer(tok, GPT_OSS_TEMPLATE, "<|startoftext|>", "<|return|>", "<|endoftext|>",
                         eos_token_ids=[200002, 199999, 200012])  # fmt: skip
    except Exception:  # noqa: BLE001 (no quicktok here: run on token ids)
        return None


def build_dummy(
    model: str, device: torch.device, dtype: torch.dtype, seed: int = 0, parallel: Parallel = SINGLE
) -> CausalLM:
    """`load_format="dummy"`: the model named (a real shape above, or a local directory's config.json) with
    random weights drawn on the device; under `parallel`, this rank's share of them."""
    hf = real_config(model)
    if hf is None:
        path = Path(model).expanduser() / "config.json"
        if not path.is_file():
            names = ", ".join(REAL_CONFIGS)
            raise ValueError(
                f"load_format='dummy' needs one of {names} or a directory with config.json, got {model!r}"
            )
        hf = json.loads(path.read_text())
    with torch.no_grad():
        return build_model(
            ModelConfig.from_hf(hf), device, dtype, seed=seed, device_rng=True, parallel=parallel
        )
