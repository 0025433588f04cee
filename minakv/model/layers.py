"""The decoder pieces both families share: RMSNorm, attention, the decoder layer and the causal LM.

A family differs only in its feed-forward block (`make_mlp`) and in data read from the config: biases on
q/k/v/o, sinks, QK-norm, the sliding window of each layer, how much of each head rotates. The attention
module computes q, k, v un-rotated and hands them to `ctx.attend` (minakv/model/context.py): positions,
RoPE, the KV cache and the attention itself belong to the context, so the same model code runs under the
dense parity context, the walk oracle and the paged engine.

Parameter names mirror the Hugging Face checkpoints without the leading `model.`, so the loader maps
names with almost no rules.

Under tensor parallelism (`parallel.tp > 1`, minakv/parallel/) a rank's attention holds its share of the
heads: q/k/v produce only those, o_proj takes only those and its partial output is summed over the ranks.
MiniMax-M2's QK-norm spans all heads, so its sum of squares is summed over the ranks too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minakv.model.config import ModelConfig
from minakv.model.context import AttentionContext, AttentionLayer
from minakv.ops.bf16_gemv import linear
from minakv.ops.fp8_linear import linear_fp8
from minakv.ops.norm import add_rms_norm, rms_norm, rms_norm_two
from minakv.ops.rope import Rope
from minakv.parallel.group import SINGLE, Parallel
from minakv.parallel.shard import check_layout, local_config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, weight_in_fp32: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32  # GPT-OSS: weight applied in fp32 and kept in fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_in_fp32)

    def add(self, x: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + update, this norm of it), in one kernel on the GPU."""
        return add_rms_norm(x, update, self.weight, self.eps, self.weight_in_fp32)


class Linear(nn.Linear):
    """nn.Linear whose one-row forward (decode at batch 1) runs the bf16 GEMV (minakv/ops/bf16_gemv.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays as the checkpoint's FP8 e4m3 bytes with 128x128 block scales
    (MiniMax-M2): half the bytes of bf16, dequantised in registers (minakv/ops/fp8_linear.py). The buffer
    names are the checkpoint's (`weight`, `weight_scale_inv`)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        blocks = (-(-out_features // 128), -(-in_features // 128))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(blocks, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fp8(x, self.weight, self.weight_scale_inv)


def fp8_resident(config: ModelConfig) -> bool:
    """Does the checkpoint store FP8 weights that stay FP8 (MiniMax-M2's block-scaled format)?"""
    return (config.quantization or {}).get("quant_method") == "fp8"


def make_linear(config: ModelConfig, in_features: int, out_features: int, bias: bool) -> nn.Module:
    if fp8_resident(config) and not bias:
        return Fp8Linear(in_features, out_features)
    return Linear(in_features, out_features, bias=bias)


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, weight_in_fp32=config.arch == "gpt_oss")


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, index: int, rope: Rope, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        c = local_config(config, parallel)  # this rank's heads
        self.index, self.rope, self.parallel = index, rope, parallel
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.layer_windows[index]
        self.scale = c.head_dim**-0.5
        bias = c.attention_bias
        self.q_proj = make_linear(c, c.hidden_size, c.num_heads * c.head_dim, bias)
        self.k_proj = make_linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, bias)
        self.v_proj = make_linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, bias)
        self.o_proj = make_linear(c, c.num_heads * c.head_dim, c.hidden_size, bias)
        # MiniMax-M2 normalises the whole q / k vector (all heads at once) before the head split.
        self.q_norm = make_norm(c, c.num_heads * c.head_dim) if c.qk_norm else None
        self.k_norm = make_norm(c, c.num_kv_heads * c.head_dim) if c.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.sinks else None
        # q, k, v in one weight: fuse(); (weight, bias), or (FP8 weight, its scale grid)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.qkv_sizes = [c.num_heads * c.head_dim, *[c.num_kv_heads * c.head_dim] * 2]

    def fuse(self) -> None:
        """Serve q, k and v from one weight (the three projections' tensors become views of it), so a
        forward runs one GEMM instead of three: at decode batch 1 a launch costs more than its bytes. Plain
        linear layers, or FP8 ones whose rows fill whole 128-row scale blocks (their scale grids then stack
        as the weights do: MiniMax-M2's q, k and v, 6144 + 1024 + 1024 rows)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv is not None:
            return
        if all(type(p) is Linear for p in projs):
            weight = torch.cat([p.weight.detach() for p in projs])
            bias = torch.cat([p.bias.detach() for p in projs]) if projs[0].bias is not None else None
            for i, (p, w) in enumerate(zip(projs, weight.split(self.qkv_sizes))):
                p.weight = nn.Parameter(w, requires_grad=False)
                if bias is not None:
                    p.bias = nn.Parameter(bias.split(self.qkv_sizes)[i], requires_grad=False)
            self.qkv = (weight, bias)
        elif all(type(p) is Fp8Linear and p.weight.shape[0] % 128 == 0 for p in projs):
            weight = torch.cat([p.weight for p in projs])
            scales = torch.cat([p.weight_scale_inv for p in projs])
            for p, w, sc in zip(
                projs, weight.split(self.qkv_sizes), scales.split([n // 128 for n in self.qkv_sizes])
            ):
                p.weight, p.weight_scale_inv = w, sc  # (buffers: views of the stacked ones)
            self.qkv = (weight, scales)

    def _apply(self, fn, recurse: bool = True):
        """`.to()`, `.half()`, `to_empty()`: they replace the parameters one by one, so the fused weight would
        go stale; unfuse (the three projections stay correct on their own; Worker fuses again)."""
        self.qkv = None
        return super()._apply(fn, recurse)

    @property
    def spec(self) -> AttentionLayer:
        """What the context needs to know about this layer (built on access, so it follows `.to()`)."""
        return AttentionLayer(self.index, self.window, self.sinks, self.scale, self.rope)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv is not None:  # views of one [T, q + 2 kv] product: the kernels below take strides
            project = linear_fp8 if self.qkv[0].dtype == torch.float8_e4m3fn else linear
            q, k, v = project(x, *self.qkv).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.qk_norm(q, k)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = ctx.attend(self.spec, q, k, v)
        return self.parallel.attn_all_reduce(self.o_proj(out.reshape(n, self.num_heads * self.head_dim)))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.parallel.tp == 1:  # both in one launch
            qn, kn = self.q_norm, self.k_norm
            return rms_norm_two(q, qn.weight, k, kn.weight, qn.eps, qn.weight_in_fp32)
        # The norm is over all heads and a rank holds 1/tp of them: sum the squares over the ranks (q's
        # and k's in one all-reduce), then scale as rms_norm_ref does.
        squares = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)
        squares = self.parallel.attn_all_reduce(squares)
        tp = self.parallel.tp
        return scale_rms(q, squares[:, :1] / (tp * q.shape[-1]), self.q_norm), scale_rms(
            k, squares[:, 1:] / (tp * k.shape[-1]), self.k_norm
        )


def scale_rms(x: torch.Tensor, mean_square: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm of x given its mean square [T, 1] (computed elsewhere): minakv/ops/norm.py's rms_norm_ref."""
    xf = x.float() * torch.rsqrt(mean_square + norm.eps)
    if norm.weight_in_fp32:
        return (norm.weight.float() * xf).to(x.dtype)
    return norm.weight.to(x.dtype) * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, index: int, rope: Rope, mlp: nn.Module, parallel: Parallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, index, rope, parallel)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, ctx: AttentionContext, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h: this layer's input norm of it. Returns the stream after the layer and
        `next_norm` of it (the next layer's input norm, or the final norm): each residual add is fused
        with the norm that follows it."""
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, ctx))
        return next_norm.add(x, self.mlp(h))


class CausalLM(nn.Module):
    """`model(input_ids [T], ctx) -> hidden [T, H]` (final norm applied); `compute_logits(hidden)`.
    `parallel`: the rank's share of a tensor/expert-parallel model (minakv/parallel/); the embeddings,
    norms, routers and lm_head are replicated, so every rank computes the same logits."""

    def __init__(
        self,
        config: ModelConfig,
        make_mlp: Callable[[ModelConfig, Parallel], nn.Module],
        parallel: Parallel = SINGLE,
    ) -> None:
        super().__init__()
        check_layout(config, parallel)
        self.config, self.parallel = config, parallel
        with torch.device("cpu"):  # the tables are plain tensors, even when modules are built on "meta"
            self.rope = Rope(config.rotary_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rope, make_mlp(config, parallel), parallel)
            for i in range(config.num_layers)
        )
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (again after `to_empty`, which
        replaces parameters one module at a time)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def kv_heads(self) -> int:
        """The kv heads whose K/V this rank stores (all of them unless attention is split)."""
        return self.config.num_kv_heads // self.parallel.tp

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.spec for layer in self.layers]

    def fuse(self) -> None:
        """Merge what serving runs faster merged (each layer's q/k/v projections; the weights stay shared),
        and let modules that depend on their weights' values decide now (GptOssExperts: folded scales)."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse"):
                module.fuse()

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if not len(self.layers):
            return self.norm(x)
        h = self.layers[0].input_layernorm(x)
        following = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, following):
            x, h = layer(x, h, ctx, next_norm)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

    def fp32_parameters(self) -> list[nn.Parameter]:
        """Parameters kept in fp32 whatever the model dtype (as transformers keeps them)."""
        keep = [p for n, p in self.named_parameters() if n.endswith(("sinks", "e_score_correction_bias"))]
        keep += [m.weight for m in self.modules() if isinstance(m, RMSNorm) and m.weight_in_fp32]
        return keep
