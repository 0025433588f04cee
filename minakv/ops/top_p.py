"""The exact top-p threshold of each row, without a sort, in integer arithmetic so any split of the row gives
the same answer.

Top-p keeps the smallest set of the highest-probability tokens whose mass reaches top_p. With F(v) the mass
of the tokens with z > v, the kept set is {z >= v*} where v* is the smallest value with F(v*) < top_p * total:
F is a step function that only changes at the row's own values, so that boundary is itself one of them.
Floats map to integers in the same order (flip the bits of negative floats), so a search of the integer
range finds v* exactly: each pass over the row sums the mass above WAYS - 1 cut points at once, and
ceil(32 / log2(WAYS)) + 1 passes narrow the 32-bit range to one value (about 19 reads of the row at 4 ways,
instead of a sort of it). Tokens outside the row's top-k (below `thr`) count neither in F nor in the total.

A token's mass is exp(z - max z), in (0, 1], rounded to an integer with 40 fractional bits (MASS_BITS), and
summed as int64: integer sums do not depend on their order, so F, and v*, are the same whether one program
walks the row or many programs each sum a slice and add their parts atomically. That lets the few-row case
(decode at batch 1: one program walking 201,088 logits 19 times, ~0.45 ms on an H100) spread each pass over
SPLITS programs, one launch a pass, while a seeded row still gets the same threshold alone as in any batch.
(Masses below 2**-40 of the top token's, 28 nats down, round to zero: they cannot move a top-p boundary.)

    one program a row (many rows)         split (few rows)
    [max, total, pass 1 .. pass R]        max | total | pass 1 | ... | pass R | finish   (launches)
                                          each: a program per (row, slice), int64 atomics into acc[row, pass]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import check, num_sms

MASS_BITS = tl.constexpr(
    40
)  # fractional bits of a token's fixed-point mass: V * 2**40 < 2**63 up to 8M tokens
LOWEST = tl.constexpr(-2139095042)  # just below -inf's ordered key: F(LOWEST) = total >= target


@triton.jit
def _key(x):
    """float32 -> an int64 in the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _value(key):
    """The inverse of `_key`."""
    k32 = key.to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _cuts(lo, hi, WAYS: tl.constexpr):
    """WAYS cut keys spread over (lo, hi] (the last is hi), and their float values."""
    way = tl.arange(0, WAYS).to(tl.int64)
    cut = lo + ((hi - lo) * (way + 1)) // WAYS
    return cut, _value(cut)


@triton.jit
def _narrow(mass, target, lo, hi, cut, WAYS: tl.constexpr):
    """(lo, hi] -> the part holding v*: F is monotone, so v* lies above the last cut whose mass still reaches
    the target and at or below the first that does not."""
    way = tl.arange(0, WAYS).to(tl.int64)
    first = tl.min(tl.where(mass.to(tl.float64) < target, way, WAYS - 1), axis=0)
    new_hi = tl.sum(tl.where(way == first, cut, 0), axis=0)
    lo = tl.where(first > 0, tl.sum(tl.where(way == first - 1, cut, 0), axis=0), lo)
    return lo, new_hi


@triton.jit
def _masses(base, start, stop, thr, shift, v, BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """int64 [WAYS]: the fixed-point mass of the tokens start .. stop (at or above thr) above each cut v."""
    above = tl.zeros([WAYS, BLOCK], tl.int64)
    for s in range(start, stop, BLOCK):
        ids = s + tl.arange(0, BLOCK)
        z = tl.load(base + ids, mask=ids < stop, other=float("-inf"))
        m = tl.where(z >= thr, tl.exp(z - shift) * (2.0**MASS_BITS), 0.0).to(tl.int64)
        above += tl.where(z[None, :] > v[:, None], m[None, :], 0)
    return tl.sum(above, axis=1)


@triton.jit
def _row_max(base, start, stop, BLOCK: tl.constexpr):
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(start, stop, BLOCK):
        ids = s + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(base + ids, mask=ids < stop, other=float("-inf")))
    return tl.max(top, axis=0)


@triton.jit
def _top_p_row_kernel(z_ptr, thr_ptr, p_ptr, out_ptr, V, BLOCK: tl.constexpr, WAYS: tl.constexpr,
                      ROUNDS: tl.constexpr):  # fmt: skip
    """One program walks one row, pass after pass."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * V
    thr = tl.load(thr_ptr + row)
    shift = _row_max(base, 0, V, BLOCK)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    lowest = tl.full([WAYS], float("-inf"), tl.float32)  # every cut at -inf: each way sums the total
    total = tl.max(_masses(base, 0, V, thr, shift, lowest, BLOCK, WAYS), axis=0)
    target = tl.load(p_ptr + row).to(tl.float64) * total.to(tl.float64)
    lo, hi = tl.full([], LOWEST, tl.int64), _key(shift)
    for _ in range(ROUNDS):
        cut, v = _cuts(lo, hi, WAYS)
        lo, hi = _narrow(_masses(base, 0, V, thr, shift, v, BLOCK, WAYS), target, lo, hi, cut, WAYS)
    tl.store(out_ptr + row, _value(hi))


@triton.jit
def _split_max_kernel(z_ptr, pmax_ptr, V, chunk, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row, split = tl.program_id(0), tl.program_id(1)
    base = z_ptr + row.to(tl.int64) * V
    start = split * chunk
    tl.store(pmax_ptr + row * SPLITS + split, _row_max(base, start, tl.minimum(start + chunk, V), BLOCK))


@triton.jit
def _replay(acc_ptr, p_ptr, row, shift, passes, WAYS: tl.constexpr, ROUNDS: tl.constexpr):
    """(lo, hi) after `passes` passes whose masses are complete in acc[row] ([ROUNDS + 1, WAYS]: the
    total at [0, 0], pass q at [q])."""
    acc = acc_ptr + row.to(tl.int64) * (ROUNDS + 1) * WAYS
    way = tl.arange(0, WAYS)
    target = tl.load(p_ptr + row).to(tl.float64) * tl.load(acc).to(tl.float64)
    lo, hi = tl.full([], LOWEST, tl.int64), _key(shift)
    for q in range(1, passes + 1):
        cut, _ = _cuts(lo, hi, WAYS)
        lo, hi = _narrow(tl.load(acc + q * WAYS + way), target, lo, hi, cut, WAYS)
    return lo, hi


@triton.jit
def _split_shift(pmax_ptr, row, SPLITS: tl.constexpr):
    shift = tl.max(tl.load(pmax_ptr + row * SPLITS + tl.arange(0, SPLITS)), axis=0)
    return tl.where(shift == float("-inf"), 0.0, shift)


@triton.jit
def _split_pass_kernel(z_ptr, thr_ptr, p_ptr, pmax_ptr, acc_ptr, V, chunk, step, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr, WAYS: tl.constexpr, ROUNDS: tl.constexpr):  # fmt: skip
    """Pass `step` (0: the total) over one slice of a row: its masses added to acc[row, step]."""
    row, split = tl.program_id(0), tl.program_id(1)
    base = z_ptr + row.to(tl.int64) * V
    start = split * chunk
    stop = tl.minimum(start + chunk, V)
    shift = _split_shift(pmax_ptr, row, SPLITS)
    thr = tl.load(thr_ptr + row)
    way = tl.arange(0, WAYS)
    if step == 0:  # the total, in way 0 (no token is above +inf)
        v = tl.where(way == 0, float("-inf"), float("inf"))
    else:
        lo, hi = _replay(acc_ptr, p_ptr, row, shift, step - 1, WAYS, ROUNDS)
        _, v = _cuts(lo, hi, WAYS)
    mass = _masses(base, start, stop, thr, shift, v, BLOCK, WAYS)
    dest = acc_ptr + (row.to(tl.int64) * (ROUNDS + 1) + step) * WAYS + way
    tl.atomic_add(dest, mass)


@triton.jit
def _split_finish_kernel(p_ptr, pmax_ptr, acc_ptr, out_ptr, SPLITS: tl.constexpr, WAYS: tl.constexpr,
                         ROUNDS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    _, hi = _replay(acc_ptr, p_ptr, row, _split_shift(pmax_ptr, row, SPLITS), ROUNDS, WAYS, ROUNDS)
    tl.store(out_ptr + row, _value(hi))


def splits_for(rows: int, vocab: int, device: torch.device) -> int:
    """Programs a row is cut into: a power of two giving ~8 per SM over all rows, at most 64, each slice at
    least 2,048 tokens; 1 (one program walks the row) from 4 rows an SM. On an H100 at 201,088 tokens
    (bench/bench_sampler.py): 128 rows took 1.28 ms in 8 slices, 1.75 in 2, 1.87 in one program."""
    want = max(1, 8 * num_sms(device) // max(rows, 1))
    most = max(1, vocab // 2048)
    return min(1 << (want.bit_length() - 1), 64, 1 << (most.bit_length() - 1))


def ways_for(rows: int, splits: int) -> int:
    """The search's width: a few rows in slices spend each pass mostly on its launch, so 16 ways (10 passes,
    12 launches; 1 row: 0.38 ms against 0.74 at 4 ways, H100); elsewhere the per-token work of each cut
    counts (and one program's [16, BLOCK] tile would spill): 4."""
    return 16 if rows <= 8 and splits > 1 else 4


def top_p_threshold_triton(
    z: torch.Tensor,
    thr: torch.Tensor,
    top_p: torch.Tensor,
    *,
    splits: int | None = None,
    ways: int | None = None,
    block: int = 2048,
    num_warps: int = 8,
) -> torch.Tensor:
    """[R, 1]: the smallest z each row keeps under its top_p (rows with top_p >= 1 keep everything: -inf),
    among the tokens at or above `thr` [R, 1] (the top-k threshold, -inf for none). splits: programs per row
    (1: one walks the row; default `splits_for`); `ways` (a power of two; default `ways_for`), `block` and
    `num_warps` (of the one-program form) are knobs for bench/bench_sampler.py. The answer does not depend on
    any of them."""
    rows, vocab = z.shape
    check(vocab < 2 ** (63 - MASS_BITS.value), f"a vocabulary of {vocab} would overflow the int64 masses")
    z, thr, top_p = z.contiguous(), thr.contiguous(), top_p.contiguous()
    out = torch.empty(rows, device=z.device, dtype=torch.float32)
    splits = splits or splits_for(rows, vocab, z.device)
    ways = ways or ways_for(rows, splits)
    rounds = -(-32 // (ways.bit_length() - 1)) + 1  # 32 bits of range, log2(ways) per pass, one to spare
    if splits == 1:
        _top_p_row_kernel[(rows,)](z, thr, top_p, out, vocab, BLOCK=block, WAYS=ways, ROUNDS=rounds,
                                   num_warps=num_warps)  # fmt: skip
    else:
        chunk = triton.cdiv(vocab, splits)
        pmax = torch.empty(rows, splits, device=z.device, dtype=torch.float32)
        acc = torch.zeros(rows, rounds + 1, ways, device=z.device, dtype=torch.int64)
        meta = {"SPLITS": splits, "BLOCK": 512 if ways > 8 else 1024, "num_warps": 4}  # (registers)
        _split_max_kernel[(rows, splits)](z, pmax, vocab, chunk, **meta)
        for step in range(rounds + 1):
            _split_pass_kernel[(rows, splits)](z, thr, top_p, pmax, acc, vocab, chunk, step, WAYS=ways,
                                               ROUNDS=rounds, **meta)  # fmt: skip
        _split_finish_kernel[(rows,)](top_p, pmax, acc, out, SPLITS=splits, WAYS=ways, ROUNDS=rounds)
    return torch.where(top_p[:, None] < 1.0, out[:, None], float("-inf"))
