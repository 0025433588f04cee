"""The agent replay on separate prefill and decode workers against the colocated engine, in one call (issue
14, run 1: TTFT and TPOT at 8 and 16 concurrent agents, two H200s against one).

Layouts, each a fresh engine over the same dummy weights (`--dummy`, the checkpoint's own format):
- `colocated`: one engine, its worker in-process on cuda:0;
- `pd`: a prefill worker process on cuda:0 and a decode worker process on cuda:1 (docs/workers.md): each
  step's KV pages move from one to the other (bench/pd_transfer.py measures that path alone).
Each runs the agents of bench/agent_replay.py (its `--mode`, default kv_drop: old tool results dropped and
the rest repositioned) for every count in --agents: all rounds, after agent_replay's warm-up. Reported per
(layout, agents): wall seconds, TTFT and TPOT (mean, p90), and for `pd` the KV bytes moved between the
workers. (GPU busy is not measured: the pd layout's kernels run in its worker processes.)

    python bench/pd_replay.py [--dummy gpt-oss-20b] [--agents 8,16] [--rounds 8] [--tiny]

Rows go to $OUT/pd_replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import agent_replay
from agent_replay import latency, make_agents, run_agents, warm_up
from common import Log

from minakv import Engine

LAYOUTS = ("colocated", "pd")


def make_engine(layout: str, args: argparse.Namespace) -> Engine:
    cpu = args.tiny or not torch.cuda.is_available()
    options = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "kv_cache_tokens": args.kv_tokens,
               "page_size": 16}  # fmt: skip
    if not args.tiny:
        options["load_format"] = "dummy"
    if layout == "pd":
        options.update(
            prefill_devices=["cpu" if cpu else "cuda:0"], decode_devices=["cpu" if cpu else "cuda:1"]
        )
    return Engine(args.dummy, **options)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dummy", default="gpt-oss-20b")
    p.add_argument("--agents", default="8,16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--mode", default="kv_drop", choices=agent_replay.MODES)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--kv-tokens", type=int, default=400_000, help="KV pool of each engine (each worker)")
    p.add_argument("--tiny", action="store_true", help="tiny-gpt-oss, both workers on CPU")
    args = p.parse_args(argv)
    # the agents' sizes: agent_replay's defaults (its --tiny ones with --tiny)
    sizes = agent_replay.parse_args(["--tiny"] if args.tiny else [])
    sizes.mode, sizes.rounds = args.mode, args.rounds
    if args.tiny:
        args.dummy, args.kv_tokens, args.agents, sizes.rounds = "tiny-gpt-oss", 4096, "2", 2
    elif torch.cuda.device_count() < 2 and "pd" in args.layouts:
        sys.exit("the pd layout needs two GPUs (or --tiny)")
    log = Log()
    for layout in args.layouts.split(","):
        engine = make_engine(layout, args)
        vocab = engine.model.config.vocab_size
        for n in (int(x) for x in args.agents.split(",")):
            sizes.agents = n
            warm_up(engine, sizes, vocab)
            agents = make_agents(n, sizes.rounds, sizes, vocab, seed=n)
            before, start = engine.stats(), time.perf_counter()
            records = asyncio.run(run_agents(engine, agents, range(sizes.rounds), sizes))
            wall = time.perf_counter() - start
            after = engine.stats()
            moved = {
                k: after[k] - before[k] for k in ("kv_bytes_to_decode", "kv_bytes_to_prefill") if k in after
            }
            row = {"layout": layout, "agents": n, "rounds": sizes.rounds, "mode": args.mode, "wall_s": wall,
                   **latency(records), "kv_bytes_to_decode": moved.get("kv_bytes_to_decode"),
                   "kv_bytes_to_prefill": moved.get("kv_bytes_to_prefill")}  # fmt: skip
            log.add("pd_replay", **row)
            print(f"{layout:9s} {n:3d} agents: {wall:7.1f} s, TTFT mean {row['ttft_ms']['mean']:8.1f} ms p90 "
                  f"{row['ttft_ms']['p90']:8.1f}, TPOT mean {row['tpot_ms']['mean']:6.2f} ms p90 "
                  f"{row['tpot_ms']['p90']:6.2f}", flush=True)  # fmt: skip
        engine.shutdown()
    log.save("pd_replay.json")


if __name__ == "__main__":
    main()
