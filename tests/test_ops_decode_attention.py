"""Decode attention: the Triton kernel (run by Triton's CPU interpreter) against the torch reference
computed in float64, on fresh random paged caches with windows, sinks, GQA ratios 1 and 8, page sizes 1
and 16, and requests with no key, one key and keys spread over several splits."""

from __future__ import annotations

import pytest
import torch
from helpers.triton import interpreted

from minakv.ops.decode_attention import decode_attention, decode_attention_ref, decode_attention_triton


def paged_slots(lengths: list[int], page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Slot lists of requests whose pages were handed out in random order; returns (slots, num_slots)."""
    pages_each = [-(-n // page_size) for n in lengths]
    total = sum(pages_each) + 3  # a few pages nobody uses
    order = torch.randperm(total, generator=gen)
    slots, first = [], 0
    for n, pages in zip(lengths, pages_each):
        mine = order[first : first + pages]
        first += pages
        slots.append((mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n])
    return torch.cat(slots), total * page_size


def random_case(group: int, page_size: int, lengths: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = (1 if group == 8 else 2), 32
    num_heads = group * num_kv_heads
    kv_slots, num_slots = paged_slots(lengths, page_size, gen)
    # Positions with gaps (dropped tokens) and, for the longest request, one key past the query.
    kv_pos, q_pos = [], []
    for n in lengths:
        pos = torch.randperm(3 * n + 2, generator=gen)[:n].sort().values
        kv_pos.append(pos)
        q_pos.append(int(pos[-2]) if n > 8 else (int(pos[-1]) + 1 if n else 0))
    return {
        "q": torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype),
        "v_cache": torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype),
        "kv_indptr": torch.tensor([0] + lengths).cumsum(0),
        "kv_slots": kv_slots,
        "kv_pos": torch.cat(kv_pos),
        "q_pos": torch.tensor(q_pos),
        "scale": head_dim**-0.5,
        "sinks": torch.randn(num_heads, generator=gen),
    }


def float64_ref(case: dict, window: int | None, sinks: bool) -> torch.Tensor:
    c = {k: (v.double() if k in ("q", "k_cache", "v_cache", "sinks") else v) for k, v in case.items()}
    return decode_attention_ref(**{**c, "sinks": c["sinks"] if sinks else None, "window": window})


@pytest.fixture
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.empty` hands out NaN-filled tensors: the kernels' partial buffers start as NaN, so a merge that
    reads a chunk the split kernel did not write (an empty one) shows in the output."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


@interpreted
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (8, False), (8, True)])
def test_decode_matches_float64_reference(
    group: int, page_size: int, window: int | None, sinks: bool, nan_buffers: None
) -> None:
    # Request 0 has no key, 1 has one (two empty chunks), 2 spans several splits of 16-key blocks.
    case = random_case(group, page_size, [0, 1, 61], torch.float32, seed=group * 100 + page_size)
    ref = float64_ref(case, window, sinks)
    out = decode_attention_triton(
        **{**case, "sinks": case["sinks"] if sinks else None}, window=window, block_n=16, num_splits=3
    )
    assert rel_err(out, ref) < 1e-5
    assert out[0].abs().max() == 0  # a query that may read nothing outputs 0 (sinks carry no value)


@interpreted
@pytest.mark.parametrize("window", [None, 1, 8, 200])
def test_ascending_rows_read_only_the_window(window: int | None) -> None:
    """The engine's rows (strictly increasing positions, the query's own key last): skipping all but the
    last `window` keys changes nothing, in the kernel and in the reference; and the shortcut is not
    taken for free: a query at an earlier position would see other keys."""
    case = random_case(8, 16, [0, 1, 61, 150], torch.float32, seed=11)
    bounds = case["kv_indptr"].tolist()
    case["q_pos"] = torch.tensor([0] + [int(case["kv_pos"][b - 1]) for b in bounds[2:]])  # own key last
    ref = float64_ref(case, window, True)
    fast = decode_attention_triton(**case, window=window, block_n=16, ascending=True)
    assert rel_err(fast[1:], ref[1:]) < 1e-5
    ref_fast = decode_attention_ref(**case, window=window, ascending=True)
    assert rel_err(ref_fast[1:].double(), ref[1:]) < 1e-6
    if window == 8:  # the contract matters: with a key past the query the last 8 keys miss a visible one
        lengths = case["kv_indptr"].diff().tolist()
        case["kv_pos"] = torch.cat([torch.arange(n) for n in lengths])  # no gaps: 8 keys span 8 positions
        case["q_pos"] = torch.tensor([max(n - 2, 0) for n in lengths])
        assert rel_err(decode_attention_ref(**case, window=window, ascending=True)[2:].double(),
                       float64_ref(case, window, True)[2:]) > 1e-3  # fmt: skip


@interpreted
@pytest.mark.parametrize("window", [None, 8, 100])  # (a window allows fewer chunks: 1 and up to 2 here)
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_per_row_splits_match_reference(window: int | None, splits: int, nan_buffers: None) -> None:
    """Chunks cut from each request's own key count (CUDA graphs: no key bound known): rows of 0, 1, 61 and
    150 keys in 1, 3 or 7 chunks of whole 16-key blocks (7: some chunks of the short rows are empty, and
    neither written nor read: the partial buffers start as NaN here, so reading one would show)."""
    case = random_case(8, 16, [0, 1, 61, 150], torch.float32, seed=5 + splits)
    bounds = case["kv_indptr"].tolist()
    case["q_pos"] = torch.tensor([0] + [int(case["kv_pos"][b - 1]) for b in bounds[2:]])  # own key last
    ref = float64_ref(case, window, True)
    out = decode_attention_triton(**case, window=window, block_n=16, ascending=True, per_row_splits=splits)
    assert rel_err(out[1:], ref[1:]) < 1e-5


@interpreted
def test_decode_bf16_and_default_splits() -> None:
    case = random_case(8, 16, [33, 5, 70], torch.bfloat16, seed=7)
    ref = float64_ref(case, 16, True)
    out = decode_attention_triton(**case, window=16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


def test_decode_dispatches_to_reference_on_cpu() -> None:
    case = random_case(8, 1, [5, 9], torch.float32, seed=3)
    assert torch.equal(decode_attention(**case), decode_attention_ref(**case))


def test_decode_rejects_bad_shapes() -> None:
    case = random_case(1, 1, [5, 9], torch.float32, seed=3)
    with pytest.raises(ValueError, match="kv_indptr"):
        decode_attention_triton(**{**case, "kv_indptr": case["kv_indptr"][:-1]})
    with pytest.raises(ValueError, match="query heads"):
        decode_attention_triton(**{**case, "q": case["q"][:, :1]})
