"""The `minakv` command line.

    minakv generate [MODEL] [--prompt TEXT] [--max-tokens N] [--device D] [--dtype T] [--raw]
                    [--tensor-parallel-size N] [--expert-parallel-size M]
    minakv build-tiny PRESET PATH [--seed N] [--quant mxfp4|fp8]
    minakv serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...   (see minakv serve --help)
    minakv bench replay --url URL [--tasks C] [--policies ...] ...      (see minakv bench replay --help)

MODEL is a preset name (default tiny-gpt-oss, built on first use), a local checkpoint directory or a Hugging
Face repo id. `generate` renders the prompt as one user message with the model's chat template (unless
--raw), runs it through the Engine greedily and prints the text and the speed.
"""

from __future__ import annotations

import argparse
import sys
import time

from minakv.presets import DEFAULT_MODEL, PRESETS

DTYPES = ("float32", "bfloat16", "float16")


def cmd_generate(args: argparse.Namespace) -> int:
    from minakv import Engine, SamplingParams

    engine = Engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
    )
    tokenizer = engine.tokenizer
    if args.raw or tokenizer is None or not tokenizer.chat_template:
        prompt = args.prompt
    else:
        prompt = {"messages": [{"role": "user", "content": args.prompt}]}
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
    seconds = time.perf_counter() - start
    print(out.text)
    print(
        f"[{out.usage.prompt_tokens} prompt tokens, {len(out.token_ids)} generated in {seconds:.2f} s: "
        f"{len(out.token_ids) / max(seconds, 1e-9):.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_build_tiny(args: argparse.Namespace) -> int:
    from minakv.presets.tiny import build_tiny

    path = build_tiny(args.preset, args.path, seed=args.seed, quant=args.quant)
    print(path)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minakv", description="minakv: a small MoE inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy generation from one prompt")
    gen.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"preset ({', '.join(PRESETS)}), checkpoint directory or hub repo id (default {DEFAULT_MODEL})",
    )
    gen.add_argument("--prompt", default="What is the capital of France?")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                     help="dummy: random weights in the checkpoint's precision (e.g. gpt-oss-120b)")  # fmt: skip
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    gen.add_argument(
        "--dtype", choices=DTYPES, default=None, help="default: bfloat16 on cuda, float32 on cpu"
    )
    gen.add_argument(
        "--raw", action="store_true", help="tokenize the prompt as is, without the chat template"
    )
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="worker processes (ranks) that split attention heads (docs/parallel.md)")  # fmt: skip
    gen.add_argument("--expert-parallel-size", type=int, default=1,
                     help="ranks that split the experts; max(tp, ep) ranks on cuda:0.. (or all on cpu)")  # fmt: skip
    gen.set_defaults(run=cmd_generate)

    tiny = sub.add_parser("build-tiny", help="write a tiny random checkpoint in a real Hugging Face format")
    tiny.add_argument("preset", choices=["tiny-gpt-oss", "tiny-minimax-m2"])
    tiny.add_argument("path")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--quant", choices=["mxfp4", "fp8"], default=None)
    tiny.set_defaults(run=cmd_build_tiny)

    # `serve` has its own argument parser (minakv/server/serve.py); listed here for --help
    sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server: minakv serve MODEL [--port 8000] ...", add_help=False
    )
    # `bench replay` has its own parser too (minakv/agent/replay/cli.py)
    bench = sub.add_parser(
        "bench", help="benchmarks against a running server: minakv bench replay --url URL ..."
    )
    bench.add_argument(
        "benchmark", choices=["replay"], help="replay: agent trajectories under cache policies"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from minakv.server.serve import serve_main

        return serve_main(argv[1:])
    if argv[:2] == ["bench", "replay"]:
        from minakv.agent.replay.cli import replay_main

        return replay_main(argv[2:])
    args = make_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("minakv: error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"minakv: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
