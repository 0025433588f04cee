"""Sampling kernels: the Gumbel-max draw over a whole row, and the exact top-p threshold without a sort.

`gumbel_argmax_triton`: per (row, vocabulary chunk), the counter-based noise of minakv/worker/sampler.py
(`neg_log_exponential`), the row's threshold and the chunk's argmax in one read of z; the chunks' winners
are then compared. No [R, V] temporaries.

`top_p_threshold_triton`: top-p keeps the smallest set of the highest-probability tokens whose mass reaches
top_p. With F(v) the mass of the tokens with z > v, the kept set is {z >= v*} where v* is the smallest
value with F(v*) < top_p * total: F is a step function that only changes at the row's own values, so that
boundary is itself one of them. Floats map to integers in the same order (flip the bits of negative
floats), so a search of the integer range finds v* exactly: each pass over the row sums exp(z) above 3
cut points at once (a 4-way search), and 17 passes narrow the 32-bit range to one value: about 19 reads
of the row instead of a sort of it (halving would take 34). H200, 128 rows x 201,088: 0.82 ms, against
2.56 ms for halving in 2,048-wide blocks (bench/RESULTS.md). Tokens outside the row's top-k (below
`thr`) count neither in F nor in the total.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D  # uint32 products wrap mod 2**32, as the masked int64 ones do
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(z_ptr, key_ptr, thr_ptr, shift_ptr, temp_ptr, best_ptr, idx_ptr, V, splits,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """One (row, vocabulary chunk): the noise of `neg_log_exponential`, the threshold, the chunk's argmax.
    SCALED: z_ptr holds raw logits, and z = (logits - shift) / temperature is formed here, rounded as torch
    rounds it (so the draw is the same as from a materialised z)."""
    row, split = tl.program_id(0), tl.program_id(1)
    key = tl.load(key_ptr + row).to(tl.uint32)
    thr = tl.load(thr_ptr + row)
    if SCALED:
        shift = tl.load(shift_ptr + row)
        temp = tl.load(temp_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2**31 - 1, tl.int32)
    for start in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, V), BLOCK):
        ids = start + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row.to(tl.int64) * V + ids, mask=ids < V, other=float("-inf"))
        if SCALED:
            z = tl.div_rn(z - shift, temp)
        x = _mix32(_mix32(ids.to(tl.uint32) * 0x3C6EF372) ^ key)
        u = tl.minimum((x.to(tl.float32) + 0.5) * 2.0**-32, 1.0 - 2.0**-24)
        score = tl.where(z >= thr, z - libdevice.log(-libdevice.log1p(-u)), float("-inf"))
        better = score > best  # strictly: an earlier id keeps a tie, as torch.argmax does
        best = tl.where(better, score, best)
        best_idx = tl.where(better, ids, best_idx)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, 2**31 - 1), axis=0)
    tl.store(best_ptr + row * splits + split, top)
    tl.store(idx_ptr + row * splits + split, tl.minimum(idx, V - 1))


def gumbel_argmax_triton(
    z: torch.Tensor,
    key: torch.Tensor,
    thr: torch.Tensor | None,
    shift: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused form of `neg_log_exponential` + mask + argmax: one read of z, no [R, V] temporaries. With
    shift and temperature ([R] or [R, 1] float32), z holds the raw logits and the kernel scales them itself:
    (z - shift) / temperature, without writing that [R, V] tensor and reading it back."""
    rows, vocab = z.shape
    chunk = 8192
    splits = triton.cdiv(vocab, chunk)
    if thr is None:
        thr = torch.full((rows, 1), float("-inf"), device=z.device)
    scaled = shift is not None and temperature is not None
    if not scaled:
        shift = temperature = thr  # unused
    best = torch.empty(rows, splits, device=z.device)
    idx = torch.empty(rows, splits, device=z.device, dtype=torch.int32)
    _gumbel_argmax_kernel[(rows, splits)](z.contiguous(), key, thr.contiguous(), shift.contiguous(),
                                          temperature.contiguous(), best, idx, vocab, splits, CHUNK=chunk,
                                          BLOCK=1024, SCALED=scaled, num_warps=4)  # fmt: skip
    return idx.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long()


@triton.jit
def _ordered(bits):
    """float32 bits (as int32) -> an int32 in the floats' order."""
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _top_p_kernel(z_ptr, thr_ptr, p_ptr, out_ptr, V, BLOCK: tl.constexpr, WAYS: tl.constexpr,
                  ROUNDS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * V
    thr = tl.load(thr_ptr + row)
    target = tl.load(p_ptr + row)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(base + ids, mask=ids < V, other=float("-inf")))
    shift = tl.max(top, axis=0)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        z = tl.load(base + ids, mask=ids < V, other=float("-inf"))
        total += tl.where(z >= thr, tl.exp(z - shift), 0.0)
    target = target * tl.sum(total, axis=0)
    lo = tl.full([], -2139095042, tl.int64)  # just below -inf's key: F = total >= target, false
    hi = _ordered(shift.to(tl.int32, bitcast=True)).to(tl.int64)  # F(max) = 0 < target: true
    # A WAYS-way search: each pass over the row tests WAYS - 1 cut points of (lo, hi] at once: one exp per
    # element, then a compare and add per cut point into a [WAYS, BLOCK] tile that is reduced only once,
    # after the pass (a reduction per block would cost more than the reads it saves).
    way = tl.arange(0, WAYS).to(tl.int64)
    for _ in range(ROUNDS):
        cut = lo + ((hi - lo) * (way + 1)) // WAYS  # cut[WAYS - 1] == hi
        c32 = cut.to(tl.int32)
        v = tl.where(c32 >= 0, c32, c32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        above = tl.zeros([WAYS, BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            z = tl.load(base + ids, mask=ids < V, other=float("-inf"))
            e = tl.where(z >= thr, tl.exp(z - shift), 0.0)
            above += tl.where(z[None, :] > v[:, None], e[None, :], 0.0)
        mass = tl.sum(above, axis=1)
        first = tl.min(tl.where(mass < target, way, WAYS - 1), axis=0)  # F is monotone in v
        new_hi = tl.sum(tl.where(way == first, cut, 0), axis=0)
        lo = tl.where(first > 0, tl.sum(tl.where(way == first - 1, cut, 0), axis=0), lo)
        hi = new_hi
    h32 = hi.to(tl.int32)
    tl.store(out_ptr + row, tl.where(h32 >= 0, h32, h32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True))


def top_p_threshold_triton(
    z: torch.Tensor,
    thr: torch.Tensor,
    top_p: torch.Tensor,
    *,
    ways: int = 4,
    block: int = 8192,
    num_warps: int = 16,
) -> torch.Tensor:
    """[R, 1]: the smallest z each row keeps under its top_p (rows with top_p >= 1 keep everything: -inf),
    among the tokens at or above `thr` [R, 1] (the top-k threshold, -inf for none). `ways` (a power of two;
    2 is plain halving), `block` and `num_warps` are knobs for bench/bench_sampler.py. One program walks a
    row, pass after pass, so a pass costs about (row / block) dependent loads: wide blocks hide that
    latency."""
    rows, vocab = z.shape
    out = torch.empty(rows, device=z.device, dtype=torch.float32)
    rounds = -(-32 // (ways.bit_length() - 1)) + 1  # 32 bits of range, log2(ways) per pass, one to spare
    _top_p_kernel[(rows,)](z.contiguous(), thr.contiguous(), top_p.contiguous(), out, vocab, BLOCK=block,
                           WAYS=ways, ROUNDS=rounds, num_warps=num_warps)  # fmt: skip
    return torch.where(top_p[:, None] < 1.0, out[:, None], float("-inf"))
