"""GPT-OSS: the shared decoder (with attention sinks, q/k/v/o biases, sliding window on the layers the
config names, YaRN RoPE) plus its MoE block.

Router: a Linear *with bias*; the top-k logits are softmaxed among themselves. Experts: a clamped SwiGLU
variant, `(up + 1) * gate * sigmoid(alpha * gate)`, with biases on both projections; the down bias is
part of each expert's output, so it is weighted like the rest. The gate/up rows are stored as halves
(minakv.ops.moe); the loader de-interleaves the checkpoint's even (gate) / odd (up) layout.
"""

from __future__ import annotations

import torch
from torch import nn

from minakv.model.config import ModelConfig
from minakv.model.layers import CausalLM
from minakv.ops.moe import moe, route_softmax_topk


class GptOssExperts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down = nn.Parameter(torch.empty(e, h, i))
        self.down_bias = nn.Parameter(torch.empty(e, h))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        # Packed MXFP4 form when loaded from an MXFP4 checkpoint (rows in the same halves order as
        # gate_up): {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"}; for a kernel that
        # reads 4-bit weights. The forward here uses the dequantised parameters.
        self.mxfp4: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe(
            x, self.gate_up, self.down, weights, ids, self.gate_up_bias, self.down_bias,
            activation="swiglu_oai", limit=self.limit, alpha=self.alpha,
        )  # fmt: skip


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_softmax_topk(self.router(x), self.top_k)
        return self.experts(x, weights, ids)


class GptOssModel(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, GptOssMoE)
