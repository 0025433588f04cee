"""Host time per decode step (no model compute): what the GPU waits for between steps.

No worker runs: each step is `schedule()` then `update()` with token 0 for every sample row, so the figure
is the Python work of planning, batching and bookkeeping alone. Run on CPU:

    python bench/scheduler_host.py --batch 32 --context 8192

`--streams` measures the engine's whole host cycle instead, as a throughput run sees it: the background
thread steps with a stub worker (no device; random tokens), GPT-OSS's real tokenizer detokenizes, and each
request is an asyncio stream (`Engine.stream`) on the main thread. The figure is the time between two
steps that both decode the whole batch: schedule, update, detokenize, deliver, and the streams' share of
the GIL. On the GPU the worker's own host work (sampling tensors, the graph's inputs) comes on top.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from itertools import pairwise

from minakv import Engine, SamplingParams
from minakv.model import build_model
from minakv.model.config import ModelConfig
from minakv.worker.worker import StepResult

CONFIG = {
    "architectures": ["GptOssForCausalLM"], "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128, "max_position_embeddings": 131072,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--streams", action="store_true", help="the engine's whole cycle, with streams")
    parser.add_argument("--no-detokenize", action="store_true", help="(--streams) token ids only")
    args = parser.parse_args()
    if args.streams:
        return streams(args)
    model = build_model(ModelConfig.from_hf(CONFIG), device="cpu")
    # one prefill step for all (no compute runs), so every measured step decodes the whole batch
    engine = Engine(model, page_size=16, kv_cache_tokens=args.batch * (args.context + args.steps + 64),
                    max_num_batched_tokens=args.batch * args.context, max_num_seqs=args.batch)  # fmt: skip
    prompts = [[(i * 7 + j) % 1024 for j in range(args.context)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    scheduler = engine.scheduler
    for p in prompts:  # straight into the scheduler: this measures it, not the engine's thread
        scheduler.add(engine._make(p, params))

    def step() -> None:
        batch = scheduler.schedule()
        n = len(batch.sample_rows)
        scheduler.update(batch, StepResult([0] * n, [None] * n))

    while any(r.plan is None or r.cursor < len(r.todo) for r in [*scheduler.waiting, *scheduler.running]):
        step()  # admission and prefill (no compute)
    times = []
    while scheduler.has_work():
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    print(f"batch {args.batch} x context {args.context}: {len(times)} decode steps, host time per step: "
          f"median {median * 1e3:.2f} ms, p90 {times[int(len(times) * 0.9)] * 1e3:.2f} ms")  # fmt: skip


class StubWorker:
    """Launches nothing; a step's results are random tokens (so detokenization does real work)."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def launch(self, batch) -> int:
        return len(batch.sample_rows)

    def collect(self, n: int) -> StepResult:
        return StepResult([self.rng.randrange(1000, 190_000) for _ in range(n)], [None] * n)


def streams(args: argparse.Namespace) -> None:
    from minakv.presets.real import dummy_tokenizer

    tokenizer = dummy_tokenizer("gpt_oss")  # None where the tokenizer cannot be built: ids only
    model = build_model(ModelConfig.from_hf({**CONFIG, "vocab_size": 201_088}), device="cpu")
    engine = Engine(model, tokenizer=tokenizer, page_size=16, max_num_seqs=args.batch, enable_prefix_cache=False,
                    kv_cache_tokens=args.batch * (args.context + args.steps + 64),
                    max_num_batched_tokens=16384)  # fmt: skip
    engine.worker = StubWorker()
    starts: list[tuple[float, int]] = []  # (step start, requests with news)
    step = engine.step

    def timed() -> list:
        t = time.perf_counter()
        changed = step()
        starts.append((t, len(changed)))
        return changed

    engine.step = timed
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 190_000) for _ in range(args.context)] for _ in range(args.batch)]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=args.steps, temperature=1.0, seed=i, ignore_eos=True,
                                detokenize=not args.no_detokenize)  # fmt: skip
        async for _ in engine.stream(prompts[i], params):
            pass

    async def run() -> None:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))

    asyncio.run(run())
    engine.shutdown()
    full = sorted(b[0] - a[0] for a, b in pairwise(starts) if a[1] == b[1] == args.batch)
    text = "o200k" if tokenizer and not args.no_detokenize else "none"
    print(f"batch {args.batch} x context {args.context}, streams, detokenized by {text}: "
          f"{len(full)} cycles of whole-batch decode steps: median {full[len(full) // 2] * 1e3:.2f} ms, "
          f"p90 {full[int(len(full) * 0.9)] * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
