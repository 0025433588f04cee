"""Host time of the scheduler per decode step (no model compute): what the GPU waits for between steps.

No worker runs: each step is `schedule()` then `update()` with token 0 for every sample row, so the figure
is the Python work of planning, batching and bookkeeping alone. Run on CPU:

    python bench/scheduler_host.py --batch 32 --context 8192
"""

from __future__ import annotations

import argparse
import time

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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
