"""Segment attention on the GPU: correctness at real shapes, and speed against FlexAttention and SDPA.

Shape (issue 6): head dim 64, 64 query and 8 KV heads, bf16, 8192 query tokens.
- "restore": 8 segments of 1024 tokens; segment g sees the tokens of segments < g except a dropped
  quarter of each ([256, 512) of every earlier segment), plus its own causal prefix. Peer: FlexAttention
  (compiled) with the same mask as a mask_mod, on dense [1, H, T, D] tensors.
- "causal": one segment of 8192 tokens, no context (plain prefill). Peer: SDPA is_causal, enable_gqa.
The figure is FLOP/s over visible (query, key) pairs (4 * D FLOPs per pair and head).

    python bench/bench_segment.py        (or through bench/run_h200.py)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Log, bench_ms, paged_slots, rel_err

from minakv.ops.segment_attention import plan_segments, segment_attention_ref, segment_attention_triton

HQ, HKV, D = 64, 8, 64
T, SEG, DROP = 8192, 1024, (256, 512)


def restore_case(t: int, seg: int, page_size: int, dtype: torch.dtype, heads=None, drop=None):
    """Token i at position i in a random paged slot; segments of `seg` tokens see the earlier segments'
    tokens minus the dropped span of each."""
    hq, hkv = heads or (HQ, HKV)
    drop = drop or DROP
    slots, num_slots = paged_slots([t], page_size)
    idx = torch.arange(t, device="cuda")
    kept = ~((idx % seg >= drop[0]) & (idx % seg < drop[1]))
    ctx = [idx[: g * seg][kept[: g * seg]] for g in range(t // seg)]
    ctx_idx = torch.cat(ctx)
    return {
        "q": torch.randn(t, hq, D, device="cuda").to(dtype),
        "k_cache": torch.randn(num_slots, hkv, D, device="cuda").to(dtype),
        "v_cache": torch.randn(num_slots, hkv, D, device="cuda").to(dtype),
        "q_pos": idx.to(torch.int32),
        "q_slots": slots,
        "seg_q_indptr": torch.arange(0, t + 1, seg, device="cuda", dtype=torch.int32),
        "seg_kv_indptr": torch.tensor([0] + [len(c) for c in ctx], device="cuda").cumsum(0).to(torch.int32),
        "kv_slots": slots[ctx_idx],
        "kv_pos": ctx_idx.to(torch.int32),
        "scale": D**-0.5,
    }


def causal_case(t: int, dtype: torch.dtype, heads=None):
    case = restore_case(t, t, 1, dtype, heads)
    case["q_slots"] = torch.arange(t, device="cuda", dtype=torch.int32)
    return case


def f64(case: dict) -> dict:
    return {k: (v.double() if k in ("q", "k_cache", "v_cache") else v) for k, v in case.items()}


def check(log: Log) -> None:
    sinks = torch.randn(HQ, device="cuda")
    cases = [
        ("restore 8x1024 page16", restore_case(T, SEG, 16, torch.bfloat16), None, None),
        ("restore 4x512 page1 window128 sinks", restore_case(2048, 512, 1, torch.bfloat16), 128, sinks),
        ("restore 4x512 page1 window128 sinks", restore_case(2048, 512, 1, torch.float32), 128, sinks),
        ("causal 4096", causal_case(4096, torch.bfloat16), None, None),
        ("causal 2048 fp32 sinks", causal_case(2048, torch.float32), None, sinks),
        (
            "gqa1 restore 4x300 page16 window100",
            restore_case(1200, 300, 16, torch.bfloat16, (8, 8)),
            100,
            sinks[:8],
        ),
        (
            "gqa1 restore 4x300 page16 window100",
            restore_case(1200, 300, 16, torch.float32, (8, 8)),
            100,
            sinks[:8],
        ),
    ]
    for name, case, window, sink in cases:
        out = segment_attention_triton(**case, window=window, sinks=sink)
        ref = segment_attention_ref(**f64(case), window=window, sinks=None if sink is None else sink.double())
        dtype = case["q"].dtype
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        log.add("check", name=f"segment {name} {str(dtype)[6:]}", err=rel_err(out, ref), tol=tol)
        del out, ref
    # Chunked prefill (8 chunks, each with all earlier chunks as context) equals the single causal segment.
    case = causal_case(4096, torch.bfloat16)
    whole = segment_attention_triton(**case)
    chunk = restore_case(4096, 512, 1, torch.bfloat16, drop=(0, 0))
    chunk.update(q=case["q"], k_cache=case["k_cache"], v_cache=case["v_cache"], q_slots=case["q_slots"])
    chunk["kv_slots"] = case["q_slots"][chunk["kv_pos"].long()]
    log.add("check", name="segment chunked == whole prefill bf16", err=rel_err(segment_attention_triton(**chunk), whole),
            tol=1e-2)  # fmt: skip


def visible_pairs_restore(t: int, seg: int) -> int:
    q = torch.arange(t, device="cuda")[:, None]
    k = torch.arange(t, device="cuda")[None, :]
    dropped = (k % seg >= DROP[0]) & (k % seg < DROP[1])
    vis = ((k // seg < q // seg) & ~dropped) | ((k // seg == q // seg) & (k <= q))
    return int(vis.sum())


# The candidates left after the sweeps recorded in bench/NOTES.md.
CONFIGS = [
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "maxnreg": 168},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 4, "maxnreg": 168},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "maxnreg": 128},
]


def bench(log: Log, sweep: bool = True) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def row(name: str, ms: float, pairs: int, headline: bool = False, **extra) -> float:
        tflops = 4 * D * HQ * pairs / (ms * 1e-3) / 1e12
        log.add("bench", name=name, ms=ms, figure=f"{tflops:.0f} TFLOP/s (visible pairs)", tflops=tflops,
                headline=headline, **extra)  # fmt: skip
        return tflops

    restore = restore_case(T, SEG, 16, torch.bfloat16)
    causal = causal_case(T, torch.bfloat16)
    pairs_restore, pairs_causal = visible_pairs_restore(T, SEG), T * (T + 1) // 2

    def plan(case: dict):
        meta = ("q_pos", "q_slots", "seg_q_indptr", "seg_kv_indptr", "kv_slots", "kv_pos")
        return plan_segments(*[case[m] for m in meta], max_seg_len=SEG if case is restore else T)

    plans = {id(restore): plan(restore), id(causal): plan(causal)}

    def ours(case: dict, **cfg) -> float:
        # The plan (key lists, flags) is shared by all layers of a forward, as Flex's block mask is:
        # both are built outside the timed region; the row "incl. plan" below times it inside.
        return bench_ms(lambda: segment_attention_triton(**case, plan=plans[id(case)], **cfg))

    best_r, best_c = {}, {}
    if sweep:
        res_r, res_c = [], []
        for cfg in CONFIGS:
            try:
                res_r.append((ours(restore, **cfg), cfg))
                res_c.append((ours(causal, **cfg), cfg))
            except Exception as e:  # noqa: BLE001 (report and go on)
                log.add("note", name=f"segment config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            row(f"segment sweep restore {cfg}", res_r[-1][0], pairs_restore)
            row(f"segment sweep causal {cfg}", res_c[-1][0], pairs_causal)
        best_r, best_c = min(res_r, key=lambda t: t[0])[1], min(res_c, key=lambda t: t[0])[1]
    ms_r = ours(restore, **best_r)
    ms_c = ours(causal, **best_c)
    row("segment ours restore 8x1024 page16", ms_r, pairs_restore, headline=True, config=str(best_r))
    row("segment ours causal 8192 (1 segment)", ms_c, pairs_causal, headline=True, config=str(best_c))
    ms_plan = bench_ms(lambda: segment_attention_triton(**restore, max_seg_len=SEG, **best_r))
    row("segment ours restore incl. plan_segments", ms_plan, pairs_restore, headline=True)

    # Peers on dense [1, H, T, D] tensors holding the same keys in token order.
    q = restore["q"].transpose(0, 1)[None]
    k = restore["k_cache"][restore["q_slots"].long()].transpose(0, 1)[None].contiguous()
    v = restore["v_cache"][restore["q_slots"].long()].transpose(0, 1)[None].contiguous()

    def restore_mask(b, h, qi, kj):
        dropped = (kj % SEG >= DROP[0]) & (kj % SEG < DROP[1])
        return ((kj // SEG < qi // SEG) & ~dropped) | ((kj // SEG == qi // SEG) & (kj <= qi))

    def causal_mask(b, h, qi, kj):
        return kj <= qi

    flex = torch.compile(flex_attention, dynamic=False)
    for name, mask_mod, pairs, mine in [
        ("restore", restore_mask, pairs_restore, ms_r),
        ("causal", causal_mask, pairs_causal, ms_c),
    ]:
        block_mask = create_block_mask(mask_mod, 1, 1, T, T, device="cuda")
        ms = bench_ms(lambda bm=block_mask: flex(q, k, v, block_mask=bm, enable_gqa=True))
        row(f"segment FlexAttention {name} (compiled)", ms, pairs, headline=True)
        if name == "restore":
            log.add(
                "verdict",
                name="segment restore: Flex time / ours",
                value=ms / mine,
                need=1.0,
                met=ms / mine > 1.0,
            )
    ms_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    row("segment torch SDPA causal 8192 (enable_gqa)", ms_sdpa, pairs_causal, headline=True)
    log.add(
        "verdict",
        name="causal prefill: SDPA time / ours",
        value=ms_sdpa / ms_c,
        need=0.8,
        met=ms_sdpa / ms_c >= 0.8,
    )


if __name__ == "__main__":
    log = Log()
    check(log)
    bench(log)
    log.table()
    log.save("segment.json")
