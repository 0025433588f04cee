"""KV transfer from a prefill worker to a decode worker against a plain send/recv of the same bytes, in one
run (issue 14, run 1: the transfer at >= 80% of the plain send over NCCL on two H200s).

Two processes, one device each: cuda:0 and cuda:1 over NCCL (--tiny: two CPU processes over gloo). Each
holds a KV pool of the model's shape (bf16; fp8 with --kv-fp8). Rank 0 sends n pages, scattered over its
pool, to rank 1 with the engine's own transfer code (`Peer` in minakv/worker/transfer.py: a header, then the
pages layer by layer, gathered from the sender's pool and scattered into the receiver's, two layers on the
wire at once). The peers in the same run move the same bytes with `dist.send` / `dist.recv`: as one
contiguous tensor, and as one tensor a layer (the transfer's own message sizes, without the gather and the
scatter). Time: from a barrier to the receiver's last write, on the receiver; best of --repeats.

    python bench/pd_transfer.py [--preset gpt-oss-20b] [--pages 64,1024,4096] [--repeats 5] [--tiny]

Rows go to $OUT/pd_transfer.json: pages, MB, seconds and GB/s of each way, the transfer over each peer, and
whether the receiver's pages equal the sender's afterwards (checksums).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Log

from minakv.model.config import ModelConfig
from minakv.presets.real import real_config
from minakv.worker.coherence import Moves
from minakv.worker.transfer import Part, Peer, Transfer

TINY = {"layers": 2, "kv_heads": 2, "head_dim": 16, "pool_pages": 64}


def shape(args: argparse.Namespace) -> dict:
    if args.tiny:
        return TINY
    c = ModelConfig.from_hf(real_config(args.preset))
    return {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "pool_pages": args.pool_pages}  # fmt: skip


def rank_main(rank: int, args: argparse.Namespace, store: str) -> None:
    cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=store, rank=rank, world_size=2)
    s, ps = shape(args), args.page_size
    dtype = torch.float8_e4m3fn if args.kv_fp8 else torch.bfloat16
    dims = (s["layers"], s["pool_pages"] * ps + 1, s["kv_heads"], s["head_dim"])
    torch.manual_seed(rank)  # each rank's pool its own random contents: the check below means something
    k = torch.randn(dims, device=device).to(dtype)
    v = torch.randn(dims, device=device).to(dtype)
    worker = SimpleNamespace(
        k_cache=k, v_cache=v, device=device, last_tokens=torch.zeros(0, dtype=torch.long)
    )
    peer = Peer(worker, rank, 1, ps, s["pool_pages"], stage=False)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    def timed(fn) -> float:
        """Best receiver time of --repeats runs (after one that warms up: NCCL connects, allocations)."""
        best = float("inf")
        for _ in range(args.repeats + 1):
            sync()
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        return best  # (meaningful on rank 1, the receiver: it is done when its last write is)

    log = Log()
    rng = np.random.default_rng(0)
    seq = 0
    for n in (int(x) for x in args.pages.split(",")):
        n = min(n, s["pool_pages"])
        pages = np.sort(rng.choice(s["pool_pages"], n, replace=False)).astype(np.int64)
        moves = Moves(pages, np.zeros(n, dtype=np.int64))
        nbytes = 2 * s["layers"] * n * ps * s["kv_heads"] * s["head_dim"] * k.element_size()

        def transfer(moves: Moves = moves) -> None:
            nonlocal seq
            seq += 1
            peer.run(Part(seq, None, [Transfer(0, 1, pages=moves)]))

        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        per_layer = list(flat.view(s["layers"], -1).unbind(0))

        def plain(flat: torch.Tensor = flat) -> None:
            if rank == 0:
                dist.send(flat, 1)
            else:
                dist.recv(flat, 0)

        def layers(per_layer: list[torch.Tensor] = per_layer) -> None:
            ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank) for t in per_layer]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        row = {"pages": n, "tokens": n * ps, "mb": nbytes / 1e6, "device": str(device), "dtype": str(dtype)}
        for name, fn in (("transfer", transfer), ("send", plain), ("send_per_layer", layers)):
            sec = timed(fn)
            row[f"{name}_s"], row[f"{name}_gb_s"] = sec, nbytes / sec / 1e9
        # the receiver's copy of the pages is now the sender's: compare checksums of K and V there
        slots = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1)).to(device)
        mine = torch.stack([k[:, slots].float().sum(), v[:, slots].float().abs().sum()]).double()
        theirs = mine.clone()
        dist.broadcast(theirs, 0)
        row["verified"] = bool(torch.equal(mine, theirs))
        row["transfer_over_send"] = row["transfer_gb_s"] / row["send_gb_s"]
        row["transfer_over_send_per_layer"] = row["transfer_gb_s"] / row["send_per_layer_gb_s"]
        if rank == 1:
            log.add("pd_transfer", **row)
            print(f"{n:6d} pages ({row['mb']:8.1f} MB): transfer {row['transfer_gb_s']:7.2f} GB/s, send "
                  f"{row['send_gb_s']:7.2f}, per layer {row['send_per_layer_gb_s']:7.2f}; transfer / send "
                  f"{row['transfer_over_send']:.3f}", flush=True)  # fmt: skip
    if rank == 1:
        log.save("pd_transfer.json")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--pages", default="64,1024,4096")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=8192, help="pages in each rank's pool")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-fp8", action="store_true", help="float8_e4m3fn pools (half the bytes a token)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, two CPU processes over gloo")
    args = p.parse_args(argv)
    if not args.tiny and torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs (or --tiny: two CPU processes)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the device notes)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, f"file://{tmp}/store"), nprocs=2)


if __name__ == "__main__":
    main()
