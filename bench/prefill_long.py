"""Prefill through the Engine: time to first token and prefill tokens/s of long prompts (32k-128k tokens), or of
many short ones at once (`--requests 128 --lengths 1024`: the prefill phase of bench/throughput.py), with the GPU
busy fraction, on the gpt-oss-20b-shaped model with random bf16 weights (bench/e2e_decode.py builds it) or a
real shape's dummy weights in its own precision (`--dummy gpt-oss-20b`: MXFP4 experts).

    PYTHONUNBUFFERED=1 python bench/prefill_long.py [--lengths 32768,100000] [--chunk 8192] [--requests 1]
        [--dummy PRESET] [--kernels] [--tiny]

Per length: `--requests` requests of that many random tokens, max_tokens 1, fresh prompts each time (no cache
hit); `--kernels` prints the timed run's kernels by device time.
The first run of each length is a warm-up (Triton compiles per shape); the second is timed under
torch.profiler: TTFT is its wall time, GPU busy the union of device-kernel intervals over that wall time
(agent_replay.py's `gpu_busy`). The prefill FLOP count (matmuls and attention, causal; window layers read at
most the window) over the wall time is given against the 680 TFLOP/s bf16 matmul peak of docs/design.md 5.
Rows are written to $OUT/prefill_long.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Log
from e2e_decode import DEVICE, build_ours, configs
from profiling import profiled

from minakv import Engine, SamplingParams

PEAK_FLOPS = 680e12


def prefill_flops(config, n: int) -> float:
    """Matmul FLOPs of a prefill of n tokens: projections, routed experts (top-k), lm_head of one token,
    and attention scores + values (causal over n on full layers, at most the window on sliding ones)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    proj = 2 * n * h * d * (2 * c.num_heads + 2 * c.num_kv_heads)
    experts = 2 * n * c.experts_per_tok * 3 * h * c.intermediate_size
    total = 0.0
    for layer in range(c.num_layers):
        window = c.layer_windows[layer]
        keys = n * (n + 1) / 2 if window is None else n * min(n, window)
        total += proj + experts + 4 * keys * d * c.num_heads
    return total + 2 * h * c.vocab_size


def print_kernels(prof, wall_s: float, top: int = 24) -> None:
    """The profiled run's kernels by device time: where a prefill's time goes."""
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows)
    print(f"--- kernels: {total / 1e3:.1f} ms of device time in {wall_s * 1e3:.1f} ms of wall")
    print("kernel | launches | ms | share")
    for e in rows[:top]:
        print(
            f"{e.key[:80]} | {e.count} | {e.device_time_total / 1e3:.2f} | {e.device_time_total / total:.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="32768,100000")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--requests", type=int, default=1, help="prompts of each length submitted at once")
    p.add_argument("--dummy", help="a real shape with dummy weights in its own precision (e.g. gpt-oss-20b)")
    p.add_argument("--kernels", action="store_true", help="print the timed run's kernels (CUDA)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if not args.tiny else [256, 512]
    options = {"kv_cache_tokens": args.requests * (max(lengths) + 1024), "max_num_batched_tokens": args.chunk,
               "max_num_seqs": max(8, args.requests), "enable_prefix_cache": False}  # fmt: skip
    if args.dummy and not args.tiny:
        engine = Engine(args.dummy, load_format="dummy", **options)
    else:
        _, ours = configs(args.layers if not args.tiny else 2, args.tiny)
        engine = Engine(build_ours(ours), **options)
    model = engine.model
    log, gen = Log(), torch.Generator().manual_seed(0)
    vocab = min(model.config.vocab_size, 200_000)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for n in lengths:
        for run in ("warm-up", "timed"):
            prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in range(args.requests)]
            if run == "warm-up":
                engine.generate(prompts, params, use_tqdm=False)
                continue
            with profiled(DEVICE == "cuda", keep=args.kernels) as found:
                engine.generate(prompts, params, use_tqdm=False)
            wall, busy, tokens = found["wall_s"], found["gpu_busy"], n * args.requests
            flops = args.requests * prefill_flops(model.config, n)
            log.add("prefill", tokens=n, requests=args.requests, chunk=args.chunk, ttft_s=round(wall, 3),
                    tok_s=round(tokens / wall), tflops=round(flops / wall / 1e12, 1),
                    of_peak=round(flops / wall / PEAK_FLOPS, 3), gpu_busy=busy)  # fmt: skip
            if "profile" in found:
                print_kernels(found["profile"], wall)
    log.save("prefill_long.json")


if __name__ == "__main__":
    main()
