"""Segment attention: the Triton kernel (run by Triton's CPU interpreter) against the torch reference
computed in float64, on fresh random paged caches: windows, sinks, GQA ratios 1 and 8, page sizes 1 and
16, empty segments, single-query and single-key segments; and the prefill/chunked-prefill equivalence."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.segment_attention import (
    plan_segments,
    segment_attention,
    segment_attention_ref,
    segment_attention_triton,
)


def paged_slots(count: int, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """`count` slots, page by page, from pages handed out in random order; returns (slots, num_slots)."""
    pages = -(-count // page_size) + 2
    order = torch.randperm(pages, generator=gen)
    return (order[:, None] * page_size + torch.arange(page_size)).flatten()[:count], pages * page_size


def random_case(group: int, page_size: int, q_lens: list[int], ctx_lens: list[int], dtype, seed: int):
    """Parts with random context keys (gapped positions, as after drops) and consecutive own tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = (1 if group == 8 else 2), 32
    num_heads = group * num_kv_heads
    slots, num_slots = paged_slots(sum(q_lens) + sum(ctx_lens), page_size, gen)
    slots = slots[torch.randperm(len(slots), generator=gen)] if page_size == 1 else slots
    q_pos, kv_pos = [], []
    for n_q, n_ctx in zip(q_lens, ctx_lens):
        ctx = torch.randperm(2 * n_ctx + 3, generator=gen)[:n_ctx].sort().values
        kv_pos.append(ctx)
        start = int(ctx[-1]) + 1 if n_ctx else 0
        q_pos.append(torch.arange(start, start + n_q))
    return {
        "q": torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype),
        "v_cache": torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype),
        "q_pos": torch.cat(q_pos),
        "q_slots": slots[: sum(q_lens)],
        "seg_q_indptr": torch.tensor([0] + q_lens).cumsum(0),
        "seg_kv_indptr": torch.tensor([0] + ctx_lens).cumsum(0),
        "kv_slots": slots[sum(q_lens) :],
        "kv_pos": torch.cat(kv_pos),
        "scale": head_dim**-0.5,
        "sinks": torch.randn(num_heads, generator=gen),
    }


def float64_ref(case: dict, window: int | None, sinks: bool) -> torch.Tensor:
    c = {k: (v.double() if k in ("q", "k_cache", "v_cache", "sinks") else v) for k, v in case.items()}
    return segment_attention_ref(**{**c, "sinks": c["sinks"] if sinks else None, "window": window})


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


# Parts: no queries; one query and no context; one query with one context key; 37 queries over 29
# context keys (blocks straddle the context/own boundary); 20 queries with no context.
Q_LENS, CTX_LENS = [0, 1, 1, 37, 20], [4, 0, 1, 29, 0]


@interpreted
@pytest.mark.parametrize(
    "group,page_size,window,sinks",
    [
        (8, 1, None, False),
        (8, 16, None, True),
        (8, 16, 8, False),
        (8, 1, 8, True),
        (1, 16, None, True),
        (1, 1, 8, False),
    ],
)
def test_segments_match_float64_reference(
    group: int, page_size: int, window: int | None, sinks: bool
) -> None:
    case = random_case(
        group, page_size, Q_LENS, CTX_LENS, torch.float32, seed=group + page_size + (window or 0)
    )
    ref = float64_ref(case, window, sinks)
    args = {**case, "sinks": case["sinks"] if sinks else None, "window": window}
    out = segment_attention_triton(**args, block_m=16, block_n=16)
    assert rel_err(out, ref) < 1e-5


@interpreted
def test_segments_bf16_default_blocks() -> None:
    case = random_case(8, 16, Q_LENS, CTX_LENS, torch.bfloat16, seed=11)
    ref = float64_ref(case, 16, True)
    out = segment_attention_triton(**case, window=16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    meta = [case[m] for m in ("q_pos", "q_slots", "seg_q_indptr", "seg_kv_indptr", "kv_slots", "kv_pos")]
    planned = segment_attention_triton(**case, window=16, plan=plan_segments(*meta))
    assert torch.equal(planned, out)  # a plan built once gives what the per-call plan gives


@interpreted
def test_chunked_prefill_equals_one_segment() -> None:
    """Two chunks, the second with the first as context, give the same output as one causal segment."""
    case = random_case(8, 16, [40], [0], torch.float32, seed=5)
    whole = segment_attention_ref(**case, window=None)
    chunks = {
        "seg_q_indptr": torch.tensor([0, 17, 40]),
        "seg_kv_indptr": torch.tensor([0, 0, 17]),
        "kv_slots": case["q_slots"][:17],
        "kv_pos": case["q_pos"][:17],
    }
    chunked = segment_attention_triton(**{**case, **chunks}, block_m=16, block_n=16)
    assert rel_err(chunked, whole.double()) < 1e-5


@interpreted
def test_out_of_order_positions_take_the_masked_path() -> None:
    """A context key after the queries and own positions that go backwards (not produced by prefill, but
    allowed): visibility still follows positions, and own keys still need index causality."""
    case = random_case(8, 1, [0, 30, 20], [3, 25, 6], torch.float32, seed=8)
    case["kv_pos"][7] = case["q_pos"][10] + 5  # segment 1: a context key newer than its first queries
    case["q_pos"][30:50] = case["q_pos"][30:50].flip(0)  # segment 2: own positions go backwards
    for window in (None, 12):
        ref = float64_ref(case, window, True)
        out = segment_attention_triton(**case, window=window, block_m=16, block_n=16)
        assert rel_err(out, ref) < 1e-5


def test_segment_dispatches_to_reference_on_cpu() -> None:
    case = random_case(8, 1, [3, 4], [2, 0], torch.float32, seed=3)
    assert torch.equal(segment_attention(**case), segment_attention_ref(**case))


def test_segment_rejects_bad_shapes() -> None:
    case = random_case(8, 1, [3, 4], [2, 0], torch.float32, seed=3)
    with pytest.raises(ValueError, match="indptr"):
        segment_attention_triton(**{**case, "seg_kv_indptr": case["seg_kv_indptr"][:-1]})
    with pytest.raises(ValueError, match="q_pos"):
        segment_attention_triton(**{**case, "q_pos": case["q_pos"][:-1]})
