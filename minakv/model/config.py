"""Model configuration: one flat dataclass read from a Hugging Face `config.json`.

Both families are described by the same fields; what differs between them is data (a window per layer,
whether sinks exist, how much of each head rotates), not code paths. Two spellings of the RoPE settings
exist in the wild: `rope_theta` + `rope_scaling` (real checkpoints, transformers 4.x) and
`rope_parameters` (what transformers 5.x saves). We read both; dropping YaRN silently is a classic bug.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "GptOssForCausalLM": "gpt_oss",
    "MiniMaxM2ForCausalLM": "minimax_m2",
}


@dataclass
class ModelConfig:
    arch: str  # "gpt_oss" or "minimax_m2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert
    num_experts: int
    experts_per_tok: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rotary_dim: int  # leading dims of each head that rotate (== head_dim unless partial)
    rope_scaling: dict[str, Any] | None  # e.g. {"rope_type": "yarn", "factor": 32.0, ...}
    layer_windows: list[int | None]  # sliding window (in positions, including the query) or None
    sinks: bool  # GPT-OSS: one learned logit per head in the softmax denominator
    attention_bias: bool
    qk_norm: bool  # MiniMax-M2: RMSNorm over the whole q / k vector before the head split
    swiglu_limit: float
    swiglu_alpha: float
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None and model_type in ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: minakv runs "
                f"{', '.join(ARCHITECTURES)} (model_type {', '.join(ARCHITECTURES.values())})"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        num_layers = hf["num_hidden_layers"]

        rope_params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            scaling = rope_params
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))

        rotary_dim = hf.get("rotary_dim")
        if rotary_dim is None:
            factor = hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
            rotary_dim = int(head_dim * factor)

        windows: list[int | None] = [None] * num_layers
        if arch == "gpt_oss":
            window = hf.get("sliding_window")
            types = hf.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
            windows = [window if t == "sliding_attention" else None for t in types]

        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            num_experts=hf.get("num_local_experts", hf.get("num_experts")),
            experts_per_tok=hf.get("num_experts_per_tok", hf.get("experts_per_token")),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 131072),
            rope_theta=float(theta),
            rotary_dim=rotary_dim,
            rope_scaling=scaling,
            layer_windows=windows,
            sinks=arch == "gpt_oss",
            attention_bias=hf.get("attention_bias", arch == "gpt_oss"),
            qk_norm=arch == "minimax_m2" and hf.get("use_qk_norm", True),
            swiglu_limit=hf.get("swiglu_limit", 7.0),
            swiglu_alpha=hf.get("swiglu_alpha", 1.702),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
            quantization=hf.get("quantization_config"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config = cls.from_hf(json.loads((Path(path) / "config.json").read_text()))
        gen = Path(path) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return config
