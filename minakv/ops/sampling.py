"""The Gumbel-max draw over a whole row (the top-p threshold it may take: minakv/ops/top_p.py).

`gumbel_argmax_triton`: per (row, vocabulary chunk), the counter-based noise of minakv/worker/sampler.py
(`neg_log_exponential`), the row's threshold and the chunk's argmax in one read of z; the chunks' winners
are then compared. No [R, V] temporaries.
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
