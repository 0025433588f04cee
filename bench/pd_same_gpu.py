"""Prefill and decode workers as two processes on one GPU against the colocated engine (issue 13, H200).

Both engines load the same dummy weights (seeded; gpt-oss-20b's shapes with fewer layers) and run the same
greedy requests with drop/reposition programs. bf16 greedy decoding is not bitwise stable across batch
shapes, so the noise floor is measured in the same run: the colocated engine against itself with the
requests sent one at a time instead of all at once. Prints one JSON line per engine and a summary.

    PYTHONPATH=. python bench/pd_same_gpu.py [--layers 4] [--requests 24] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from minakv import Engine, SamplingParams
from minakv.presets.real import real_config


def requests(n: int, seed: int) -> list[dict]:
    """Agent-like prompts: system, user, then (assistant, tool) pairs; old tool results dropped and the rest
    repositioned (cumulative operations, as minakv.agent's rolling window sends them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pairs = int(rng.integers(1, 6))
        lengths = [64, 32] + [int(x) for x in rng.integers(16, 400, 2 * pairs)]
        messages = [rng.integers(0, 1000, k).tolist() for k in lengths]
        tools = [3 + 2 * j for j in range(pairs)]
        drop = {str(t): [tools[i - 2]] for i, t in enumerate(tools) if i >= 2}
        out.append(
            {"message_tokens": messages, "cache": {"drop": drop, "reposition": sorted(map(int, drop))}}
        )
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b)]
    return {"identical": same, "of": len(a), "mean_common_prefix": float(np.mean(prefix))}


def run(engine: Engine, prompts: list[dict], params: SamplingParams, one_by_one: bool) -> tuple[list, float]:
    start = time.perf_counter()
    if one_by_one:
        outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--kv-cache-tokens", type=int, default=262_144)
    p.add_argument("--model", default=None, help="a preset instead of the dummy 20b shape (a CPU smoke test)")
    args = p.parse_args()
    common = {"kv_cache_tokens": args.kv_cache_tokens}
    if args.model is None:
        config = dict(real_config("gpt-oss-20b"), num_hidden_layers=args.layers)
        config["layer_types"] = config["layer_types"][: args.layers]
        folder = Path(tempfile.mkdtemp(prefix="minakv-pd-"))
        (folder / "config.json").write_text(json.dumps(config))
        model, common["load_format"] = str(folder), "dummy"
    else:
        model = args.model
    prompts = requests(args.requests, seed=0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    device = args.device.split(":")[0]

    with Engine(model, device=device, **common) as engine:
        run(engine, prompts[:2], params, False)  # warm-up: compile, capture
        batched, t_batched = run(engine, prompts, params, False)
        alone, t_alone = run(engine, prompts, params, True)
    noise = agreement(batched, alone)
    print(
        json.dumps({"engine": "colocated", "batched_s": t_batched, "one_by_one_s": t_alone, "noise": noise})
    )

    with Engine(model, prefill_devices=[args.device], decode_devices=[args.device], **common) as engine:
        run(engine, prompts[:2], params, False)
        pd, t_pd = run(engine, prompts, params, False)
        again, _ = run(engine, prompts, params, False)  # round 2: the decode side already holds the pages
        stats = {k: v for k, v in engine.stats().items() if k.startswith("kv_")}
    result = {"engine": "prefill/decode", "batched_s": t_pd, "vs_colocated": agreement(batched, pd),
              "repeat_vs_first": agreement(pd, again), "stats": stats}  # fmt: skip
    print(json.dumps(result))
    print(
        f"colocated batched vs one by one (bf16 noise): {noise['identical']}/{noise['of']} identical; "
        f"PD vs colocated: {result['vs_colocated']['identical']}/{noise['of']} identical "
        f"(mean common prefix {result['vs_colocated']['mean_common_prefix']:.1f} of {args.tokens})"
    )


if __name__ == "__main__":
    main()
