"""MXFP4 (W4A16) mixture-of-experts: the experts' weights stay packed, 4 bits each, and are dequantized in
registers inside the GEMMs (minakv/ops/mxfp4_tile.py has the layout and the unpacking).

Why: decode is bound by the bytes of the chosen experts' weights. In MXFP4 an expert row of 2880 inputs
is 1,440 bytes plus 90 scale bytes, against 5,760 in bf16: 3.8x fewer bytes per step, and gpt-oss-120b
(61 GB packed, 234 GB in bf16) fits on one GPU.

`moe_mxfp4` computes the same function as `moe_loop` (minakv/ops/moe.py) on `dequantize_mxfp4` of the
same weights, and picks one of four paths:

  pairs <= experts      `moe_mxfp4_gemv` (minakv/ops/mxfp4_gemv.py): a GEMV per pair, on the GPU on the
                        tensor cores (mxfp4_mma.py); at one token 2.3x faster than the fused kernels
                        below on the H200 (RESULTS.md).
  <= 64 pairs an expert `moe_mxfp4_mma_grouped` (mxfp4_mma_grouped.py, compiled runs): pairs grouped by
                        expert, a grouped GEMM on the tensor cores in inline PTX (decode batches; at
                        gpt-oss-20b's 256 tokens 0.54 ms a layer against 0.94-1.13 for the two below);
                        up to 256 where the layer's scales fold into its weights (`fold`).
  few pairs (decode)    `moe_mxfp4_fused` (minakv/ops/mxfp4_fused.py; in the interpreter, and where the one
                        above does not fit): the two kernels of fused_moe.py with a packed weight tile.

  many pairs (prefill)  `moe_mxfp4_grouped` (minakv/ops/mxfp4_grouped.py): pairs sorted by expert, a
                        grouped GEMM over tiles of BLOCK_M rows of one expert, grouping built on the device;
                        from 512 pairs an expert the experts dequantized to bf16 once (`prefill_mode`).

Both end with a plain sum over each token's k slots (no atomics: deterministic) and neither syncs with
the host, so a decode step stays capturable in a CUDA graph. CPU tensors (outside the tests that run
Triton interpreted) take `moe_mxfp4_ref`: dequantize, then the per-expert loop.
"""

from __future__ import annotations

import torch

from minakv.ops.mxfp4_fused import moe_mxfp4_fused
from minakv.ops.mxfp4_gemv import moe_mxfp4_gemv
from minakv.ops.mxfp4_grouped import moe_mxfp4_grouped
from minakv.ops.mxfp4_layout import untile_rows
from minakv.ops.mxfp4_mma_grouped import moe_mxfp4_mma_grouped
from minakv.ops.mxfp4_tile import packed_shapes
from minakv.ops.quant import dequantize_mxfp4
from minakv.ops.triton_util import interpreting, use_triton

# the fused kernels up to this many (token, slot) pairs (their id scan grows with them); then the grouped GEMM
FUSED_MAX_PAIRS = 512
# prefill: dequantize a layer's experts to bf16 once from this many pairs an expert, if the copy fits in
BF16_ONCE_PER_EXPERT, BF16_ONCE_MAX_BYTES = 512, 2 << 30
# the tensor-core grouped GEMM (mxfp4_mma_grouped.py) from pairs > experts up to this many pairs an expert,
# or the second where the scales fold into the weights (there it beats the dot_scaled grouped GEMM up to 128)
MMA_GROUPED_MAX_PER_EXPERT, MMA_FOLD_MAX_PER_EXPERT = 64, 256


def tensor_cores_fit(x: torch.Tensor) -> bool:
    """Whether the tensor-core kernels (mxfp4_mma.py, mxfp4_mma_grouped.py) may take x: compiled runs (inline
    PTX) and 16-bit activations. They feed the MMAs fp16 activations, which would cost fp32 ones their
    precision (fp16 rounds each input by up to 2^-11 relative); those take the kernels with fp32 dots."""
    return not interpreting() and x.dtype in (torch.bfloat16, torch.float16)


def mma_grouped_fits(x: torch.Tensor, w: dict[str, torch.Tensor]) -> bool:
    """Whether mxfp4_mma_grouped.py serves this layer: `tensor_cores_fit`, and a warp's rows fit (16 of the
    intermediate size, 16 of the hidden size)."""
    return tensor_cores_fit(x) and w["gate_up_blocks"].shape[1] >= 32 and x.shape[1] >= 16


def moe_mxfp4(
    x: torch.Tensor,  # [T, H] bf16 / fp16 / fp32
    w: dict[
        str, torch.Tensor
    ],  # gate_up_blocks/_scales [E, 2I, H/32(, 16)], down_blocks/_scales [E, H, I/32(, 16)]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], gate/up "halves" like the packed rows
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    limit: float = 7.0,
    alpha: float = 1.702,
    sum_k: bool = True,
    fold: bool = False,
    x16: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype, the experts packed.
    sum_k=False lets the decode kernel return its k parts [T, k, H] fp32 (see `moe`). fold: every scale
    byte of the layer is in mxfp4_mma_grouped.FOLD_RANGE (`fold_fits`, decided once at load), so the
    grouped tensor-core GEMM may fold the scales into the weights. x16: x already in pair order
    (`takes_pair_order`: the router wrote it), for the tensor-core GEMV. w: in tiles (mxfp4_layout.py), as
    GptOssExperts holds them."""
    args = (x, w, topk_weights, topk_ids, gate_up_bias, down_bias, activation, limit, alpha)
    if not use_triton(x):
        return moe_mxfp4_ref(*args)
    if takes_gemv(topk_ids.numel(), w["gate_up_blocks"].shape[0]):
        config = gemv_config(topk_ids.numel())
        return moe_mxfp4_gemv(*args, sum_k=sum_k, x16=x16, **config | {"mma": tensor_cores_fit(x)})
    num_experts = w["gate_up_blocks"].shape[0]
    most = MMA_FOLD_MAX_PER_EXPERT if fold else MMA_GROUPED_MAX_PER_EXPERT
    if topk_ids.numel() <= most * num_experts and mma_grouped_fits(x, w):
        return moe_mxfp4_mma_grouped(
            *args, sum_k=sum_k, **grouped_config(topk_ids.numel() / num_experts, fold)
        )
    if topk_ids.numel() <= FUSED_MAX_PAIRS:
        return moe_mxfp4_fused(*args, sum_k=sum_k)
    return moe_mxfp4_grouped(*args, mode=prefill_mode(topk_ids.numel(), x, w))


def takes_gemv(num_pairs: int, num_experts: int) -> bool:
    """Few pairs next to the experts (each expert read about once): `moe_mxfp4_gemv`."""
    return num_pairs <= num_experts


def takes_pair_order(x: torch.Tensor, num_pairs: int, num_experts: int) -> bool:
    """Does `moe_mxfp4` read x through `pair_order` (the tensor-core GEMV, compiled runs)? Then the router can
    write that copy instead (routing.py `pair_out`), one launch fewer a layer."""
    return use_triton(x) and tensor_cores_fit(x) and takes_gemv(num_pairs, num_experts)


def gemv_config(num_pairs: int) -> dict:
    """The GEMV's settings, measured on the H200 at gpt-oss's shapes (bench/RESULTS.md, "Tensor-core GEMV"):
    the tensor-core GEMV (mxfp4_mma.py), 0.045 / 0.107 / 0.172 ms at 1 / 4 / 8 tokens (20b) against 0.054 /
    0.146 / 0.254 for the best CUDA-core strips, which stay for the interpreter: 4 rows x 32 groups at one
    token's pairs, 16 x 4 on 2 warps beyond."""
    if num_pairs <= 4:
        return {"block_n": 4, "groups": 32, "num_warps": 4, "mma": True}
    return {"block_n": 16, "groups": 4, "num_warps": 2, "mma": True}


def prefill_mode(num_pairs: int, x: torch.Tensor, w: dict[str, torch.Tensor]) -> str:
    """The grouped GEMM's mode: "bf16" (dequantize the layer's experts once, then the bf16 grouped GEMM) from
    BF16_ONCE_PER_EXPERT pairs an expert, where its fixed cost is amortized (on the H200 at gpt-oss-20b,
    4,096 tokens: 3.44 ms against 3.59-3.63 for "scaled"; RESULTS.md), if that transient copy stays under
    BF16_ONCE_MAX_BYTES (120b's 128 experts would take 6.4 GB a layer); "scaled" otherwise."""
    blocks = w["gate_up_blocks"].numel() + w["down_blocks"].numel()  # two weights a byte
    many = num_pairs >= BF16_ONCE_PER_EXPERT * w["gate_up_blocks"].shape[0]
    return "bf16" if many and x.dtype == torch.bfloat16 and 4 * blocks <= BF16_ONCE_MAX_BYTES else "scaled"


def grouped_config(per_expert: float, fold: bool = False) -> dict:
    """The grouped tensor-core GEMM's tiles for this many pairs an expert, measured on the H200 at gpt-oss's
    shapes (bench/RESULTS.md, "Grouped tensor-core GEMM", "Scales folded"): 2 row tiles a warp; 1 pair tile
    (8 pairs) up to 8 pairs an expert (on weights in tiles, H100 at 20b's 8: 0.236 ms against 0.263 for 2
    pair tiles, half of whose columns would be padding; "16-row tiles"), 2 up to 12 (folding loses there),
    then 4; where the layer folds: 4 folded up to 32, 8 folded (loads not unrolled, for registers) beyond."""
    if per_expert <= 8:
        return {"mr": 2, "nt": 1, "unroll": 2}
    if per_expert <= 12 or not fold:
        return {"mr": 2, "nt": 2 if per_expert <= 12 else 4, "unroll": 2}
    return (
        {"mr": 2, "nt": 4, "unroll": 2, "fold": True}
        if per_expert <= 32
        else {"mr": 2, "nt": 8, "unroll": 1, "fold": True}
    )


def moe_mxfp4_ref(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                  limit=7.0, alpha=1.702) -> torch.Tensor:  # fmt: skip
    """The torch path: dequantize to x's dtype, then `moe_loop` (syncs with the host; for CPU)."""
    from minakv.ops.moe import moe_loop  # here, not at the top: moe.py may dispatch to this module

    packed_shapes(x, w, topk_ids, activation)
    w = untile_rows(w)  # the tiles (mxfp4_layout.py) back in the checkpoint's rows, which dequantize reads
    gate_up = dequantize_mxfp4(w["gate_up_blocks"], w["gate_up_scales"], x.dtype)
    down = dequantize_mxfp4(w["down_blocks"], w["down_scales"], x.dtype)
    return moe_loop(
        x, gate_up, down, topk_weights, topk_ids, gate_up_bias, down_bias, activation, limit, alpha
    )
