"""Tiny random models of both families, and the float64 MoE reference.

`tiny_model(family)` comes in two sizes:

- the engine size (default): the tiny GPT-OSS / MiniMax-M2 configs below (vocab 384, 4 and 3 layers, a
  sliding window of 6 on GPT-OSS), every matrix scaled up so attention and routing are not flat. The
  engine tests run these against the walk oracle.
- `small=True`: vocab 64, hidden 32, 3 layers (`windows` sets each layer's sliding window), only the
  attention made sharp. The cache tests (oracle, segments) run many of these at once, in float64.
"""

from __future__ import annotations

import torch

from minakv.model import ModelConfig, build_model

ARCHS = ["gpt_oss", "minimax_m2"]

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 384, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072,
    "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
}  # fmt: skip
MINIMAX = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 384,
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rotary_dim": 8, "intermediate_size": 32, "num_local_experts": 6, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip


def small_config(family: str, windows: list[int | None] | None = None) -> ModelConfig:
    """GPT-OSS: YaRN, sinks, 3 layers with a sliding window of 3 positions on the even ones (so the last
    layer's K/V depend on a full-attention layer). MiniMax-M2: partial rotary (half of each head), qk-norm,
    3 full-attention layers (with 2, a dropped prefix could only show in K/V through positions)."""
    gpt = family == "gpt_oss"
    windows = windows or ([3, None, 3] if gpt else [None, None, None])
    return ModelConfig(
        arch=family, vocab_size=64, hidden_size=32, num_layers=len(windows), num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=16, num_experts=4, experts_per_tok=2, rms_norm_eps=1e-6,
        max_position_embeddings=512, rope_theta=10000.0, rotary_dim=8 if gpt else 4,
        rope_scaling=YARN if gpt else None, layer_windows=windows, sinks=gpt, attention_bias=gpt,
        qk_norm=not gpt, swiglu_limit=7.0, swiglu_alpha=1.702, tie_word_embeddings=False,
    )  # fmt: skip


def tiny_model(
    family: str,
    dtype: torch.dtype = torch.float64,
    seed: int | None = None,
    *,
    small: bool = False,
    windows: list[int | None] | None = None,
) -> torch.nn.Module:
    """A random tiny model (see the module docstring for the two sizes; seed: 0 by default, 1 if small)."""
    if small:
        model = build_model(
            small_config(family, windows), device="cpu", dtype=dtype, seed=1 if seed is None else seed
        )
        with torch.no_grad():  # sharper attention than the 0.02 init, so history differences show
            for layer in model.layers:
                layer.self_attn.q_proj.weight.mul_(20)
                layer.self_attn.k_proj.weight.mul_(20)
                if layer.self_attn.sinks is not None:
                    layer.self_attn.sinks.normal_(0, 1)
        return model
    if windows is not None:
        raise ValueError("windows apply to the small models only")
    seed = seed or 0
    config = ModelConfig.from_hf(GPT_OSS if family == "gpt_oss" else MINIMAX)
    model = build_model(config, device="cpu", dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.1)
        elif p.ndim >= 2 and "embed" not in name:
            p.data.mul_(8.0)  # std 0.16: sharper attention and logits than the 0.02 init
        else:
            p.data.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.3)  # biases, sinks, correction
    return model


def moe_reference(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation, limit, alpha):
    """The MoE one token and one expert at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = gate_up[e].double() @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            gate, up = h[:i], h[i:]
            if activation == "silu":
                a = gate * torch.sigmoid(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = down[e].double() @ a
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(weights[t, slot]) * y
    return out
