"""Decode attention on the GPU: correctness at real shapes, and speed at batch 64 x 8k context.

Shape (issue 6): head dim 64, 64 query and 8 KV heads, bf16. Decode is bound by the K/V bytes read, so
the figure is K/V bytes / time against the copy bandwidth measured in the same run, and the peer is
torch SDPA (GQA-aware, every backend that runs) on the same dense shape.

    python bench/bench_decode.py        (or through bench/run_h200.py)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Log, bench_ms, paged_slots, rel_err, run_alone
from torch.nn.attention import SDPBackend, sdpa_kernel

from minakv.ops.decode_attention import decode_attention_ref, decode_attention_triton

HQ, HKV, D = 64, 8, 64
BATCH, CTX = 64, 8192


def make_case(lengths: list[int], page_size: int, dtype: torch.dtype, heads=None, head_dim=None):
    hq, hkv = heads or (HQ, HKV)
    head_dim = head_dim or D
    slots, num_slots = paged_slots(lengths, page_size)
    kv_pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    return {
        "q": torch.randn(len(lengths), hq, head_dim, device="cuda").to(dtype),
        "k_cache": torch.randn(num_slots, hkv, head_dim, device="cuda").to(dtype),
        "v_cache": torch.randn(num_slots, hkv, head_dim, device="cuda").to(dtype),
        "kv_indptr": torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32),
        "kv_slots": slots,
        "kv_pos": kv_pos.to(torch.int32),
        "q_pos": torch.tensor([max(n - 1, 0) for n in lengths], device="cuda", dtype=torch.int32),
        "scale": head_dim**-0.5,
    }


def check(log: Log) -> None:
    cases = [
        # name, lengths, page size, dtype, window, sinks, (Hq, Hkv)
        ("b64x8k page16 sinks", [8192] * 64, 16, torch.bfloat16, None, True, (HQ, HKV)),
        ("b64x8k page16 sinks fp32", [8192] * 64, 16, torch.float32, None, True, (HQ, HKV)),
        (
            "ragged page1 window128 sinks",
            [0, 1, 17, 4096, 30000, 129],
            1,
            torch.bfloat16,
            128,
            True,
            (HQ, HKV),
        ),
        ("ragged page1 window128 fp32", [0, 1, 17, 4096, 30000, 129], 1, torch.float32, 128, True, (HQ, HKV)),
        ("gqa1 page16", [1, 3000, 8192, 0, 77], 16, torch.bfloat16, None, False, (8, 8)),
        ("gqa1 page16 fp32 window", [1, 3000, 8192, 0, 77], 16, torch.float32, 1000, True, (8, 8)),
    ]
    for name, lengths, page, dtype, window, sinks, heads in cases:
        case = make_case(lengths, page, dtype, heads)
        sink = torch.randn(heads[0], device="cuda") if sinks else None
        out = decode_attention_triton(**case, window=window, sinks=sink)
        ref_in = {k: (v.double() if k in ("q", "k_cache", "v_cache") else v) for k, v in case.items()}
        ref = decode_attention_ref(**ref_in, window=window, sinks=sink.double() if sinks else None)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        log.add("check", name=f"decode {name} {str(dtype)[6:]}", err=rel_err(out, ref), tol=tol)


def bench(log: Log, copy_bw: float, sweep: bool = True) -> None:
    batch, ctx = BATCH, CTX
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    dense = make_case([ctx] * batch, 1, torch.bfloat16)
    dense["kv_slots"] = torch.arange(batch * ctx, device="cuda", dtype=torch.int32)  # contiguous
    paged = make_case([ctx] * batch, 16, torch.bfloat16)

    def ours(case: dict, **kw) -> float:
        return bench_ms(lambda: decode_attention_triton(**case, max_kv_len=ctx, **kw))

    def row(name: str, ms: float, headline: bool = False, **extra) -> None:
        bw = kv_bytes / (ms * 1e-3)
        fig = f"{bw / 1e12:.2f} TB/s K/V read = {bw / copy_bw:.1%} of copy bw"
        log.add(
            "bench",
            name=name,
            ms=ms,
            bytes=kv_bytes,
            figure=fig,
            frac_copy=bw / copy_bw,
            headline=headline,
            **extra,
        )

    best = {}
    if sweep:
        configs = [{}]  # the defaults
        configs += [{"num_splits": sp} for sp in (2, 4, 8, 16)]
        configs += [
            {"block_n": 64, "num_warps": 4, "num_stages": 3},
            {"block_n": 128, "num_warps": 4, "num_stages": 3},
        ]
        configs += [
            {"block_n": 256, "num_warps": 4, "num_stages": 2},
            {"block_n": 256, "num_warps": 8, "num_stages": 2},
        ]
        timings = []
        for cfg in configs:
            try:
                ms = ours(paged, **cfg)
            except Exception as e:  # noqa: BLE001 (report and go on)
                log.add("note", name=f"decode config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            timings.append((ms, cfg))
            row(f"decode sweep {cfg}", ms)
        best = min(timings, key=lambda t: t[0])[1]
        log.add("note", name=f"decode best config {best}")
    ms_dense = ours(dense, **best)
    ms_paged = ours(paged, **best)
    sinks = torch.randn(HQ, device="cuda")
    ms_sinks = ours({**paged, "sinks": sinks, "window": 128}, **best)
    row("decode ours b64x8k contiguous slots", ms_dense, headline=True, config=str(best))
    row("decode ours b64x8k page16 random pages", ms_paged, headline=True, config=str(best))
    row("decode ours b64x8k page16 sinks+window128", ms_sinks, headline=True)

    # Peer: SDPA on the dense [B, H, T, D] layout of the same shape.
    q = dense["q"][:, :, None, :]
    k = torch.randn(batch, HKV, ctx, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(batch, HKV, ctx, D, device="cuda").to(torch.bfloat16)
    sdpa = {}
    for name, backend in [
        ("default", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ]:
        try:
            if backend is None:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            else:

                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            ms = bench_ms(fn)
        except Exception as e:  # noqa: BLE001 (report and go on)
            log.add("note", name=f"sdpa {name} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        sdpa[name] = ms
        row(f"decode torch SDPA {name} (dense, enable_gqa)", ms, headline=name == "default")
    fastest = min(sdpa.values())
    log.add("verdict", name="decode K/V bw / copy bw (page16)", value=kv_bytes / (ms_paged * 1e-3) / copy_bw, need=0.8,
            met=kv_bytes / (ms_paged * 1e-3) / copy_bw >= 0.8)  # fmt: skip
    log.add("verdict", name="decode speed vs fastest SDPA (dense)", value=fastest / ms_dense, need=0.85,
            met=fastest / ms_dense >= 0.85)  # fmt: skip


if __name__ == "__main__":
    run_alone("decode", check, bench)
