"""Why bf16 engine tests need smooth routing: the same random drop/reposition programs run through the
engine in bf16 on the GPU, with the tiny test models routing top-k (a discrete choice) or to every
expert (k = E: the MoE is then a smooth function), each against the float64 walk oracle.

For each program: the engine's largest logprob deviation from float64 (`dev`), and the same for the walk
oracle run in bf16 on the CPU (`noise_cpu`) and on the GPU (`noise_gpu`); the test's tolerance is
2 x noise_cpu + 0.02. Prints one JSON line per program and a summary per routing mode.

    PYTHONPATH=.:tests python bench/bf16_routing_noise.py [--programs 60] [--family gpt_oss]
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from helpers.models import tiny_model
from helpers.programs import compiles, oracle_run
from test_engine_gpu import ENGINE_SHAPES, GREEDY, SOFTEN, bf16_copy

from minakv import Engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of the script


def random_program(rng: random.Random):
    n = rng.randint(1, 6)
    segments = [[rng.randrange(384) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    drop = {
        str(j): sorted(rng.sample(range(j), rng.randint(1, j))) for j in range(1, n) if rng.random() < 0.4
    }
    cache = {"drop": drop, "reposition": sorted(rng.sample(range(n), rng.randint(0, n)))}
    return segments, cache if compiles(segments, cache) else {"drop": drop}


def chosen(model, segments, cache, tokens) -> torch.Tensor:
    run = oracle_run(model, segments, cache, tokens)
    rows = torch.log_softmax(run.logits[len(run.logits) - len(tokens) - 1 : -1].double().cpu(), dim=-1)
    return rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=60)
    parser.add_argument("--family", default="gpt_oss")
    parser.add_argument("--shape", default="page1")
    args = parser.parse_args()
    for routing in ("top-k", "all experts"):
        cpu = tiny_model(args.family)
        for name, p in cpu.named_parameters():
            if p.ndim >= 2 and "embed" not in name:
                p.data.mul_(SOFTEN[args.family])
        if routing == "all experts":
            for layer in cpu.layers:
                layer.mlp.top_k = cpu.config.num_experts
        gpu16, cpu16 = bf16_copy(cpu, DEVICE), bf16_copy(cpu, "cpu")
        engine = Engine(gpu16, **ENGINE_SHAPES[args.shape])
        rng = random.Random(0)
        rows = []
        for i in range(args.programs):
            segments, cache = random_program(rng)
            if not compiles(segments, cache):
                continue
            others = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(2)]
            out = engine.generate(
                [others[0], {"message_tokens": segments, "cache": cache}, others[1]], GREEDY
            )[1]
            r64 = chosen(cpu, segments, cache, out.token_ids)
            ours = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
            row = {
                "routing": routing, "i": i, "cache": cache,
                "dev": float((ours - r64).abs().max()),
                "noise_cpu": float((chosen(cpu16, segments, cache, out.token_ids) - r64).abs().max()),
                "noise_gpu": float((chosen(gpu16, segments, cache, out.token_ids) - r64).abs().max()),
            }  # fmt: skip
            row["fails"] = row["dev"] > 2 * row["noise_cpu"] + 0.02
            rows.append(row)
            print(json.dumps(row), flush=True)
        engine.check()
        devs = sorted(r["dev"] for r in rows)
        print(
            f"== {args.family} {args.shape} {routing}: {len(rows)} programs, {sum(r['fails'] for r in rows)} "
            f"over tolerance; dev median {devs[len(devs) // 2]:.4f} max {devs[-1]:.4f}; noise_gpu max "
            f"{max(r['noise_gpu'] for r in rows):.4f}, noise_cpu max {max(r['noise_cpu'] for r in rows):.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
