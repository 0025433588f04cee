"""Replay synthetic agents against the Engine: full history vs dropping old tool results from the KV
(cache operations) vs deleting them from the text.

    PYTHONUNBUFFERED=1 python bench/agent_replay.py [--agents 8] [--rounds 24] [--tool-tokens 2000]
        [--keep 4] [--assistant-tokens 48] [--modes plain,kv_drop,text_drop] [--layers 24] [--tiny]

The model is gpt-oss-20b-shaped with random bf16 weights (bench/e2e_decode.py builds it). Each of C agents
runs R rounds concurrently, one asyncio task per agent, one `engine.stream` request per round. Its history
is a list of pre-tokenized messages (the `segments` prompt form; random token ids from a seeded RNG):

    message:  0 system | 1 user task | 2 assistant 0 | 3 tool 0 | 4 assistant 1 | 5 tool 1 | ...
    round r sends messages 0 .. 1 + 2r (r tool results) and generates assistant r (A tokens, ignore_eos);
    the client then appends assistant r (the generated ids) and tool result r (T random ids).

Modes (every mode sends the same tokens; only what the engine is asked to do differs):

- `plain`: the whole history, no cache operations.
- `kv_drop`: the whole history plus cumulative cache operations that keep only the last K tool results in
  attention: when tool result j arrives (message 3 + 2j), `drop: {3 + 2j: [3 + 2(j - K)]}` and
  `reposition: [3 + 2j]` (docs/walk.md: both act just after message 3 + 2j, so the tool result itself
  still sees what it drops and the generation after it does not; the reposition renumbers survivors to
  0..A-1 so positions stay compact). Round r + 1 repeats round r's operations and adds its own, so the
  state cached at the end of round r is a prefix of round r + 1's.
- `text_drop`: the client deletes the tool results older than the last K from the message list (the
  assistant turns stay); no cache operations. Everything after the first deleted message is recomputed.

A fresh `Engine` per mode over the same weights, so modes never share cached prefixes. There is no way to
shut an engine down, so on CUDA each mode's KV pool is sized up front to an equal share of the memory free
after the model is built (or `--kv-cache-tokens`). Each engine first runs a small warm-up (kernels compile,
CUDA graphs are captured); counters are taken as differences around the measured part.

Rounds 0 .. R-2 run free (each agent sends its next round as soon as its last one finishes); the agents
then meet, and the last round runs for all of them at once, under `torch.profiler` on CUDA: its GPU busy
fraction is the union of device-kernel time over its wall time (the sum of kernel times is reported too; a
profiled round runs a little slower than an unprofiled one). Per mode the report has: total and per-round
wall time, TTFT (request sent -> first token) and TPOT (later tokens, per token), mean and p90, over all
rounds and over the last one; prompt tokens sent / computed / cached / never computed (dropped before any
query read them) / re-rotated from the requests' usage, and the engine's counters (`stats()`), KV bytes
read per decode token, and the largest position any round reaches (it must stay below the model's
131,072). Rows are printed and written to $OUT/agent_replay.json.

Long variant (positions up to ~110k for plain, ~22k for kv_drop): `--agents 4 --rounds 28 --tool-tokens 4000`.

Why the device idles: `--gaps` charges each idle interval of the last round to the engine phase the host
was in (bench/gpu_gaps.py); `--sample-host` samples the engine's and the agents' threads. Without a GPU,
`--host-only` times the host's work alone and `--simulate` adds a pretend device (`SimulatedWorker`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_gaps
from common import Log
from e2e_decode import DEVICE, build_ours, configs
from host_sampler import print_samples, sample_thread
from profiling import profiled, sync_warnings

from minakv import Engine, SamplingParams
from minakv.agent.replay.metrics import KV_PER_TOKEN, counter_deltas, summarize
from minakv.agent.replay.metrics import usage_sums as sum_usage
from minakv.worker.worker import Launched, StepResult

MODES = ("plain", "kv_drop", "text_drop")
MAX_TOKEN_ID = 199998  # random ids stay below gpt-oss's special tokens
# sizes: (issue defaults, --tiny defaults)
SIZES = {"agents": (8, 2), "rounds": (24, 3), "tool_tokens": (2000, 24), "keep": (4, 1),
         "assistant_tokens": (48, 4), "system_tokens": (512, 32), "user_tokens": (128, 8)}  # fmt: skip


# ----- the agents' messages and cache operations -----


def assistant_id(j: int) -> int:
    return 2 + 2 * j


def tool_id(j: int) -> int:
    return 3 + 2 * j


@dataclass
class Agent:
    """One agent's full history (messages 0, 1, then assistant/tool pairs) and its tool results to come."""

    index: int
    messages: list[list[int]]
    tools: list[list[int]]  # tool result j, drawn up front so every mode sees the same tokens

    def prompt(self, r: int, mode: str, keep: int) -> dict:
        """The request of round r (the history holds r tool results)."""
        assert len(self.messages) == 2 + 2 * r
        if mode == "plain":
            return {"message_tokens": list(self.messages)}
        if mode == "kv_drop":
            return {"message_tokens": list(self.messages), "cache": cache_ops(r, keep)}
        if mode == "text_drop":
            return {"message_tokens": text_kept(self.messages, r, keep)}
        raise ValueError(f"unknown mode {mode!r}")

    def append(self, r: int, generated: list[int]) -> None:
        self.messages += [generated, self.tools[r]]


def cache_ops(r: int, keep: int) -> dict:
    """Cumulative operations of round r: tool result j - K leaves when tool result j arrives."""
    drop = {str(tool_id(j)): [tool_id(j - keep)] for j in range(keep, r)}
    return {"drop": drop, "reposition": [tool_id(j) for j in range(keep, r)]}


def text_kept(messages: list[list[int]], r: int, keep: int) -> list[list[int]]:
    """The history with tool results older than the last `keep` deleted."""
    gone = {tool_id(j) for j in range(r - keep)}
    return [m for i, m in enumerate(messages) if i not in gone]


def make_agents(n: int, rounds: int, sizes: argparse.Namespace, vocab: int, seed: int) -> list[Agent]:
    rng = np.random.default_rng(seed)
    hi = min(vocab, MAX_TOKEN_ID)

    def ids(k: int) -> list[int]:
        return rng.integers(0, hi, k).tolist()

    system = ids(sizes.system_tokens)  # shared by all agents, as a real deployment's system prompt is
    return [
        Agent(i, [system, ids(sizes.user_tokens)], [ids(sizes.tool_tokens) for _ in range(rounds)])
        for i in range(n)
    ]


def max_position(mode: str, args: argparse.Namespace) -> int:
    """The largest position any round reaches (prompt and generation), by the walk of docs/walk.md run
    per message: a message's tokens are born at next_pos..; after message n its drops leave the active
    set, and a reposition there sets next_pos to the number of active tokens."""
    a, t, k = args.assistant_tokens, args.tool_tokens, args.keep
    best = 0
    for r in range(args.rounds):
        lengths = [args.system_tokens, args.user_tokens] + [a, t] * r
        ops = cache_ops(r, k) if mode == "kv_drop" else {"drop": {}, "reposition": []}
        if mode == "text_drop":
            lengths = [n for i, n in enumerate(lengths) if i not in {tool_id(j) for j in range(r - k)}]
        active: dict[int, int] = {}
        next_pos = 0
        for i, n in enumerate(lengths):
            active[i] = n
            next_pos += n
            best = max(best, next_pos - 1)  # the message's last token, before its own drops act
            for m in ops["drop"].get(str(i), []):
                active.pop(m)
            if i in ops["reposition"]:
                next_pos = sum(active.values())
        best = max(best, next_pos + a - 1)
    return best


# ----- measuring -----


@dataclass
class RoundRecord:
    agent: int
    round: int
    start: float
    end: float
    ttft: float
    tpot: float | None
    usage: dict


@dataclass
class ModeResult:
    records: list[RoundRecord] = field(default_factory=list)
    wall: float = 0.0


def sampling(args: argparse.Namespace, agent: int, r: int) -> SamplingParams:
    seed = None if args.seed is None else args.seed + 100_003 * agent + r  # per request: reproducible
    temp = args.temperature
    return SamplingParams(max_tokens=args.assistant_tokens, temperature=temp, top_p=args.top_p,
                          seed=seed if temp > 0 else None, ignore_eos=True)  # fmt: skip


async def run_round(engine: Engine, agent: Agent, r: int, args: argparse.Namespace) -> RoundRecord:
    prompt = agent.prompt(r, args.mode, args.keep)
    start = time.perf_counter()
    first = last = None
    generated: list[int] = []
    final = None
    async for out in engine.stream(prompt, sampling(args, agent.index, r)):
        if out.token_ids:
            last = time.perf_counter()
            first = first or last
            generated += out.token_ids
        if out.finish_reason is not None:
            final = out
    end = time.perf_counter()
    if final is None or final.finish_reason != "length" or len(generated) != args.assistant_tokens:
        reason = None if final is None else final.finish_reason
        raise RuntimeError(
            f"agent {agent.index} round {r}: finished with {reason!r}, {len(generated)} tokens"
        )
    agent.append(r, generated)
    tpot = (last - first) / (len(generated) - 1) if len(generated) > 1 else None
    return RoundRecord(agent.index, r, start, end, first - start, tpot, vars(final.usage).copy())


async def run_agents(engine: Engine, agents: list[Agent], rounds: range, args) -> list[RoundRecord]:
    async def one(agent: Agent) -> list[RoundRecord]:
        return [await run_round(engine, agent, r, args) for r in rounds]

    per_agent = await asyncio.gather(*(one(a) for a in agents))
    return [rec for recs in per_agent for rec in recs]


def mean_p90(values: list[float]) -> dict:
    # the summaries are shared with `minakv bench replay` (minakv/agent/replay/metrics.py)
    s = summarize(values)
    return {"mean": s["mean"], "p90": s["p90"]}


def counters_delta(before: dict, after: dict) -> dict:
    """Differences of the engine's cumulative counters; KV bytes per decode token over the interval."""
    out = counter_deltas(before, after)
    if KV_PER_TOKEN in after:
        out.setdefault(KV_PER_TOKEN, None)  # no decode step in the interval
    return out


def usage_sums(records: list[RoundRecord]) -> dict:
    return sum_usage(rec.usage for rec in records)


def latency(records: list[RoundRecord]) -> dict:
    return {
        "ttft_ms": {k: v and v * 1e3 for k, v in mean_p90([r.ttft for r in records]).items()},
        "tpot_ms": {k: v and v * 1e3 for k, v in mean_p90([r.tpot for r in records if r.tpot]).items()},
    }


# ----- one mode -----


class HostOnlyWorker:
    """--host-only: a worker that computes nothing and samples token 1 for every row, so the replay's wall
    time is the host's work alone (scheduling, planning, admission, bookkeeping, the agents' asyncio)."""

    def launch(self, batch) -> Launched:
        return Launched(None, None, batch.sample_params, len(batch.sample_rows))

    def collect(self, launched: Launched) -> StepResult:
        n = launched.max_logprobs
        return StepResult([1] * n, [None] * n)


class SimulatedWorker(HostOnlyWorker):
    """--simulate: the host-only worker plus a pretend device that runs one step at a time for
    STEP_S + PREFILL_S per computed prompt token (roughly the H200's, gpt-oss-20b shape) and makes `collect`
    wait for it, as the real one waits for a step's event. The device's busy intervals give the fraction
    of the last round it idled on a CPU-only machine, so a scheduling change can be judged before a GPU
    run (the host here is slower than the GPU machine's, so the idle is overstated)."""

    STEP_S, PREFILL_S = 3.5e-3, 30e-6

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []  # (start, end) of each step, in launch order
        self.collected = 0  # steps are collected in launch order

    def launch(self, batch) -> Launched:
        start = max(time.perf_counter(), self.busy[-1][1] if self.busy else 0.0)
        self.busy.append(
            (start, start + self.STEP_S + self.PREFILL_S * (batch.num_tokens - batch.num_decode))
        )
        return super().launch(batch)

    def collect(self, launched: Launched) -> StepResult:
        time.sleep(max(0.0, self.busy[self.collected][1] - time.perf_counter()))
        self.collected += 1
        return super().collect(launched)

    def busy_fraction(self, start: float, end: float) -> float:
        spans = sum(min(b, end) - max(a, start) for a, b in self.busy if b > start and a < end)
        return spans / (end - start)


def warm_up(engine: Engine, args: argparse.Namespace, vocab: int) -> None:
    """Compile kernels, capture graphs and let the allocators grow: C concurrent requests of a round's size
    (a tool result among short messages) with a drop and a reposition, so the first mode measured pays no
    one-time costs the others skip."""
    rng = np.random.default_rng(12345)
    hi = min(vocab, MAX_TOKEN_ID)
    lengths = (args.system_tokens, args.tool_tokens, args.assistant_tokens, args.user_tokens)
    prompts = [
        {"message_tokens": [rng.integers(0, hi, n).tolist() for n in lengths],
         "cache": {"drop": {"2": [1]}, "reposition": [2]}}
        for _ in range(args.agents)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=args.assistant_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)
    engine.generate(prompts[:1], sampled, use_tqdm=False)


def run_mode(model, mode: str, args: argparse.Namespace, kv_tokens: int | None, log: Log) -> dict:
    args.mode = mode
    vocab = model.config.vocab_size
    engine = Engine(
        model,
        page_size=args.page_size,
        kv_cache_tokens=kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.host_only or args.simulate:
        engine.worker = SimulatedWorker() if args.simulate else HostOnlyWorker()
    warm_up(engine, args, vocab)
    agents = make_agents(args.agents, args.rounds, args, vocab, args.data_seed)
    stats0 = engine.stats()
    start = time.perf_counter()
    records = asyncio.run(run_agents(engine, agents, range(args.rounds - 1), args))
    stats1 = engine.stats()
    sampler = sample_thread(engine._thread) if args.sample_host else nullcontext({})
    # the agents' own thread shares the GIL with the engine thread: what it does costs the engine time
    clients = sample_thread(threading.main_thread()) if args.sample_host else nullcontext({})
    gaps = args.gaps and DEVICE == "cuda" and not args.no_profile
    with (
        profiled(not args.no_profile, args.api_table, keep=gaps) as prof,
        sampler as host,
        clients as client_host,
        sync_warnings(args.sync_debug),
        gpu_gaps.phase_log(engine) if gaps else nullcontext([]) as phases,
    ):
        marker = gpu_gaps.mark() if gaps else 0.0
        t0 = time.perf_counter()
        last = asyncio.run(run_agents(engine, agents, range(args.rounds - 1, args.rounds), args))
        if args.simulate:  # the pretend device's busy fraction stands in for the profiler's
            prof["gpu_busy"] = engine.worker.busy_fraction(t0, time.perf_counter())
    if gaps and prof.get("profile") is not None:
        gpu_gaps.print_report(gpu_gaps.attribute(prof.pop("profile"), marker, phases), f"{mode}, last round")
    if host:
        print_samples(host, f"{mode}, last round")
        print_samples(client_host, f"{mode}, last round, the agents' (main) thread")
    wall = time.perf_counter() - start
    stats2 = engine.stats()
    records += last
    round_walls = []
    for r in range(args.rounds):
        mine = [rec for rec in records if rec.round == r]
        round_walls.append(max(rec.end for rec in mine) - min(rec.start for rec in mine))
    row = {
        "mode": mode, "agents": args.agents, "rounds": args.rounds, "tool_tokens": args.tool_tokens,
        "keep": args.keep, "assistant_tokens": args.assistant_tokens,
        "max_position": max_position(mode, args),
        "pool_tokens": stats0.get("pages_total", 0) * args.page_size,
        "total_wall_s": wall, "round_wall_s": round_walls, "last_round_wall_s": prof["wall_s"],
        "mean_round_wall_s": float(np.mean(round_walls)),
        **latency(records), "last_round": latency(last),
        "usage": usage_sums(records), "last_round_usage": usage_sums(last),
        "engine": counters_delta(stats0, stats2), "last_round_engine": counters_delta(stats1, stats2),
        "gpu_busy_last_round": prof["gpu_busy"], "gpu_kernel_sum_fraction_last_round":
        prof["gpu_kernel_sum_fraction"], "engine_thread_last_round": host or None,
    }  # fmt: skip
    log.add("agent_replay", **row)
    del engine
    gc.collect()
    return row


def pool_tokens(model, args: argparse.Namespace) -> int | None:
    """KV pool per engine: --kv-cache-tokens, else (CUDA) an equal share of free memory per mode, else (CPU)
    four times what the longest round of all agents holds."""
    if args.kv_cache_tokens:
        return args.kv_cache_tokens
    config = model.config
    if DEVICE != "cuda":
        longest = max(max_position(m, args) for m in args.modes) + 1
        return 4 * args.agents * longest
    per_token = (
        2 * config.num_layers * config.num_kv_heads * config.head_dim * model.lm_head.weight.element_size()
    )
    free, _ = torch.cuda.mem_get_info()
    return int(0.8 * free / len(args.modes) / per_token) // args.page_size * args.page_size


def fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(rows: list[dict]) -> None:
    print("\n=== agent replay ===")
    r0 = rows[0]
    print(f"{r0['agents']} agents x {r0['rounds']} rounds, tool results {r0['tool_tokens']} tokens, keep "
          f"{r0['keep']}, assistant turns {r0['assistant_tokens']} tokens")  # fmt: skip
    print("mode | total s | mean round s | last round s | TTFT ms mean/p90 | TPOT ms mean/p90 | "
          "last TTFT ms | last TPOT ms | prompt sent | computed (engine) | cached | skipped | re-rotated | "
          "KV B/decode tok (last round) | GPU busy (last round) | max pos")  # fmt: skip
    for r in rows:
        u, lr = r["usage"], r["last_round"]
        kv = r["last_round_engine"].get("kv_bytes_read_per_decode_token")
        print(f"{r['mode']} | {r['total_wall_s']:.2f} | {r['mean_round_wall_s']:.3f} | "
              f"{r['last_round_wall_s']:.3f} | "
              f"{fmt(r['ttft_ms']['mean'])}/{fmt(r['ttft_ms']['p90'])} | "
              f"{fmt(r['tpot_ms']['mean'], 1, 2)}/{fmt(r['tpot_ms']['p90'], 1, 2)} | "
              f"{fmt(lr['ttft_ms']['mean'])} | {fmt(lr['tpot_ms']['mean'], 1, 2)} | {u['prompt_tokens']} | "
              f"{r['engine'].get('prefill_tokens')} | {u['cached_tokens']} | {u['drop_skipped_tokens']} | "
              f"{u['repos_tokens']} | "
              f"{fmt(kv, 1, 0)} | {fmt(r['gpu_busy_last_round'], 1, 3)} | {r['max_position']}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, help="concurrent agents C (default 8)")
    p.add_argument("--rounds", type=int, help="rounds R per agent (default 24)")
    p.add_argument("--tool-tokens", type=int, help="tokens T of each tool result (default 2000)")
    p.add_argument("--keep", type=int, help="tool results K kept by kv_drop / text_drop (default 4)")
    p.add_argument("--assistant-tokens", type=int, help="tokens A of each assistant turn (default 48)")
    p.add_argument("--system-tokens", type=int, help="system prompt tokens (default 512)")
    p.add_argument("--user-tokens", type=int, help="user task tokens (default 128)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per request: seed + agent, round)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (a CPU smoke test)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-profile", action="store_true", help="do not profile the last round")
    p.add_argument("--sample-host", action="store_true", help="sample the engine thread in the last round")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    p.add_argument("--api-table", action="store_true", help="print host time by op and CUDA runtime call")
    p.add_argument("--sync-debug", action="store_true", help="report host-device syncs in the last round")
    p.add_argument("--host-only", action="store_true", help="no model compute: time the host's work alone")
    p.add_argument("--gaps", action="store_true", help="attribute the last round's device idle time (CUDA)")
    p.add_argument(
        "--simulate", action="store_true", help="no model compute: a pretend device (SimulatedWorker)"
    )
    args = p.parse_args(argv)
    for name, (full, tiny) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    if args.rounds < 1 or args.keep < 1 or args.agents < 1:
        p.error("--rounds, --keep and --agents must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: thread synchronisation costs more than it saves
    if args.switch_interval:  # how long a Python thread may hold the GIL while another waits for it
        sys.setswitchinterval(args.switch_interval)
    _, config = configs(args.layers, args.tiny)
    limit = config.max_position_embeddings
    for mode in args.modes:
        pos = max_position(mode, args)
        print(f"{mode}: max position {pos} (limit {limit})", flush=True)
        if pos >= limit:
            raise SystemExit(f"{mode} reaches position {pos} >= {limit}: fewer rounds or tokens")
    t = time.perf_counter()
    model = build_ours(config, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f} B parameters on {DEVICE}, built in {time.perf_counter() - t:.1f} s")
    kv_tokens = pool_tokens(model, args)
    print(f"KV pool per engine: {kv_tokens} tokens", flush=True)
    log = Log()
    env = f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'} torch {torch.__version__}"
    log.add("env", env=env, params=params, args={k: v for k, v in vars(args).items() if k != "mode"})
    rows = [run_mode(model, mode, args, kv_tokens, log) for mode in args.modes]
    log.save("agent_replay.json")
    print_table(rows)


if __name__ == "__main__":
    main()
