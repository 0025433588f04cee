"""MiniMax-M2: the shared decoder (no biases, QK RMSNorm over the whole q / k vector before the head
split, partial RoPE over the first `rotary_dim` dims of each head) plus its MoE block.

Router: a Linear without bias, sigmoid scores; `e_score_correction_bias` only decides which experts are
chosen; the weights are the chosen experts' unbiased scores renormalised to sum to 1. Experts: SiLU-gated
MLP, w1 = gate, w3 = up, w2 = down (stored fused as gate_up halves [E, 2I, H] and down [E, H, I]).
Under expert or tensor parallelism (minakv/parallel/) the experts are the rank's share, as in gpt_oss.py.
"""

from __future__ import annotations

import torch
from torch import nn

from minakv.model.config import ModelConfig
from minakv.model.layers import CausalLM, fp8_resident
from minakv.ops.fp8_moe import moe_fp8
from minakv.ops.fp8_tile import KEYS
from minakv.ops.moe import moe, route_sigmoid_bias
from minakv.ops.routing import FUSED_MAX_TOKENS, block_counters, route_sigmoid_bias_fused
from minakv.ops.triton_util import use_triton
from minakv.parallel.experts import run_experts
from minakv.parallel.group import SINGLE, Parallel
from minakv.parallel.shard import local_config


class MiniMaxM2Experts(nn.Module):
    """The experts' weights as parameters, or (`fp8`: an FP8 checkpoint) as its e4m3 bytes with 128x128
    block scales, resident: gate_up [E, 2I, H] with its gate half's scale grid then its up half's, down
    [E, H, I] (minakv/ops/fp8_tile.py), dequantised in registers by minakv/ops/fp8_moe.py."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.fp8 = fp8_resident(config)
        if self.fp8:

            def blocks(n: int) -> int:
                return -(-n // 128)

            self.register_buffer("gate_up", torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn))
            self.register_buffer("gate_up_scale_inv", torch.empty(e, 2 * blocks(i), blocks(h)))
            self.register_buffer("down", torch.empty(e, h, i, dtype=torch.float8_e4m3fn))
            self.register_buffer("down_scale_inv", torch.empty(e, blocks(h), blocks(i)))
        else:
            self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down = nn.Parameter(torch.empty(e, h, i))
        self.sum_k = True  # False: the decode kernels may return k parts for the next norm (MiniMaxM2MoE)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            w = {k: getattr(self, k) for k in KEYS}
            return moe_fp8(x, w, weights, ids, activation="silu", sum_k=self.sum_k)
        return moe(x, self.gate_up, self.down, weights, ids, activation="silu", sum_k=self.sum_k)


class MiniMaxM2MoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.parallel = config.experts_per_tok, config.num_experts, parallel
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))  # kept in fp32
        self.experts = MiniMaxM2Experts(local_config(config, parallel))
        # as GptOssMoE: alone on its GPU, the k parts go to the next add_rms_norm, which sums them
        self.experts.sum_k = parallel.tp > 1 or parallel.ep > 1
        self.route_counts: torch.Tensor | None = None  # the fused router's counters (routing.py): `fuse`

    def fuse(self) -> None:
        """Make the fused router's counters once on the device, before any CUDA graph captures them."""
        self.route_counts = block_counters(self.gate.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.shape[0] <= FUSED_MAX_TOKENS:  # decode: one or two launches instead of seven
            weights, ids = route_sigmoid_bias_fused(
                x, self.gate.weight, self.e_score_correction_bias, self.top_k, counts=self.route_counts
            )
        else:
            weights, ids = route_sigmoid_bias(self.gate(x), self.e_score_correction_bias, self.top_k)
        return run_experts(self.experts, x, weights, ids, self.num_experts, self.parallel)


class MiniMaxM2Model(CausalLM):
    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__(config, MiniMaxM2MoE, parallel)
