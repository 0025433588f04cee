"""End-to-end decode on a gpt-oss-20b-shaped model with random bf16 weights: minakv's Engine against
transformers' `generate` on the same weights, in the same process (issue 6, acceptance 4).

    PYTHONUNBUFFERED=1 python bench/e2e_decode.py [--layers 24] [--batches 1,32] [--prompt 128]
        [--moe fused,grouped] [--profile 32]

Shape: 24 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts top-4 (intermediate 2880), vocab
201088, window 128 on even layers (transformers' GptOssConfig defaults, but 32 experts). Our weights are drawn on the GPU
(normal(0, 0.02), norms 1) and copied into transformers' layout (gate/up interleaved, [in, out]); a logits
check on one prompt confirms the two models compute the same function before anything is timed.

Per-step decode time is measured by difference: generate N1 and then N2 new tokens from fresh random
prompts of the same length and batch, (t(N2) - t(N1)) / (N2 - N1), which removes prefill and setup (best
of two repeats). The bytes-read bound (docs/design.md 5) counts per step: all non-expert weights of the layers,
the lm_head, the expected number of distinct experts touched (uniform routing: E(1 - (1 - k/E)^B)) times
an expert's bytes, and the K/V bytes of the active keys (window layers read at most the window); the
fraction is (bytes / step time) over the copy bandwidth measured in the same run.

`--moe` times our engine once per decode MoE path (minakv/ops/moe.py: the fused Triton kernels, or the
grouped GEMM) in the same run; the first one listed is compared with transformers. `--profile B` then
runs a few decode steps at batch B without CUDA graphs under torch.profiler and writes the kernels' time
table to $OUT/profile_b{B}.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import copy_bandwidth

from minakv import Engine, SamplingParams
from minakv.model import make_empty_model
from minakv.model.config import ModelConfig
from minakv.model.layers import RMSNorm
from minakv.ops import moe as moe_ops
from minakv.reference.dense import DenseContext

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only a smoke test of the script (--tiny)
TINY = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 1024, "sliding_window": 8}  # fmt: skip


def configs(layers: int, tiny: bool):
    import transformers

    shape = TINY if tiny else {}
    hf = transformers.GptOssConfig(  # (its defaults have 120b's 128 experts)
        num_hidden_layers=layers, num_local_experts=32, num_experts_per_tok=4, pad_token_id=0, **shape
    )
    d = hf.to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    return hf, ModelConfig.from_hf(d)


@torch.no_grad()
def build_ours(config: ModelConfig, dtype: torch.dtype = torch.bfloat16):
    torch.set_default_dtype(dtype)  # parameters are created in this dtype on "meta": no fp32 copy (84 GB)
    try:
        model = make_empty_model(config, torch.device(DEVICE), dtype)
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator(DEVICE).manual_seed(0)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for p in model.parameters():
        if id(p) in norms:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model


def interleave(t: torch.Tensor) -> torch.Tensor:
    """Halves (gate rows, then up rows) along dim 1 -> transformers' interleaved rows (gate, up, ...)."""
    i = t.shape[1] // 2
    return torch.stack((t[:, :i], t[:, i:]), dim=2).reshape(t.shape)


@torch.no_grad()
def build_hf(hf_config, ours, dtype: torch.dtype = torch.bfloat16):
    import transformers

    torch.set_default_dtype(dtype)  # parameters are created in bf16: never an fp32 copy
    try:
        with torch.device("meta"):
            hf = transformers.GptOssForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(torch.float32)
    hf.to_empty(device=DEVICE)
    with torch.device(DEVICE):  # buffers made on "meta" hold nothing: rebuild the rotary tables
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
    theirs = dict(hf.named_parameters())
    done = set()
    for name, p in ours.named_parameters():
        if name.endswith("experts.gate_up"):
            target, value = name + "_proj", interleave(p).transpose(1, 2)
        elif name.endswith("experts.gate_up_bias"):
            target, value = name.replace("gate_up_bias", "gate_up_proj_bias"), interleave(p)
        elif name.endswith("experts.down"):
            target, value = name + "_proj", p.transpose(1, 2)
        elif name.endswith("experts.down_bias"):
            target, value = name.replace("down_bias", "down_proj_bias"), p
        else:
            target, value = name, p
        if not target.startswith("lm_head"):
            target = "model." + target
        theirs[target].copy_(value)
        done.add(target)
    missing = set(theirs) - done
    assert not missing, f"transformers parameters not set: {sorted(missing)[:5]}"
    return hf.eval()


@torch.no_grad()
def logits_check(ours, hf, n: int = 16) -> float:
    ids = torch.randint(0, ours.config.vocab_size, (n,), device=DEVICE)
    ctx = DenseContext()
    ctx.advance(n)
    a = ours.compute_logits(ours(ids, ctx)).double()
    b = hf(ids[None]).logits[0].double()
    return float((a - b).norm() / b.norm())


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def step_time(run, batch: int, n1: int, n2: int, repeats: int = 2) -> float:
    """Seconds per decode step, by difference of two generation lengths: the best of `repeats`."""
    return min(step_times(run, batch, n1, n2, repeats))


def step_times(run, batch: int, n1: int, n2: int, repeats: int = 2) -> list[float]:
    """Each repeat's seconds per decode step, by difference of two generation lengths. The best of them can
    read below one graph replay of the step (GPU busy > 1): report the median beside it."""
    run(batch, n1)  # warm-up: kernels compiled, graphs captured, allocator settled
    out = []
    for _ in range(repeats):
        t1 = timed(lambda: run(batch, n1))
        t2 = timed(lambda: run(batch, n2))
        out.append((t2 - t1) / (n2 - n1))
    return out


def step_bytes(model, config: ModelConfig, batch: int, context: float) -> float:
    """Fewest bytes one decode step reads (docs/design.md 5)."""
    e, k = config.num_experts, config.experts_per_tok

    def size(module) -> int:  # parameters and buffers (packed MXFP4 experts are uint8 buffers)
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    expert = size(model.layers[0].mlp.experts) / e
    other = sum(size(layer) for layer in model.layers) - expert * e * config.num_layers
    touched = e * (1 - (1 - k / e) ** batch)
    lm_head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    per_key = 2 * config.num_kv_heads * config.head_dim * 2  # K and V in bf16
    kv = sum(batch * min(context, w or context) * per_key for w in config.layer_windows)
    return other + touched * expert * config.num_layers + lm_head + kv


def graph_replay_ms(engine: Engine, batch: int, vocab: int) -> float | None:
    """Device time of one decode step at `batch`: the median replay of the captured graph the engine used
    for it, with the inputs of its last step but a random token in every row (None on CPU or when none was
    captured). The last step was a run's tail, most rows padding (token 0, one set of experts): replayed
    as they were, gpt-oss-120b at batch 64 took 33.7 ms where its steps took 54.3 (H100)."""
    graphs = engine.worker.graphs
    g = graphs.find(batch) if graphs is not None else None
    if g is None:
        return None
    with torch.inference_mode():  # (the ids; the next real step rewrites the whole buffer)
        g.buffer[: g.batch].random_(0, vocab)
    return float(triton.testing.do_bench(g.graph.replay, warmup=10, rep=100, return_mode="median"))


def time_ours(engine: Engine, run, batch: int, args, need: float, bw: float) -> dict:
    """Our seconds per decode step, and the GPU time of one step alone (a replay of its CUDA graph)."""
    ours_s = step_time(run, batch, args.n1, args.n2)
    graphs = engine.worker.graphs
    replay_ms = graph_replay_ms(engine, batch, engine.model.config.vocab_size)
    return {
        "ours_ms": ours_s * 1e3, "ours_tok_s": batch / ours_s, "bound_ms": need / bw * 1e3,
        "bytes_per_step": need, "fraction_of_bound": need / ours_s / bw,
        "graphs": None if graphs is None else (graphs.failure or "captured"), "graph_replay_ms": replay_ms,
    }  # fmt: skip


def profile(model, prompts: list[list[int]], out_dir: str, steps: int = 6) -> None:
    """Kernel time table of `steps` decode steps at len(prompts) (eager: graphs hide the kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = Engine(model, page_size=16, kv_cache_tokens=len(prompts) * (len(prompts[0]) + 64),
                    max_num_batched_tokens=8192, max_num_seqs=max(64, len(prompts)), cuda_graphs=False)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # warm-up
    for p in prompts:
        engine.scheduler.add(
            engine._make(p, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
        )
    engine.step()  # prefill (and the first token) outside the profile
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
    name = f"profile_b{len(prompts)}.txt"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(f"{steps} decode steps at batch {len(prompts)}, eager\n{table}\n")
    print(table[:6000], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--n1", type=int, default=8)
    parser.add_argument("--n2", type=int, default=56)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--moe", default="fused", help="decode MoE paths to time: fused,grouped")
    parser.add_argument("--profile", type=int, default=0, help="profile decode at this batch (0: no)")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (smoke test of the script)")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    bw = copy_bandwidth() if DEVICE == "cuda" else 20e9
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    hf_config, config = configs(args.layers, args.tiny)
    t = time.perf_counter()
    ours = build_ours(config)
    params = sum(p.numel() for p in ours.parameters())
    print(
        f"minakv model: {params / 1e9:.2f} B parameters, built in {time.perf_counter() - t:.1f} s", flush=True
    )
    hf, err = None, None
    if not args.no_hf:
        t = time.perf_counter()
        hf = build_hf(hf_config, ours)
        impl = (hf.config._attn_implementation, getattr(hf.config, "_experts_implementation", None))
        print(f"transformers model built in {time.perf_counter() - t:.1f} s; attention/experts: {impl}")
        err = logits_check(ours, hf)
        print(f"logits minakv vs transformers: rel err {err:.3e}", flush=True)
        if err > 0.1:  # keep timing (same shapes either way), but say so loudly
            print("WARNING: the two models disagree: weight mapping broken?", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = max(batches) * (args.prompt + args.n2 + 16)

    def make_engine() -> Engine:  # one per MoE path: its CUDA graphs capture the path
        return Engine(ours, page_size=16, kv_cache_tokens=max_tokens, max_num_batched_tokens=8192,
                      max_num_seqs=max(64, max(batches)), enable_prefix_cache=False)  # fmt: skip

    engine = None
    gen = torch.Generator().manual_seed(1)

    def prompts(batch: int) -> list[list[int]]:
        return torch.randint(0, min(config.vocab_size, 200000), (batch, args.prompt), generator=gen).tolist()

    def run_ours(batch: int, n: int) -> None:
        assert engine is not None
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        outs = engine.generate(prompts(batch), params, use_tqdm=False)
        assert all(len(o.token_ids) == n for o in outs)

    def run_hf(batch: int, n: int) -> None:
        ids = torch.tensor(prompts(batch), device=DEVICE)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == args.prompt + n

    fused_max = moe_ops.FUSED_MAX_PAIRS
    paths = args.moe.split(",")
    rows = []
    for batch in batches:
        context = args.prompt + (args.n1 + args.n2) / 2
        need = step_bytes(ours, config, batch, context)
        for path in paths:
            moe_ops.FUSED_MAX_PAIRS = fused_max if path == "fused" else 0
            engine = None
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
            engine = make_engine()
            row = {"batch": batch, "moe": path, **time_ours(engine, run_ours, batch, args, need, bw)}
            print(json.dumps(row), flush=True)
            if hf is not None and path == paths[0]:
                hf_s = step_time(run_hf, batch, args.n1, args.n2, repeats=1)
                row.update(hf_ms=hf_s * 1e3, hf_tok_s=batch / hf_s, speedup=hf_s * 1e3 / row["ours_ms"])
                print(json.dumps(row), flush=True)
            rows.append(row)
    moe_ops.FUSED_MAX_PAIRS = fused_max
    if args.profile:
        engine = None
        profile(ours, prompts(args.profile), out_dir)
    env = f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'} torch {torch.__version__}"
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(
            {"env": env, "copy_bw": bw, "params": params, "args": vars(args), "rows": rows}, f, indent=1
        )
    print(
        f"\n=== e2e decode, gpt-oss-20b shape ({args.layers} layers, {params / 1e9:.1f} B params), {env} ==="
    )
    print(f"prompt {args.prompt}, decode steps {args.n1}..{args.n2}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(
        "batch | moe | minakv ms/step | graph replay ms | tok/s | bound ms | of bound | HF ms/step | HF tok/s | speedup"
    )
    for r in rows:
        hf = f"{r['hf_ms']:.2f} | {r['hf_tok_s']:.1f} | {r['speedup']:.2f}x" if "hf_ms" in r else "- | - | -"
        replay = f"{r['graph_replay_ms']:.2f}" if r["graph_replay_ms"] else "-"
        print(f"{r['batch']} | {r['moe']} | {r['ours_ms']:.2f} | {replay} | {r['ours_tok_s']:.1f} | {r['bound_ms']:.2f} | "
              f"{r['fraction_of_bound']:.2f} | {hf}")  # fmt: skip


if __name__ == "__main__":
    main()
