"""The batched sampler (minakv/worker/sampler.py) on the GPU at the gpt-oss vocabulary (201,088 ids).

Each setting is timed as `sample()` (device work only; the host does not wait) and as `sample_to_host()`
(the whole step's sampling, its one read-back included). The floor is one read of the float32 logits at the
copy bandwidth of the same run, so "x read" says how many logits-reads' worth of time the sampler takes.

Checks first: a seeded row gives the same tokens alone and inside a batch of 128 other rows (must be exact),
and the GPU agrees with the CPU on the same inputs (up to float rounding of the noise and the softmax, so a
small mismatch rate is allowed).

    python bench/bench_sampler.py          (on the GPU)
    python bench/bench_sampler.py --tiny   (CPU smoke test: a small vocabulary, wall-clock timing)
"""

from __future__ import annotations

import sys
import time

import torch
from common import Log

from minakv.ops.top_p import top_p_threshold_triton
from minakv.params import SamplingParams
from minakv.worker.sampler import SamplingTensors, sample, sample_to_host

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 1 + top_k 50": {"temperature": 1.0, "top_k": 50},
    "temperature 1 + top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "temperature 1 + top_p 0.9 + top_k 50": {"temperature": 1.0, "top_p": 0.9, "top_k": 50},
    "temperature 1 + top_p 0.9 + top_k 50 + logprobs 5": {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "logprobs": 5,
    },
}


def make(rows: int, vocab: int, device: str, setting: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(device)  # roughly an LM's spread
    params = [SamplingParams(**setting) for _ in range(rows)]
    t = SamplingTensors.build(params, list(range(1000, 1000 + rows)), [7] * rows, device)
    return logits, params, t


def check(log: Log, vocab: int, device: str) -> None:
    setting = SETTINGS["temperature 1 + top_p 0.9 + top_k 50"]
    logits, params, _ = make(128, vocab, device, {**setting, "temperature": 0.8})
    mixed = [SamplingParams(**s) for s in SETTINGS.values()]
    bad = 0
    for where in (0, 63, 127):
        for counter in range(8):
            target = params[where]
            alone = sample(
                logits[where : where + 1], SamplingTensors.build([target], [42], [counter], device)
            )
            ps = [mixed[i % len(mixed)] for i in range(128)]
            seeds, counters = list(range(128)), [counter * 3 + 1] * 128
            ps[where], seeds[where], counters[where] = target, 42, counter
            batch = sample(logits, SamplingTensors.build(ps, seeds, counters, device))
            bad += int(alone[0] != batch[where])
    log.add("check", name=f"seeded row alone vs in batch 128 (V={vocab})", err=bad / 24, tol=0.0)
    if device != "cpu":
        for name, setting in SETTINGS.items():
            logits, params, _ = make(128, vocab, device, setting, seed=1)
            err = 0.0
            for counter in range(4):
                ts = [
                    SamplingTensors.build(params, list(range(1000, 1128)), [counter] * 128, d)
                    for d in (device, "cpu")
                ]
                err += float((sample(logits, ts[0]).cpu() != sample(logits.cpu(), ts[1])).double().mean()) / 4
            log.add("check", name=f"gpu vs cpu tokens, {name}", err=err, tol=0.02)


def timer(device: str):
    if device == "cpu":

        def wall_ms(fn) -> float:
            fn()
            start, n = time.perf_counter(), 5
            for _ in range(n):
                fn()
            return (time.perf_counter() - start) / n * 1e3

        return wall_ms
    from common import bench_ms

    return bench_ms


def bench(log: Log, copy_bw: float, vocab: int, batches: tuple[int, ...], device: str) -> None:
    ms_of = timer(device)
    for rows in batches:
        read_ms = rows * vocab * 4 / copy_bw * 1e3
        greedy_ms = None
        for name, setting in SETTINGS.items():
            logits, params, t = make(rows, vocab, device, setting)
            calls = {
                "sample": lambda logits=logits, t=t: sample(logits, t),
                "to_host": lambda logits=logits, t=t, params=params: sample_to_host(logits, t, params),
            }
            for what, fn in calls.items():
                if what == "sample" and t.needs_logprobs:
                    continue  # the same device work as the row above; logprobs live in sample_to_host
                ms = ms_of(fn)
                greedy_ms = ms if (what, name) == ("to_host", "greedy") else greedy_ms
                log.add("bench", name=f"B={rows} {what} {name}", ms=ms, figure=f"{ms / read_ms:.1f} x read",
                        headline=rows >= 128, rows=rows, x_read=ms / read_ms, vs_greedy=ms / greedy_ms if greedy_ms else None)  # fmt: skip
        z = torch.randn(rows, vocab, device=device)
        log.add("bench", name=f"B={rows} (torch.sort of the logits alone)", ms=ms_of(lambda z=z: torch.sort(z, dim=-1)),
                figure="reference", headline=rows >= 128)  # fmt: skip
        if device == "cuda":
            top_p_ways(log, ms_of, z - z.amax(dim=-1, keepdim=True))
        ps = [SamplingParams(**SETTINGS["temperature 1 + top_p 0.9"]) for _ in range(rows)]
        seeds, counters = list(range(rows)), [3] * rows
        build_ms = ms_of(
            lambda ps=ps, seeds=seeds, counters=counters: SamplingTensors.build(ps, seeds, counters, device)
        )
        log.add("bench", name=f"B={rows} SamplingTensors.build", ms=build_ms, figure="host + one copy",
                headline=rows >= 128)  # fmt: skip


def top_p_ways(log: Log, ms_of, z: torch.Tensor) -> None:
    """The top-p threshold kernel's forms (one program a row, or the row in slices) and search widths (ways=2
    is plain halving): time, and the same threshold (exact: the masses are summed as integers)."""
    rows = z.shape[0]
    thr = torch.full((rows, 1), float("-inf"), device=z.device)
    top_p = torch.full((rows,), 0.9, device=z.device)
    ref = top_p_threshold_triton(z, thr, top_p, splits=1, ways=2, block=2048, num_warps=8)
    for splits, ways, block, warps in ((1, 2, 2048, 8), (1, 4, 2048, 8), (1, 4, 4096, 16), (1, 8, 2048, 8),
                                       (None, None, 2048, 8), (8, 4, 1024, 4), (32, 4, 1024, 4), (64, 4, 1024, 4),
                                       (64, 8, 1024, 4), (64, 16, 512, 4)):  # fmt: skip

        def fn(splits=splits, ways=ways, block=block, warps=warps) -> torch.Tensor:
            return top_p_threshold_triton(
                z, thr, top_p, splits=splits, ways=ways, block=block, num_warps=warps
            )

        form = "defaults" if splits is None else f"{splits} split{'s' if splits > 1 else ''}, {ways}-way"
        log.add("bench", name=f"B={rows} top-p threshold, {form}, block {block}, {warps} warps",
                ms=ms_of(fn), figure=f"same as halving: {torch.equal(fn(), ref)}", headline=rows >= 128)  # fmt: skip


def main() -> None:
    tiny = "--tiny" in sys.argv
    log = Log()
    if tiny:
        device, vocab, batches = "cpu", 1000, (1, 4)
        src = torch.randn(2**22)
        dst = torch.empty_like(src)
        copy_bw = 2 * src.numel() * 4 / (timer("cpu")(lambda: dst.copy_(src)) * 1e-3)
    else:
        from common import copy_bandwidth

        device, vocab, batches = "cuda", 201088, (1, 8, 128, 256)
        copy_bw = copy_bandwidth()
    log.add("bench", name="copy bandwidth", ms=0.0, figure=f"{copy_bw / 1e12:.3f} TB/s", headline=True)
    check(log, vocab, device)
    bench(log, copy_bw, vocab, batches, device)
    log.table()
    log.save("sampler_tiny.json" if tiny else "sampler.json")


if __name__ == "__main__":
    main()
