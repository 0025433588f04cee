"""`minakv serve MODEL`: parse the flags, load the engine, run the HTTP server until SIGTERM or SIGINT,
drain it (shutdown.py) and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from minakv.server.limits import Limits


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def devices(text: str) -> list[str]:
    """A comma-separated list: "cuda:0,cuda:1" -> ["cuda:0", "cuda:1"]."""
    return [d.strip() for d in text.split(",") if d.strip()]


def port(text: str) -> int:
    value = positive(text) if text != "0" else 0
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535), got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minakv serve", description="OpenAI-compatible HTTP server for one model."
    )
    p.add_argument("model", help="a local Hugging Face model folder, a hub id, or a built-in tiny preset")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--page-size", type=positive, default=16, help="KV slots per page")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: float8_e4m3fn K/V, half the bytes per token")  # fmt: skip
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights in the checkpoint's precision (gpt-oss-20b, gpt-oss-120b, minimax-m2)")  # fmt: skip
    p.add_argument("--kv-cache-tokens", type=positive, default=None, help="KV pool size in tokens")
    p.add_argument(
        "--max-model-len", type=positive, default=None, help="longest prompt + output, in positions"
    )
    p.add_argument(
        "--max-queued-requests", type=positive, default=256, help="waiting requests before HTTP 503"
    )
    p.add_argument("--max-num-seqs", type=positive, default=None, help="requests decoding at once")
    p.add_argument("--prefill-devices", type=devices, default=None,
                   help="run prefill in worker processes on these devices (one per rank, comma-separated); "
                        "alone: one worker does prefill and decode; with --decode-devices: a pool of prefill "
                        "workers, world devices each (cpu,cpu: two workers at world 1)")  # fmt: skip
    p.add_argument("--decode-devices", type=devices, default=None,
                   help="with --prefill-devices: a pool of decode workers on these devices (world devices "
                        "each; the same devices allowed), KV sent between the workers (docs/workers.md)")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=positive, default=1,
                   help="split attention heads over this many worker processes (ranks; docs/parallel.md)")  # fmt: skip
    p.add_argument("--expert-parallel-size", type=positive, default=1,
                   help="split the experts over this many ranks; the world is max(tp, ep) ranks per role, on "
                        "cuda:0.. or the device lists (one device per rank; one 'cpu' for all)")  # fmt: skip
    p.add_argument(
        "--expert-dispatch",
        choices=("all_reduce", "all_to_all"),
        default="all_reduce",
        help="how expert-parallel ranks combine the MoE output (docs/parallel.md)",
    )
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (MiB)")
    d = Limits()
    p.add_argument("--max-messages", type=positive, default=d.max_messages, help="messages per chat request")
    p.add_argument("--max-tools", type=positive, default=d.max_tools, help="tools per chat request")
    p.add_argument("--max-stop", type=positive, default=d.max_stop, help="stop strings per request")
    p.add_argument(
        "--max-stop-chars", type=positive, default=d.max_stop_chars, help="characters per stop string"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended (default 30)",
    )
    p.add_argument(
        "--log-prompts", action="store_true", help="put each request's prompt in its log line (default: not)"
    )
    return p


def serve_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from minakv.engine import Engine  # heavy import after argument errors are reported
    from minakv.server.app import make_app
    from minakv.server.shutdown import serve

    kwargs = {
        "device": args.device,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_model_len": args.max_model_len,
        "max_queued_requests": args.max_queued_requests,
        "load_format": args.load_format,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "expert_parallel_size": args.expert_parallel_size,
        "expert_dispatch": args.expert_dispatch,
    }
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.prefill_devices or args.decode_devices:
        kwargs["prefill_devices"], kwargs["decode_devices"] = args.prefill_devices, args.decode_devices
    try:
        engine = Engine(args.model, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        print(f"minakv serve: {e}", file=sys.stderr)
        return 2
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_messages=args.max_messages,
        max_tools=args.max_tools,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
    )
    app = make_app(engine, args.served_model_name, args.api_key, log_prompts=args.log_prompts, limits=limits)
    print(
        f"minakv: serving {args.served_model_name or engine.model_name} on http://{args.host}:{args.port}",
        flush=True,
    )
    asyncio.run(serve(app, engine, args.host, args.port, args.shutdown_timeout))
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_main())
