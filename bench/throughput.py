"""Offline throughput: N requests of I random tokens in, O tokens out, all submitted at once (issue 12's
"512 x 1k in / 1k out" run, the shape of TRT-LLM's published gpt-oss-20b figure).

    PYTHONUNBUFFERED=1 python bench/throughput.py [--requests 512] [--input 1024] [--output 1024]
        [--paths mxfp4,bf16] [--preset gpt-oss-20b] [--tiny]

Paths, each in a fresh engine, one after another in the same process and run:
- `mxfp4`: `Engine(preset, load_format="dummy")`, random weights in the checkpoint's own format (GPT-OSS:
  MXFP4 experts, resident and dequantised in registers by the kernels).
- `bf16`: the same shape with random bf16 weights (bench/e2e_decode.py builds it; the 20b shape only).

Sampling: temperature 1, a seed per request, ignore_eos, so every request makes exactly O tokens. A warm-up
runs first: prefills up to one full chunk and decode batches of every size class (`warm_up`: Triton
compiles each kernel variant the run takes). Reported per path: wall seconds,
output tokens/s (the published figure's unit), total (input + output) tokens/s, mean TTFT, and the run cut
in two phases at the last first token: the prefill phase (every prompt read, while early requests already
decode) and the decode phase (only decode steps), with the output tokens of each, and the decode phase's
slow steps (graph captures, full garbage collections). The GPU busy fraction comes from a CUDA-only
profile of a window of decode steps (`--busy-window` seconds) of a second, shorter run of the same shape
(`--busy-output` tokens out): the profiler's start and the parse of its events at the end hold the GIL
for seconds, which would stall the timed run. Rows go to $OUT/throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from itertools import pairwise

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent_replay import MAX_TOKEN_ID
from common import Log
from e2e_decode import DEVICE, build_ours, configs
from host_sampler import print_samples, sample_thread
from prefill_long import print_kernels
from profiling import gpu_busy

from minakv import Engine, SamplingParams


def make_engine(path: str, args: argparse.Namespace) -> Engine:
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "enable_prefix_cache": False}  # fmt: skip
    if args.tiny:
        _, config = configs(2, True)
        return Engine(build_ours(config, torch.float32), **options)
    if path == "mxfp4":
        return Engine(args.preset, load_format="dummy", **options)
    if path == "bf16":
        _, config = configs(24, False)  # the gpt-oss-20b shape
        return Engine(build_ours(config, torch.bfloat16), **options)
    raise ValueError(f"unknown path {path!r} (expected mxfp4 or bf16)")


async def run(
    engine: Engine,
    prompts: list[list[int]],
    output: int,
    busy_window: float,
    sample_host: bool = False,
    detokenize: bool = True,
    kernels: bool = False,
) -> dict:
    ttfts: list[float] = []
    events: list[tuple[float, int]] = []  # (time, tokens) of every streamed output: the phases' tokens
    steps, captures, collections, unwatch = watch(engine)
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> int:
        params = SamplingParams(
            max_tokens=output, temperature=1.0, seed=i, ignore_eos=True, detokenize=detokenize
        )
        first, n = None, 0
        async for out in engine.stream(prompt, params):
            n += len(out.token_ids)
            events.append((time.perf_counter() - start, len(out.token_ids)))
            if first is None and out.token_ids:
                first = time.perf_counter()
                ttfts.append(first - start)
        return n

    async def window() -> dict:
        """Profile a window once every request has its first token (the decode phase)."""
        while len(ttfts) < len(prompts) and DEVICE == "cuda" and busy_window > 0:
            await asyncio.sleep(0.05)
        if DEVICE != "cuda" or busy_window <= 0:
            return {}
        from torch.profiler import ProfilerActivity, profile

        stacks = sample_thread(engine._thread) if sample_host else nullcontext({})
        with profile(activities=[ProfilerActivity.CUDA]) as prof, stacks as found:
            t = time.perf_counter()
            await asyncio.sleep(busy_window)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        if sample_host:
            print_samples(found, "the engine thread in the decode phase")
        if kernels:
            print_kernels(prof, wall)
        return gpu_busy(prof, wall)

    tasks = [one(i, p) for i, p in enumerate(prompts)]
    *counts, busy = await asyncio.gather(*tasks, window())
    wall = time.perf_counter() - start
    cut = max(ttfts, default=0.0)  # the last first token: from here on, decode steps only
    late = sum(n for t, n in events if t > cut)
    # each decode-phase step as (its start in the phase, its duration): slow ones (a capture, a collection, a
    # compile, a stalled thread) show as a long tail, and where they fall says which
    timeline = [(a - start - cut, b - a) for a, b in pairwise(steps) if a - start > cut]
    slow: list[tuple[float, float]] = []
    if timeline:
        durations = sorted(d for _, d in timeline)
        median = durations[len(durations) // 2]
        slow = [(t, d) for t, d in timeline if d > 2 * median]
        print(f"decode-phase steps: {len(durations)}, median {median * 1e3:.1f} ms, p99 "
              f"{durations[int(0.99 * len(durations))] * 1e3:.1f} ms, max {durations[-1] * 1e3:.0f} ms; "
              f"{len(slow)} over twice the median, {sum(d for _, d in slow):.2f} s in all (at "
              f"{', '.join(f'{t:.1f} s' for t, _ in slow[:12])}); graph captures in the run: "
              f"{len(captures)} taking {sum(captures):.2f} s; full garbage collections in the decode phase: "
              f"{sum(1 for t, _ in collections if t - start > cut)} taking "
              f"{sum(d for t, d in collections if t - start > cut):.2f} s", flush=True)  # fmt: skip
    unwatch()
    return {"wall_s": wall, "output_tokens": sum(counts), "ttft_mean_s": sum(ttfts) / max(len(ttfts), 1),
            "prefill_phase_s": cut, "prefill_phase_tokens": sum(counts) - late, "decode_phase_s": wall - cut,
            "decode_phase_tok_s": late / max(wall - cut, 1e-9),
            "gpu_busy_decode_window": busy.get("gpu_busy"),
            "slow_decode_steps": [(round(t, 3), round(d, 4)) for t, d in slow]}  # fmt: skip


def watch(engine: Engine) -> tuple[list[float], list[float], list[tuple[float, float]], Callable[[], None]]:
    """Record when each engine step starts, how long each CUDA graph capture takes (in-process worker), and
    when each full garbage collection ran and for how long (any thread: it holds the GIL); the last item
    undoes the watching."""
    starts: list[float] = []
    captures: list[float] = []
    collections: list[tuple[float, float]] = []
    step = engine.step
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                collections.append((began[0], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)

    def timed_step() -> list:
        starts.append(time.perf_counter())
        return step()

    engine.step = timed_step
    graphs = getattr(engine.worker, "graphs", None)
    if graphs is not None:
        capture = graphs._capture

        def timed_capture(*args):
            t = time.perf_counter()
            out = capture(*args)
            captures.append(time.perf_counter() - t)
            return out

        graphs._capture = timed_capture

    def unwatch() -> None:
        del engine.step  # the class's method again
        if graphs is not None:
            del graphs._capture
        gc.callbacks.remove(on_gc)

    return starts, captures, collections, unwatch


def warm_up(engine: Engine, hi: int, gen: torch.Generator, args: argparse.Namespace) -> None:
    """Compile, before the clock starts, every kernel the run will use: Triton compiles a kernel on its first
    use of each tile variant (the MXFP4 MoE picks one by pairs an expert) and shape class, ~20 s on a fresh
    machine (a first run in a fresh process measured 62-68 s, the same run in a second one 47 s). Prefills
    of 1-16 prompts (up to one full chunk: every prefill mode) and decode batches of each size class up to
    max_num_seqs, on short prompts. (CUDA graphs are still captured in the run, at first use of a batch
    as a server captures them.)"""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    chunk = max(1, min(args.requests, args.max_num_batched_tokens // max(args.input, 1)))
    for n in sorted({1, 2, 3, 4, chunk}):
        engine.generate(torch.randint(0, hi, (n, args.input), generator=gen).tolist(), params, use_tqdm=False)
    for n in sorted({8, 16, 64, 128, 256, args.max_num_seqs}):
        if n <= args.max_num_seqs:
            prompts = torch.randint(0, hi, (n, 16), generator=gen).tolist()
            engine.generate(prompts, params, use_tqdm=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--input", type=int, default=1024)
    p.add_argument("--output", type=int, default=1024)
    p.add_argument("--paths", default="mxfp4,bf16")
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument(
        "--busy-window",
        type=float,
        default=2.0,
        help="seconds of decode profiled (CUDA), in a second run of --busy-output tokens out",
    )
    p.add_argument("--busy-output", type=int, default=256)  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (a CPU smoke test)")
    p.add_argument("--no-detokenize", action="store_true",
                   help="token ids only, no text (as trtllm-bench's token-in / token-out runs)")  # fmt: skip
    p.add_argument(
        "--sample-host", action="store_true", help="sample the engine thread's stacks in the window"
    )
    p.add_argument("--kernels", action="store_true", help="print the decode window's kernels by device time")
    p.add_argument("--switch-interval", type=float, help="sys.setswitchinterval: how long a thread may keep "
                   "the GIL while another waits (CPython's default 0.005 s; no effect measured at 0.0005)")  # fmt: skip
    args = p.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.tiny:
        args.requests, args.input, args.output, args.max_num_seqs = 4, 16, 4, 8
    log = Log()
    gen = torch.Generator().manual_seed(0)
    frozen_before = gc.get_freeze_count()
    for path in args.paths.split(","):
        engine = make_engine(path, args)
        # (the engine's collector settings, minakv/gc_pauses.py: a process that froze objects before it once
        # kept them from being set)
        print(
            f"gc: {frozen_before} objects frozen before the first engine, {gc.get_freeze_count()} now; "
            f"thresholds {gc.get_threshold()}",
            flush=True,
        )
        hi = min(engine.model.config.vocab_size, MAX_TOKEN_ID)
        warm_up(engine, hi, gen, args)
        prompts = torch.randint(0, hi, (args.requests, args.input), generator=gen).tolist()
        detokenize = not args.no_detokenize
        row = asyncio.run(run(engine, prompts, args.output, 0.0, False, detokenize))  # timed: no profiler
        if DEVICE == "cuda" and args.busy_window > 0:
            # GPU busy from a second, shorter run of the same shape, profiled in its decode phase: the
            # profiler's start and its parse at the end hold the GIL for seconds, so not in the timed run
            probe = torch.randint(0, hi, (args.requests, args.input), generator=gen).tolist()
            profiled = asyncio.run(run(engine, probe, args.busy_output, args.busy_window, args.sample_host,
                                       detokenize, args.kernels))  # fmt: skip
            row["gpu_busy_decode_window"] = profiled["gpu_busy_decode_window"]
        row.update(path=path, detokenize=not args.no_detokenize, switch_interval=sys.getswitchinterval(), pdl=engine.config.pdl, requests=args.requests, input=args.input, output=args.output,
                   output_tok_s=row["output_tokens"] / row["wall_s"],
                   total_tok_s=(row["output_tokens"] + args.requests * args.input) / row["wall_s"])  # fmt: skip
        log.add("throughput", **row)
        print(f"{path}: {row['wall_s']:.1f} s, {row['output_tok_s']:.0f} output tok/s, "
              f"{row['total_tok_s']:.0f} total tok/s, TTFT mean {row['ttft_mean_s']:.2f} s; prefill phase "
              f"{row['prefill_phase_s']:.1f} s ({row['prefill_phase_tokens']} output tokens), decode phase "
              f"{row['decode_phase_s']:.1f} s at {row['decode_phase_tok_s']:.0f} tok/s; "
              f"GPU busy (decode window of a second, profiled run) {row['gpu_busy_decode_window']}", flush=True)  # fmt: skip
        engine.shutdown()
        del engine
    log.save("throughput.json")


if __name__ == "__main__":
    main()
