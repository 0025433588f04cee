"""What the quantised MoE kernels (MXFP4 and FP8, decode and prefill paths) share: grouping the (token, slot)
pairs by expert on the device, finding a grouped-GEMM program's tile, and the expert activation in registers.

    pairs  p0 p1 p2 p3 p4 p5        ids 3 0 3 1 0 3   (T * k pairs)
    order  p1 p4 | p3 | p0 p2 p5    sorted by expert; counts [2, 1, 0, 3]; starts [0, 2, 3, 3]
    tiles  [e0: p1 p4] [e1: p3] [e3: p0 p2 p5]   ceil(count / BLOCK_M) tiles per expert; tile_ends [1, 2, 2, 3]

The grouping is built with device ops only (no host sync): a counting sort for decode batches
(`sort_by_expert`: one program for few pairs, a program per chunk of pairs in two launches from
PARALLEL_SORT_PAIRS), torch's stable argsort beyond SORT_MAX_PAIRS pairs. So a step stays capturable in a
CUDA graph; the grid is sized from a bound the host knows (`max_tiles`), and programs past the last tile
return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import use_triton

ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}


def k_parts(y: torch.Tensor, num_tokens: int, parts: int, dtype: torch.dtype, sum_k: bool) -> torch.Tensor:
    """A decode MoE's end: its fp32 rows y [T * parts, H] (a token's k slots, times its split-K parts, one
    after another) -> [T, parts, H] for the caller's add_rms_norm to sum (minakv/ops/norm.py), or with
    sum_k their sum [T, H] in `dtype` (a plain sum: deterministic)."""
    out = y.view(num_tokens, parts, y.shape[-1])
    return out.sum(1).to(dtype) if sum_k else out


SORT_MAX_PAIRS = 8192  # up to here the counting sort beats torch's argsort (decode batches)
# from this many pairs the sort runs as a program per chunk (two launches) rather than one program walking
# every chunk. On an H100 (bench/moe_variants.py, step `sort`) two launches won at every size measured,
# 256-4,096 pairs: 120b's 128 experts 16.7 -> 10.8 us at 256 pairs, 202 -> 16 us at 4,096; 20b's 32 experts
# 12.3 -> 10.1 us at 256. (The H200 took 27.8 us a layer at 2,048 pairs in one program.)
PARALLEL_SORT_PAIRS = 256


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs sorted by expert, on the device -> (order, counts, starts, tile_ends, max_tiles)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_tiles = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    if use_triton(flat) and num_pairs <= SORT_MAX_PAIRS:  # one launch instead of a sort, a scatter, two scans
        order, counts, starts, tile_ends = sort_by_expert(flat.contiguous(), num_experts, block_m)
        return order, counts, starts, tile_ends, max_tiles
    order = torch.argsort(flat, stable=True)
    # scatter_add counts without the host sync that sizing a bincount needs
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    tile_ends = torch.cumsum((counts + block_m - 1) // block_m, 0, dtype=torch.int32)
    return order, counts, starts, tile_ends, max_tiles


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = 0, parallel: bool | None = None):
    """Pair indices grouped by expert (stable), per-expert counts and starts, and with block_m > 0 each
    expert's end in tiles of block_m rows (tile_ends, else None): no host sync. parallel (default: from
    PARALLEL_SORT_PAIRS pairs): a program per chunk of pairs, in two launches (`_count_kernel`, then
    `_place_kernel`), instead of one program for all."""
    num_pairs = ids.numel()
    order = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    counts, starts, tile_ends = torch.empty(3, num_experts, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(triton.next_power_of_2(num_pairs), 8192 // e_pad))  # a [chunk, E] one-hot per step
    meta = {"E_PAD": e_pad, "CHUNK": chunk, "TILES": block_m > 0}
    if parallel if parallel is not None else num_pairs >= PARALLEL_SORT_PAIRS:
        chunks = triton.cdiv(num_pairs, chunk)
        per_chunk = torch.empty(chunks, e_pad, dtype=torch.int32, device=ids.device)
        _count_kernel[(chunks,)](ids, per_chunk, num_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
        rows = max(1, min(triton.next_power_of_2(chunks), 8192 // e_pad))  # chunks' counts summed per step
        _place_kernel[(chunks,)](ids, per_chunk, order, counts, starts, tile_ends, num_pairs, num_experts,
                                 max(block_m, 1), chunks, ROWS=rows, **meta, num_warps=4)  # fmt: skip
    else:
        _sort_kernel[(1,)](ids, order, counts, starts, tile_ends, num_pairs, num_experts, max(block_m, 1),
                           **meta, num_warps=8)  # fmt: skip
    return order, counts, starts, tile_ends if block_m > 0 else None


@triton.jit
def _store_plan(counts, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, block_m, E_PAD: tl.constexpr,
                TILES: tl.constexpr):  # fmt: skip
    """The per-expert counts, their exclusive prefix sum (starts) and the tile ends -> memory; returns
    starts."""
    offs_e = tl.arange(0, E_PAD)
    starts = tl.cumsum(counts, 0) - counts
    tl.store(counts_ptr + offs_e, counts, mask=offs_e < num_experts)
    tl.store(starts_ptr + offs_e, starts, mask=offs_e < num_experts)
    if TILES:
        tl.store(
            tile_ends_ptr + offs_e, tl.cumsum((counts + block_m - 1) // block_m, 0), mask=offs_e < num_experts
        )
    return starts


@triton.jit
def _place(ids_ptr, order_ptr, p0, num_pairs, next_slot, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs p0 .. p0 + CHUNK to their slots: the start of their expert's run (next_slot [E]: past the pairs
    of earlier chunks) + the pairs of that expert before them in this chunk. Returns the chunk's counts."""
    offs = p0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    hot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    slot = tl.sum(hot * (tl.cumsum(hot, 0) - 1 + next_slot[None, :]), 1)
    tl.store(order_ptr + slot, offs, mask=offs < num_pairs)
    return tl.sum(hot, 0)


@triton.jit
def _count_kernel(ids_ptr, per_chunk_ptr, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One chunk of pairs: how many go to each expert -> per_chunk[chunk, :]."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), 0)
    tl.store(per_chunk_ptr + tl.program_id(0) * E_PAD + offs_e, counts)


@triton.jit
def _place_kernel(ids_ptr, per_chunk_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_pairs,
                  num_experts, block_m, chunks, ROWS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  TILES: tl.constexpr):  # fmt: skip
    """One chunk of pairs, after `_count_kernel`: every chunk's counts summed (all: the totals; those before
    this one: where its pairs start within each expert's run), then its pairs placed. The first program
    also stores the totals, starts and tile ends."""
    me = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, chunks, ROWS):
        offs_c = c0 + tl.arange(0, ROWS)
        ok = (offs_c < chunks)[:, None]
        part = tl.load(per_chunk_ptr + offs_c[:, None] * E_PAD + offs_e[None, :], mask=ok, other=0)
        totals += tl.sum(part, 0)
        before += tl.sum(tl.where((offs_c < me)[:, None], part, 0), 0)
    starts = tl.cumsum(totals, 0) - totals
    if me == 0:
        _store_plan(totals, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, block_m, E_PAD, TILES)
    _place(ids_ptr, order_ptr, me * CHUNK, num_pairs, starts + before, E_PAD, CHUNK)


@triton.jit
def _sort_kernel(ids_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_pairs, num_experts, block_m,
                 E_PAD: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """Counting sort in one program: counts, their exclusive prefix sum, then each pair's slot = start of
    its expert + pairs of that expert before it (earlier chunks, then a prefix sum within its chunk)."""
    offs_e = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), 0)
    next_slot = _store_plan(counts, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, block_m, E_PAD, TILES)
    for p0 in range(0, num_pairs, CHUNK):
        next_slot += _place(ids_ptr, order_ptr, p0, num_pairs, next_slot, E_PAD, CHUNK)


@triton.jit
def tile_start(tile, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """Tile `tile` -> (its expert (num_experts past the last tile), its first row in sorted order, how many
    of its BLOCK_M rows are the expert's)."""
    offs_e = tl.arange(0, E_PAD)
    ends = tl.load(tile_ends_ptr + offs_e, mask=offs_e < num_experts, other=2**30)
    expert = tl.sum((ends <= tile).to(tl.int32), 0)  # experts whose tiles all come before this one
    e = tl.minimum(expert, num_experts - 1)  # keep the loads in bounds; the caller returns past the end
    skip = (tile - tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)) * BLOCK_M
    return expert, tl.load(starts_ptr + e) + skip, tl.load(counts_ptr + e) - skip


@triton.jit
def my_tile(order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, N,
             E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """This program's tile -> (expert (num_experts past the last tile), first column, rows in sorted
    order [BLOCK_M], their pair indices, which rows are real)."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    expert, row0, left = tile_start(tl.program_id(0) // n_blocks, counts_ptr, starts_ptr, tile_ends_ptr,
                                    num_experts, E_PAD, BLOCK_M)  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < left
    rows = row0 + offs_m
    pair = tl.load(order_ptr + rows, mask=m_ok, other=0)
    return expert, (tl.program_id(0) % n_blocks) * BLOCK_N, rows, pair, m_ok


@triton.jit
def activate_tile(gate, up, limit, alpha, ACT: tl.constexpr):
    """The expert's activation on fp32 gate / up tiles of the same columns (minakv.ops.moe.activate)."""
    if ACT == 0:  # silu(gate) * up
        return gate * tl.sigmoid(gate) * up
    # GPT-OSS: gate clamped from above, up on both sides, and the "+1" on up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
