"""Which slice of each weight a rank holds: one function from (our parameter name, the full tensor) to the
rank's piece, shared by the loader (a checkpoint tensor, read on the host, cut before it moves to the
device) and by dummy weights (drawn whole, then cut, so a sharded dummy model is exactly a cut of the
unsharded one).

Attention, split `tp` ways by heads (Megatron's column / row split):
  q/k/v_proj rows, their biases, q/k_norm weights, sinks      the rank's heads (dim 0)
  o_proj columns                                              the rank's heads (dim 1)
  o_proj bias                                                 on attention rank 0, zeros elsewhere
Experts ([E, ...] in minakv/ops/moe.py's layout), cut to the rank's block of E / ep experts, then split
`moe_tp = world / ep` ways along the intermediate dim I:
  gate_up [E, 2I, H] (and its bias, MXFP4 blocks/scales, FP8 scale grid)   each half's rows (gate | up)
  down [E, H, I] (MXFP4 blocks/scales, FP8 scale grid)                     columns (dim 2)
  down_bias                                                                on moe_tp rank 0, zeros elsewhere
The biases that come after a sum live on one rank only, so the all-reduce adds them once. Everything
else (embeddings, lm_head, norms, routers) is replicated.

Quantised weights are cut in their packed form: MXFP4 groups of 32 and FP8 128x128 scale blocks must not
be split, so a split dim's slice must be a whole number of groups or blocks; `check_layout` says so up
front, naming the size that does not divide.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from minakv.parallel.group import Parallel, ParallelError

if TYPE_CHECKING:  # only the hints: importing minakv.model here would import this module back
    from minakv.model.config import ModelConfig

FP8_BLOCK, MXFP4_GROUP = 128, 32
COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
          "q_proj.weight_scale_inv", "k_proj.weight_scale_inv", "v_proj.weight_scale_inv",
          "q_norm.weight", "k_norm.weight", "sinks")  # fmt: skip
HALVES = ("gate_up", "gate_up_bias", "gate_up_blocks", "gate_up_scales", "gate_up_scale_inv")
DOWN = ("down", "down_blocks", "down_scales", "down_scale_inv")


def chunk(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Piece `index` of `t` cut into `parts` equal pieces along `dim`."""
    if t.shape[dim] % parts:
        raise ParallelError(f"a dim of {t.shape[dim]} cannot be split {parts} ways (shape {tuple(t.shape)})")
    size = t.shape[dim] // parts
    return t.narrow(dim, index * size, size)


def halves(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Rows (gate | up) -> (gate piece | up piece): each half cut like `chunk`."""
    gate, up = t.chunk(2, dim)
    return torch.cat([chunk(gate, dim, parts, index), chunk(up, dim, parts, index)], dim)


def first_only(t: torch.Tensor, index: int) -> torch.Tensor:
    return t if index == 0 else torch.zeros_like(t)


def shard(name: str, t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Our parameter or buffer `name` (e.g. layers.3.self_attn.q_proj.weight), full tensor -> this rank's."""
    if par.world == 1:
        return t
    if ".self_attn." in name:
        return shard_attention(name, t, par)
    if ".experts." in name:
        first, count = par.expert_range(t.shape[0])
        return shard_experts(name, t.narrow(0, first, count), par)
    return t


def shard_attention(name: str, t: torch.Tensor, par: Parallel) -> torch.Tensor:
    if par.tp == 1:
        return t
    if name.endswith(COLUMN):
        return chunk(t, 0, par.tp, par.attn_rank)
    if name.endswith(("o_proj.weight", "o_proj.weight_scale_inv")):
        return chunk(t, 1, par.tp, par.attn_rank)
    if name.endswith("o_proj.bias"):
        return first_only(t, par.attn_rank)
    raise ParallelError(f"no tensor-parallel rule for {name!r}")


def shard_experts(name: str, t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The intermediate split of the rank's experts: t is [local experts, ...] already."""
    leaf = name.rsplit(".", 1)[-1]
    if par.moe_tp == 1:
        return t
    if leaf in HALVES:
        return halves(t, 1, par.moe_tp, par.moe_tp_rank)
    if leaf in DOWN:
        return chunk(t, 2, par.moe_tp, par.moe_tp_rank)
    if leaf == "down_bias":
        return first_only(t, par.moe_tp_rank)
    raise ParallelError(f"no expert-parallel rule for {name!r}")


def local_config(config: ModelConfig, par: Parallel) -> ModelConfig:
    """The config whose shapes the rank's modules have: its heads, its experts, its intermediate slice.
    (Only module shapes read it; the model keeps the full config.)"""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // par.tp,
        num_kv_heads=config.num_kv_heads // par.tp,
        num_experts=config.num_experts // par.ep,
        intermediate_size=config.intermediate_size // par.moe_tp,
    )


def check_layout(config: ModelConfig, par: Parallel) -> None:
    """Raise ParallelError, naming the size, unless every weight of `config` cuts cleanly for `par`."""
    if par.world == 1:
        return
    c, method = config, (config.quantization or {}).get("quant_method")
    need = [
        ("attention heads", c.num_heads, par.tp, 1),
        ("kv heads", c.num_kv_heads, par.tp, 1),
        ("experts", c.num_experts, par.ep, 1),
        ("the expert intermediate size", c.intermediate_size, par.moe_tp, 1),
    ]
    if method == "mxfp4":  # down's input dim is packed in groups of 32
        need.append(("the MXFP4 expert intermediate size", c.intermediate_size, par.moe_tp, MXFP4_GROUP))
    if method == "fp8":  # 128x128 scale blocks along every split dim
        need += [
            ("the FP8 q projection rows", c.num_heads * c.head_dim, par.tp, FP8_BLOCK),
            ("the FP8 k/v projection rows", c.num_kv_heads * c.head_dim, par.tp, FP8_BLOCK),
            ("the FP8 expert intermediate size", c.intermediate_size, par.moe_tp, FP8_BLOCK),
        ]
    for what, size, parts, unit in need:
        if parts > 1 and (size % parts or (size // parts) % unit):
            grain = f" into whole blocks of {unit}" if unit > 1 else ""
            raise ParallelError(
                f"{what} ({size}) cannot be split {parts} ways{grain} (tensor_parallel_size {par.tp}, "
                f"expert_parallel_size {par.ep}); choose sizes that divide it"
            )
