"""The per-row sampling numbers of one step (temperature, top-k, top-p, min-p, the noise key, penalties, logit
bias, grammar masks) as device tensors, built on the host in O(batch) work and a few small copies: what
minakv/worker/sampler.py reads. The row key is the counter-based noise stream's seed: a 32-bit hash of the
request's seed and how many tokens it has generated (`mix32`), so a row's noise depends on nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minakv.params import SamplingParams

MIN_TEMPERATURE = 1e-5  # below this a row is greedy: z = logits / T would only round the argmax differently
MASK32 = 0xFFFFFFFF
TOP_K_MAX = 2**31 - 1  # a top_k past any vocabulary keeps every token: larger ones are cut to this
# Multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 products never overflow.
MIX1, MIX2, GOLDEN = 0x7FEB352D, 0x5BD1E995, 0x3C6EF372


@dataclass
class SamplingTensors:
    """The per-row sampling numbers of one step on the device, plus host-side flags that pick the work."""

    temperature: torch.Tensor  # [R] float32, 1.0 on greedy rows (their result is the raw argmax)
    top_k: torch.Tensor  # [R] int64, V (no limit) where unset
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    key: torch.Tensor  # [R] int64: a 32-bit hash of (seed, counter), the row's noise stream
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_greedy: bool  # (none: the rows' raw argmax is not needed)
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # the largest top_k among sampled rows (0 when none)
    needs_logprobs: bool
    max_logprobs: int  # the largest top-n asked for (0 when only chosen logprobs, or none)
    # penalties (minakv/worker/penalties.py) and logit bias: None when no row asks for them
    penalty_rows: torch.Tensor | None = None  # [R] int64: the row of the penalty tables, -1 for none
    penalties: torch.Tensor | None = None  # [3, R] float32: presence, frequency, repetition
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, token, value) triples
    # structured outputs: None when no row has a grammar
    mask_rows: torch.Tensor | None = None  # [G] int64: the sample rows with a grammar
    token_mask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32: their allowed tokens, one bit each

    @property
    def filters(self) -> bool:
        """Does some sampled row cut its distribution (top-k, top-p, min-p)?"""
        return self.any_top_k or self.any_top_p or self.any_min_p

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        counters: list[int],
        device: torch.device | str,
        penalty_rows: list[int] | None = None,
        mask_rows: list[int] | None = None,
        token_mask: np.ndarray | None = None,
    ) -> SamplingTensors:
        """seeds: one per row (the request's seed, or one drawn once for it); counters: how many tokens the
        request has generated so far; penalty_rows: each row's row of the penalty tables (-1: none);
        mask_rows and token_mask: the rows with a grammar and their bitmask (ForwardBatch.token_mask).
        O(batch) host work (plus the logit-bias entries) and a few small host-to-device copies."""
        greedy = [p.temperature < MIN_TEMPERATURE for p in params]
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=torch.float64,
        )
        ints = torch.tensor(
            [
                [min(p.top_k, TOP_K_MAX) for p in params],  # (int64: past the vocabulary means all)
                greedy,
                [s & MASK32 for s in seeds],
                [(s >> 32) & MASK32 for s in seeds],
            ],
            dtype=torch.int64,
        )
        counter = torch.tensor(counters, dtype=torch.int64)
        # the row key is mixed here on the host ([R] values, cheap) so the device sees one copy and no launches
        ints[2] = mix32(ints[2] ^ mix32(ints[3] ^ mix32(counter * GOLDEN + GOLDEN)))
        packed = torch.cat([floats.view(torch.int64), ints[:3]])  # float bits ride along in the one copy
        packed = packed.to(device, non_blocking=True)  # small: pinning it would cost more than it saves
        f = packed[:3].view(torch.float64).float()
        top_k, g, key = packed[3:]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        extra: dict = {}
        if penalty_rows is not None and any(r >= 0 for r in penalty_rows):
            extra["penalty_rows"] = torch.tensor(penalty_rows, dtype=torch.int64).to(
                device, non_blocking=True
            )
            extra["penalties"] = (
                torch.tensor(
                    [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                    dtype=torch.float32,
                )
                .T.contiguous()
                .to(device, non_blocking=True)
            )
        triples = [(i, tok, val) for i, p in enumerate(params) for tok, val in (p.logit_bias or {}).items()]
        if triples:
            rows_, toks, vals = zip(*triples)
            extra["bias"] = (
                torch.tensor(rows_, dtype=torch.int64).to(device, non_blocking=True),
                torch.tensor(toks, dtype=torch.int64).to(device, non_blocking=True),
                torch.tensor(vals, dtype=torch.float32).to(device, non_blocking=True),
            )
        if mask_rows:  # one copy of the bitmask (4 bytes per 32 tokens per constrained row); non_blocking:
            # the host does not wait for the step before (pageable memory is staged at once: safe)
            extra["mask_rows"] = torch.tensor(mask_rows, dtype=torch.int64).to(device, non_blocking=True)
            extra["token_mask"] = torch.from_numpy(token_mask).to(device, non_blocking=True)
        return SamplingTensors(
            temperature=f[0],
            top_k=top_k,
            top_p=f[1],
            min_p=f[2],
            key=key,
            greedy=g.bool(),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(0 < p.top_k for p, gr in zip(params, greedy) if not gr),
            any_top_p=any(p.top_p < 1.0 for p, gr in zip(params, greedy) if not gr),
            any_min_p=any(p.min_p > 0 for p, gr in zip(params, greedy) if not gr),
            max_top_k=max((p.top_k for p, gr in zip(params, greedy) if not gr), default=0),
            needs_logprobs=bool(wanted),
            max_logprobs=max(wanted, default=0),
            **extra,
        )


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (murmur-style xor-shift-multiply) on int64 values in [0, 2**32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 16)
