"""Decode throughput of the Engine across batch sizes, greedy and sampled, on the gpt-oss-20b-shaped model
with random bf16 weights (bench/e2e_decode.py builds it).

    PYTHONUNBUFFERED=1 python bench/decode_sweep.py [--batches 1,16,64,128,256] [--prompt 1024]
        [--layers 24] [--n1 8] [--n2 56] [--dummy gpt-oss-120b] [--tp 2] [--ep 2] [--tiny]

`--tp` / `--ep` (with `--dummy`): the model on max(tp, ep) GPUs, one worker process each
(docs/parallel.md). Then the bytes bound is the whole step's bytes over the GPUs' summed copy bandwidth
(as if every byte were split evenly; replicated weights make the real bound higher), and GPU busy is not
measured (the graphs live in the worker processes).

Sampling modes: `greedy` (temperature 0) and `sampled` (temperature 1, top_p 0.9, one seed per request,
so every request takes the seeded path of the sampler). Per (batch, mode): milliseconds per decode step
by difference of two generation lengths from fresh random prompts (bench/e2e_decode.py `step_times`:
(t(n2) - t(n1)) / (n2 - n1), best of `--repeats`, their median beside it; this removes prefill and
setup), output tokens/s, and the fraction of the bytes-read bound (e2e_decode `step_bytes` at the mean
context, over the copy bandwidth measured in this run; None on CPU). The sampled/greedy ratio is sampled
tok/s over greedy tok/s at the same batch.

GPU busy: the device time of one decode step, measured as the replay of the step's captured CUDA graph
alone (the forward; the sampler runs outside the graph and is not counted), over the measured wall time
per step. (A profiled window of the running engine is not used: its kernels and the window's wall clock
do not line up, and it reported fractions above 1.) One engine (prefix cache off) serves every row. Rows
are printed and written to $OUT/decode_sweep.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent_replay import MAX_TOKEN_ID, fmt
from common import Log, copy_bandwidth
from e2e_decode import DEVICE, build_ours, configs, graph_replay_ms, step_bytes, step_times

from minakv import Engine, SamplingParams
from minakv.model import make_meta_model

MODES = ("greedy", "sampled")
# (full defaults, --tiny defaults)
SIZES = {"batches": ("1,16,64,128,256", "1,4"), "prompt": (1024, 32), "n1": (8, 2), "n2": (56, 6),
         "repeats": (2, 1)}  # fmt: skip


def sampling(mode: str, batch: int, n: int, args: argparse.Namespace) -> list[SamplingParams]:
    if mode == "greedy":
        return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * batch
    return [SamplingParams(max_tokens=n, temperature=args.temperature, top_p=args.top_p, seed=1000 + i,
                           ignore_eos=True) for i in range(batch)]  # fmt: skip


def kernel_table(engine: Engine, batch: int, replays: int = 20, top: int = 24) -> None:
    """Print the kernels of one decode step's graph at `batch`: where the step's device time goes (each
    launch costs a few microseconds even when it moves almost no bytes)."""
    graphs = engine.worker.graphs
    g = graphs.find(batch) if graphs is not None else None
    if g is None:
        return
    from torch.profiler import ProfilerActivity, profile

    g.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.graph.replay()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows) / replays
    launches = sum(e.count for e in rows) / replays
    print(
        f"\n--- batch {batch}: {launches:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step"
    )
    print("kernel | per step | us per step | us each")
    for e in rows[:top]:
        n = e.count / replays
        print(
            f"{e.key[:70]} | {n:.0f} | {e.device_time_total / replays:.1f} | {e.device_time_total / e.count:.2f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", help="batch sizes (default 1,16,64,128,256)")
    p.add_argument("--prompt", type=int, help="prompt tokens per request (default 1024)")
    p.add_argument("--n1", type=int, help="shorter generation of the difference (default 8)")
    p.add_argument("--n2", type=int, help="longer generation of the difference (default 56)")
    p.add_argument("--repeats", type=int, help="best of this many differences (default 2)")
    p.add_argument("--no-profile", action="store_true", help="(ignored; kept for old command lines)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--kernels", action="store_true", help="print each batch's decode-step kernels (CUDA)")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled mode")
    p.add_argument("--top-p", type=float, default=0.9, help="of the sampled mode")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (a CPU smoke test)")
    p.add_argument(
        "--dummy", default=None, help="a real shape with dummy weights (gpt-oss-20b, gpt-oss-120b)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (with --dummy)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (with --dummy)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--no-pdl", action="store_true", help="EngineConfig.pdl off (programmatic dependent launch, sm_90+)"
    )
    p.add_argument(
        "--cublas",
        action="store_true",
        help="the bf16 projections through F.linear at batch 1 too (not the GEMV)",
    )
    p.add_argument(
        "--kv-tokens", type=int, default=None, help="KV pool size (default: what the batches need)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args(argv)
    for name, (full, tiny) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    if args.n2 <= args.n1:
        p.error("--n2 must exceed --n1")
    if max(args.tp, args.ep) > 1 and not args.dummy:
        p.error("--tp / --ep need --dummy (worker processes load the model by name)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: thread synchronisation costs more than it saves
    torch.manual_seed(0)
    bw = copy_bandwidth() * max(args.tp, args.ep) if DEVICE == "cuda" else None  # (summed over the GPUs)
    t = time.perf_counter()
    if args.cublas:  # (layers.py looks `linear` up at each call; worker processes would not see this)
        import minakv.model.layers

        minakv.model.layers.linear = torch.nn.functional.linear
    top = max(args.batches)
    longest = args.n2 + math.ceil(top * args.prompt / args.max_num_batched_tokens) + 8
    options = {
        "page_size": args.page_size,
        "kv_cache_tokens": args.kv_tokens or top * (args.prompt + longest + 16),
        "max_num_seqs": max(64, top),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_cache": False,
        "pdl": not args.no_pdl,
    }
    world = max(args.tp, args.ep)
    if world > 1:
        options.update(tensor_parallel_size=args.tp, expert_parallel_size=args.ep)
    if args.dummy:  # a real shape in its checkpoint's precision (GPT-OSS: MXFP4 experts)
        engine = Engine(args.dummy, load_format="dummy", **options)
        config = engine.model.config
        # worker processes hold the model: count its bytes on a storage-less copy of the same shapes
        model = engine.model if world == 1 else make_meta_model(config)
    else:
        _, config = configs(args.layers, args.tiny)
        model = build_ours(config, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
        engine = Engine(model, **options)
    params = sum(p.numel() for p in model.parameters()) + sum(
        2 * b.numel() for b in model.buffers() if b.dtype == torch.uint8
    )
    kv_tokens = engine.scheduler.kv.num_pages * args.page_size
    print(f"model: {params / 1e9:.2f} B parameters on {DEVICE}, built in {time.perf_counter() - t:.1f} s; "
          f"KV pool {kv_tokens} tokens")  # fmt: skip
    gen = torch.Generator().manual_seed(1)

    def prompts(batch: int) -> list[list[int]]:
        hi = min(config.vocab_size, MAX_TOKEN_ID)
        return torch.randint(0, hi, (batch, args.prompt), generator=gen).tolist()

    def runner(mode: str):
        def run(batch: int, n: int) -> None:
            outs = engine.generate(prompts(batch), sampling(mode, batch, n, args), use_tqdm=False)
            assert all(len(o.token_ids) == n for o in outs)

        return run

    log = Log()
    env = f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'} torch {torch.__version__}"
    log.add("env", env=env, params=params, copy_bw=bw, args=vars(args), kv_tokens=kv_tokens)
    rows: dict[tuple[int, str], dict] = {}
    for batch in args.batches:  # timings first: they use generate, before stream starts the engine thread
        context = args.prompt + (args.n1 + args.n2) / 2
        need = step_bytes(model, config, batch, context)
        for mode in args.modes:
            times = step_times(runner(mode), batch, args.n1, args.n2, repeats=args.repeats)
            s = min(times)
            rows[batch, mode] = {
                "batch": batch, "mode": mode, "ms_per_step": s * 1e3, "tok_s": batch / s,
                "ms_per_step_median": statistics.median(times) * 1e3,
                "bytes_per_step": need, "bound_ms": None if bw is None else need / bw * 1e3,
                "fraction_of_bound": None if bw is None else need / s / bw,
            }  # fmt: skip
        if "greedy" in args.modes and "sampled" in args.modes:
            ratio = rows[batch, "sampled"]["tok_s"] / rows[batch, "greedy"]["tok_s"]
            rows[batch, "sampled"]["sampled_over_greedy"] = ratio
        print({k: round(v["ms_per_step"], 3) for k, v in rows.items() if k[0] == batch}, flush=True)
    for (batch, mode), row in rows.items():
        replay_ms = graph_replay_ms(engine, batch, min(config.vocab_size, MAX_TOKEN_ID))
        row.update(
            graph_replay_ms=replay_ms, gpu_busy=None if replay_ms is None else replay_ms / row["ms_per_step"]
        )
        log.add("decode_sweep", **row)
    log.save("decode_sweep.json")
    if args.kernels and DEVICE == "cuda":
        for batch in args.batches:
            kernel_table(engine, batch)
    engine.shutdown()  # (worker processes stop with it)
    world = f", tp {args.tp}, ep {args.ep}" if max(args.tp, args.ep) > 1 else ""
    print(
        f"\n=== decode sweep, {args.dummy or f'{args.layers} layers'}{world}, prompt {args.prompt}, {env} ==="
    )
    print("batch | mode | ms/step | tok/s | of bytes bound | sampled/greedy | GPU busy (graph replay / step)")
    for r in rows.values():
        print(f"{r['batch']} | {r['mode']} | {r['ms_per_step']:.3f} | {r['tok_s']:.1f} | "
              f"{fmt(r['fraction_of_bound'], 1, 3)} | {fmt(r.get('sampled_over_greedy'), 1, 3)} | "
              f"{fmt(r['gpu_busy'], 1, 3)}")  # fmt: skip


if __name__ == "__main__":
    main()
