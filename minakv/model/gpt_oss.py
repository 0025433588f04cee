"""GPT-OSS: the shared decoder (with attention sinks, q/k/v/o biases, sliding window on the layers the
config names, YaRN RoPE) plus its MoE block.

Router: a Linear *with bias*; the top-k logits are softmaxed among themselves. Experts: a clamped SwiGLU
variant, `(up + 1) * gate * sigmoid(alpha * gate)`, with biases on both projections; the down bias is
part of each expert's output, so it is weighted like the rest. The gate/up rows are stored as halves
(minakv.ops.moe); the loader de-interleaves the checkpoint's even (gate) / odd (up) layout.

Under expert or tensor parallelism (minakv/parallel/) a rank's `GptOssExperts` holds its block of experts
and its slice of their intermediate dim; the router stays whole, and `run_experts` exchanges the tokens
with the other ranks (all-to-all) or sums their partial outputs (all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from minakv.model.config import ModelConfig
from minakv.model.layers import CausalLM
from minakv.ops.moe import moe, route_softmax_topk
from minakv.ops.mxfp4_mma_grouped import fold_fits
from minakv.ops.mxfp4_moe import moe_mxfp4, takes_pair_order
from minakv.ops.routing import FUSED_MAX_TOKENS, block_counters, route_softmax_topk_fused
from minakv.ops.triton_util import check, use_triton
from minakv.parallel.experts import run_experts
from minakv.parallel.group import SINGLE, Parallel
from minakv.parallel.shard import local_config


class GptOssExperts(nn.Module):
    """The experts' weights, as bf16/fp32 parameters, or (`packed`, an MXFP4 checkpoint or dummy weights in
    its format) as the checkpoint's own MXFP4 bytes, which stay resident: 4.25 bits per weight instead of 16,
    so gpt-oss-120b's experts take 61 GB instead of 234; the loader lays them in 16-row tiles
    (minakv/ops/mxfp4_layout.py), the layout the kernels read fastest. Packed weights are dequantised in
    registers by the Triton kernels (minakv/ops/mxfp4_moe.py), or, on the CPU, by a dequantising reference."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.packed = (config.quantization or {}).get("quant_method") == "mxfp4"
        if self.packed:  # blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32], in tiles of 16 rows
            check(i % 16 == 0, f"MXFP4 experts need an intermediate size in whole 16-row tiles, not {i}")
            for name, rows, cols in (("gate_up", 2 * i, h), ("down", h, i)):
                self.register_buffer(
                    f"{name}_blocks", torch.empty(e, rows, cols // 32, 16, dtype=torch.uint8)
                )
                self.register_buffer(f"{name}_scales", torch.empty(e, rows, cols // 32, dtype=torch.uint8))
        else:
            self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_bias = nn.Parameter(torch.empty(e, h))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.sum_k = True  # False: the decode kernels may return k parts for the next norm (GptOssMoE)
        self.fold = False  # the scales fold into the weights in the grouped GEMM: `fuse`

    @property
    def mxfp4(self) -> dict[str, torch.Tensor] | None:
        """The packed weights by name (gate_up_blocks, gate_up_scales, down_blocks, down_scales)."""
        if not self.packed:
            return None
        return {
            n: getattr(self, n) for n in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")
        }

    def fuse(self) -> None:
        """Decide once, with the weights in place, whether the grouped tensor-core GEMM may fold each scale
        into its weights (every scale byte in its exact range; a host sync, so before any CUDA graph)."""
        self.fold = self.packed and fold_fits(self.mxfp4)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, x16: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x16: x in pair order for the packed GEMV, if the router wrote it (GptOssMoE)."""
        args = {"activation": "swiglu_oai", "limit": self.limit, "alpha": self.alpha, "sum_k": self.sum_k}
        if self.packed:
            packed = {"fold": self.fold, "x16": x16}
            return moe_mxfp4(x, self.mxfp4, weights, ids, self.gate_up_bias, self.down_bias, **packed, **args)
        return moe(x, self.gate_up, self.down, weights, ids, self.gate_up_bias, self.down_bias, **args)


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.parallel = config.experts_per_tok, config.num_experts, parallel
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(local_config(config, parallel))
        # Alone on its GPU the block may hand its k parts to the next add_rms_norm (DecoderLayer), which
        # sums them; split over ranks, the partial outputs are summed by a collective first.
        self.experts.sum_k = parallel.tp > 1 or parallel.ep > 1
        self.route_counts: torch.Tensor | None = None  # the fused router's counters (routing.py): `fuse`

    def fuse(self) -> None:
        """Make the fused router's counters once on the device, before any CUDA graph captures them."""
        self.route_counts = block_counters(self.router.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.shape[0] <= FUSED_MAX_TOKENS:  # decode: one or two launches instead of four
            # Alone on its GPU, where the packed experts take the tensor-core GEMV, the router's kernel also
            # writes x as that GEMV reads it (mxfp4_order.py): one launch fewer a layer.
            alone = self.experts.packed and self.parallel.world == 1
            x16 = None
            if alone and takes_pair_order(x, x.shape[0] * self.top_k, self.num_experts):
                x16 = torch.empty(x.shape, dtype=torch.float16, device=x.device)
            router = (self.router.weight, self.router.bias, self.top_k)
            weights, ids = route_softmax_topk_fused(x, *router, pair_out=x16, counts=self.route_counts)
            if x16 is not None:
                return self.experts(x, weights, ids, x16)
        else:
            weights, ids = route_softmax_topk(self.router(x), self.top_k)
        return run_experts(self.experts, x, weights, ids, self.num_experts, self.parallel)


class GptOssModel(CausalLM):
    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__(config, GptOssMoE, parallel)
