"""A worker killed mid-run (issue 14, run 4): how fast its clients hear of it, and how fast the engine
serves again. The engine runs a prefill worker on cuda:0 and a decode worker on cuda:1 (--tiny: both on
CPU, a tiny preset). N streams of long generations start; once most of them decode, the decode (or
prefill) worker process gets SIGKILL. Measured: the time from the kill to each stream's last output (an
error naming the dead worker, docs/workers.md), the time until the restarted workers answer a new request,
and the engine's accounting check after it.

    python bench/kill_worker.py [--model gpt-oss-20b --dummy] [--streams 16] [--side decode] [--tiny]

Rows go to $OUT/kill_worker.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Log

from minakv import Engine, SamplingParams


async def kill_while_decoding(engine: Engine, victim: int, prompts: list[list[int]], tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
    ends: list[float] = []

    async def consume(prompt: list[int]) -> list:
        outs = [out async for out in engine.stream(prompt, params)]
        ends.append(time.monotonic())
        return outs

    tasks = [asyncio.create_task(consume(p)) for p in prompts]
    while sum(1 for r in engine.scheduler.running if len(r.output_ids) > 2) < (len(prompts) + 1) // 2:
        await asyncio.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    errors = [outs[-1].error if outs[-1].finish_reason == "error" else "" for outs in streams]
    return {
        "streams": len(prompts),
        "ended_in_error": sum(1 for e in errors if e),
        "last_error_s": max(ends) - killed,
        "first_error_s": min(ends) - killed,
        "error": next((e for e in errors if e), ""),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--dummy", action="store_true", help="random weights in the checkpoint's format")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4000, help="tokens each stream asks for (it is cut short)")
    p.add_argument("--side", choices=("decode", "prefill"), default="decode")
    p.add_argument("--tiny", action="store_true", help="tiny-gpt-oss, both workers on CPU")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.dummy, args.streams, args.prompt = "tiny-gpt-oss", False, 3, 16
        devices = (["cpu"], ["cpu"])
    else:
        if torch.cuda.device_count() < 2:
            sys.exit("needs two GPUs (or --tiny)")
        devices = (["cuda:0"], ["cuda:1"])
    options = {"load_format": "dummy"} if args.dummy else {}
    engine = Engine(args.model, prefill_devices=devices[0], decode_devices=devices[1], max_num_seqs=64,
                    kv_cache_tokens=args.streams * (args.prompt + args.tokens + 64), **options)  # fmt: skip
    vocab = min(engine.model.config.vocab_size, 50_000)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (args.streams, args.prompt), generator=gen).tolist()
    old = engine.worker.pids
    victim = old[1 if args.side == "decode" else 0]
    row = asyncio.run(kill_while_decoding(engine, victim, prompts, args.tokens))
    start = time.monotonic()
    again = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    row.update(
        side=args.side, model=args.model, devices=devices, serving_again_s=time.monotonic() - start,
        served_again=len(again.token_ids) == 8, new_pids=not set(engine.worker.pids) & set(old),
    )  # fmt: skip
    engine.check()  # the pool's accounting is exact after the loss
    row["accounting_exact"] = True
    engine.shutdown()
    log = Log()
    log.add("kill_worker", **row)
    log.save("kill_worker.json")
    print(f"killed the {args.side} worker: {row['ended_in_error']} of {row['streams']} streams ended in an "
          f"error within {row['last_error_s']:.2f} s (first {row['first_error_s']:.2f} s); serving again "
          f"after {row['serving_again_s']:.1f} s (new processes: {row['new_pids']}); accounting exact\n"
          f"error: {row['error']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
