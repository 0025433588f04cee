"""`minakv bench replay`: replay agent trajectories through a running server and compare cache policies.

    minakv bench replay --url http://127.0.0.1:8000 [--model NAME] [--tasks C] [--rounds R]
        [--trajectories FILE.jsonl | --synthetic] [--policies plain,kv_drop:K=4,text_drop:K=4]
        [--prices in,cached,out] [--out DIR] [--api-key KEY]

Writes DIR/replay.json (the summaries and per-round series), DIR/requests.jsonl (one line per request),
DIR/trajectories.jsonl (the synthetic ones, to replay again) and, with matplotlib, DIR/*.png; prints a
table. docs/agent.md explains the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from minakv.agent.replay.cost import Prices
from minakv.agent.replay.plots import plot
from minakv.agent.replay.policies import parse_policies
from minakv.agent.replay.report import summarize_run, table, write_json
from minakv.agent.replay.runner import replay, urls
from minakv.agent.replay.session import Settings
from minakv.agent.replay.synthetic import DISTRIBUTIONS, SyntheticSpec, synthetic_trajectories
from minakv.agent.replay.trajectory import read_jsonl, write_jsonl

DEFAULT_POLICIES = "plain,kv_drop:K=4,text_drop:K=4"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minakv bench replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", help="model name to request (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tasks", type=int, default=4, help="C, tasks replayed at once (default 4)")
    p.add_argument(
        "--rounds", type=int, default=None, help="R, turns per task (default: synthetic 8, a file all)"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trajectories", type=Path, help="a JSONL file of trajectories (docs/agent.md)")
    src.add_argument("--synthetic", action="store_true", help="generated trajectories (the default)")
    p.add_argument(
        "--num", type=int, default=None, help="trajectories (default: C synthetic ones, or the whole file)"
    )
    p.add_argument(
        "--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})"
    )
    prices = ",".join(str(v) for v in asdict(Prices()).values())
    p.add_argument("--prices", default=None, help=f"in,cached,out per million tokens (default {prices})")
    p.add_argument(
        "--out", type=Path, default=Path("replay-out"), help="output folder (default ./replay-out)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="answer length where a turn records none")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="let answers stop early (and not send ignore_eos)"
    )
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this model's tokenizer and template (exact active context; "
                   "needed by after=T; default: --model if it is a preset or a folder)")  # fmt: skip
    p.add_argument("--salt", default=None, help="system-prompt salt keeping policies apart (default random)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("synthetic trajectories")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tool-tokens", type=int, default=1000, help="median tool-result tokens")
    g.add_argument("--tool-dist", choices=DISTRIBUTIONS, default="lognormal")
    g.add_argument("--tool-sigma", type=float, default=1.0, help="lognormal shape")
    g.add_argument("--tool-alpha", type=float, default=1.5, help="pareto shape")
    g.add_argument("--min-tool-tokens", type=int, default=8)
    g.add_argument("--max-tool-tokens", type=int, default=16384)
    g.add_argument("--system-tokens", type=int, default=512)
    g.add_argument("--user-tokens", type=int, default=128)
    g.add_argument("--output-tokens", type=int, default=64, help="answer tokens per turn")
    g.add_argument("--parallel", type=float, default=0.2, help="probability of two tool calls in a turn")
    return p


def first_model(url: str, api_key: str | None) -> str:
    base, _ = urls(url)
    req = urllib.request.Request(base + "/models", headers={"Authorization": f"Bearer {api_key or 'none'}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        models = json.load(resp).get("data") or []
    if not models:
        raise ValueError(f"{base}/models lists no model: pass --model")
    return models[0]["id"]


def make_counter(args: argparse.Namespace, needed: bool) -> Any:
    """A TokenCounter from --tokenizer, or from --model when that is local (a preset or a folder)."""
    from minakv.presets import PRESETS

    name = args.tokenizer or (args.model if args.model in PRESETS or Path(args.model).is_dir() else None)
    if name is None:
        if needed:
            raise ValueError("a policy with after=T needs token counts: pass --tokenizer MODEL")
        return None
    from minakv.agent import TokenCounter

    try:
        return TokenCounter.from_model(name)
    except (OSError, ValueError) as e:
        if needed or args.tokenizer:
            raise ValueError(f"cannot count tokens with {name!r}: {e}") from e
        return None


def load_trajectories(args: argparse.Namespace) -> list:
    if args.trajectories is not None:
        found = read_jsonl(args.trajectories)
        return found[: args.num] if args.num else found
    spec = SyntheticSpec(
        rounds=args.rounds or 8, system_tokens=args.system_tokens, user_tokens=args.user_tokens,
        tool_tokens=args.tool_tokens, distribution=args.tool_dist, sigma=args.tool_sigma,
        alpha=args.tool_alpha,
        min_tool_tokens=args.min_tool_tokens, max_tool_tokens=args.max_tool_tokens,
        output_tokens=args.output_tokens, parallel=args.parallel,
    )  # fmt: skip
    return synthetic_trajectories(args.num or args.tasks, spec, args.seed)


def run(args: argparse.Namespace) -> int:
    for name in ("tasks", "rounds", "num"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise ValueError(f"--{name} must be positive")
    policies = parse_policies(args.policies)
    prices = Prices.parse(args.prices) if args.prices else Prices()
    trajectories = load_trajectories(args)
    args.model = args.model or first_model(args.url, args.api_key)
    counter = make_counter(args, any(p.needs_counts for p in policies))
    salt = args.salt if args.salt is not None else f"{random.randrange(10**6):06d}"
    settings = Settings(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                        ignore_eos=not args.no_ignore_eos, rounds=args.rounds)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trajectories is None:
        write_jsonl(trajectories, args.out / "trajectories.jsonl")
    print(f"replaying {len(trajectories)} tasks, {args.tasks} at a time, on {args.model} at {args.url}: "
          f"{', '.join(p.label for p in policies)}", flush=True)  # fmt: skip
    runs = replay(args.url, trajectories, policies, settings, concurrency=args.tasks,
                  api_key=args.api_key, counter=counter, salt=salt, progress=not args.no_progress,
                  timeout=args.timeout)  # fmt: skip
    summaries = [summarize_run(r, prices) for r in runs]
    meta = {
        "url": args.url, "model": args.model, "tasks": args.tasks, "trajectories": len(trajectories),
        "rounds": args.rounds, "source": str(args.trajectories) if args.trajectories else "synthetic",
        "prices_per_million": asdict(prices), "salt": salt, "token_counter": counter is not None,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"},
    }  # fmt: skip
    path = write_json(summaries, meta, args.out)
    with open(args.out / "requests.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in (rec for run_ in runs for rec in run_.records))
    pngs = plot(summaries, args.out, title=f"{args.model}, {len(trajectories)} tasks, C={args.tasks}")
    print(f"\n{table(summaries)}\n")
    print(f"wrote {path}" + "".join(f", {p.name}" for p in pngs), flush=True)
    return 0


def replay_main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        import openai

        failures: tuple[type[Exception], ...] = (ValueError, OSError, RuntimeError, openai.APIError)
    except ImportError:
        failures = (ValueError, OSError, RuntimeError)
    try:
        return run(args)
    except failures as e:  # bad input or an unreachable server: one clear line, no traceback
        print(f"minakv bench replay: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
