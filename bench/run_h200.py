"""One call on the H200: GPU correctness checks at real shapes and every benchmark, then a short table.

    PYTHONUNBUFFERED=1 python bench/run_h200.py [--no-sweep] [--only decode,segment,rerotate]

Each section runs in its own try block so one failure does not hide the others. Rows are printed as
JSON lines as they come and saved to $OUT/results.json; the summary table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode
import bench_moe
import bench_rerotate
import bench_segment
import torch
import triton
from common import Log, copy_bandwidth


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sweep", action="store_true", help="time the default configs only")
    parser.add_argument("--only", default="decode,segment,rerotate,moe")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    parts = args.only.split(",")
    log = Log()
    props = torch.cuda.get_device_properties(0)
    log.add("env", name=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {props.name} "
            f"{props.multi_processor_count} SMs torch {torch.__version__} triton {triton.__version__}")  # fmt: skip
    torch.manual_seed(0)
    bw = copy_bandwidth()
    log.add("bench", name="copy bandwidth (2 GiB bf16, read+write)", ms=0.0, figure=f"{bw / 1e12:.3f} TB/s",
            copy_bw=bw, headline=True)  # fmt: skip
    sections = []
    for name, module in [
        ("decode", bench_decode),
        ("segment", bench_segment),
        ("rerotate", bench_rerotate),
        ("moe", bench_moe),
    ]:
        if name not in parts:
            continue
        if not args.no_check:
            sections.append((f"{name} check", lambda m=module: m.check(log)))
        if name == "segment":
            sections.append((f"{name} bench", lambda m=module: m.bench(log, sweep=not args.no_sweep)))
        else:
            sections.append((f"{name} bench", lambda m=module: m.bench(log, bw, sweep=not args.no_sweep)))
    for title, fn in sections:
        print(f"--- {title}", flush=True)
        try:
            fn()
        except Exception:  # noqa: BLE001 (report and go on)
            log.add("error", name=title, trace=traceback.format_exc()[-3000:])
            print(traceback.format_exc(), flush=True)
        torch.cuda.empty_cache()
        log.save()
    log.table()
    for r in log.rows:
        if r["kind"] == "error":
            print(f"ERROR in {r['name']}")


if __name__ == "__main__":
    main()
