"""Expert parallelism, the all-to-all form: each rank sends its share of the tokens to the ranks that hold
their experts, those compute them, the results come back, and each rank combines its own tokens.

The tokens enter the MoE block replicated (attention is replicated or tensor-parallel, so every rank
holds the same [T, H] and the same routing), and leave it replicated, as the rest of the layer expects.
Rank r of a world of w takes rows [start_r, start_r + n_r) (the first T % w ranks one row more):

    rank r: x[start_r : start_r + n_r], its ids and weights [n_r, k]
      | dispatch   all_to_all_single: each (token, expert) pair's row to the ranks of the expert's block
      |            (moe_tp of them when world > ep: each holds a slice of the expert's I), sorted by
      |            (rank, local expert), after the per-(rank, local expert) counts (a small all_to_all)
      | experts    the received rows, grouped by source then by local expert, as k = 1 routing of weight 1
      | return     all_to_all_single, the reverse split sizes: every entry comes back where it was sent
      | combine    per token, in (slot, moe_tp rank) order, sum weight * result in fp32: no atomics, the
      |            same order on every run
      v all-gather all_gather_single of [ceil(T / w), H] (a short last share is padded) -> [T, H]

Exactness: a pair's product weight * expert(x) is the one the all-reduce form computes; the pairs are
summed in another order, in fp32, and rounded to x's dtype once (the all-reduce form rounds each rank's
partial, then sums those in x's dtype).

Bytes moved per layer by one rank (b bytes per element, uniform routing, moe_tp = world / ep): the
dispatch sends n * k * moe_tp rows of H minus the ~1/ep of them that stay on the rank, the return the
same, and the all-gather (ring) (w - 1) / w * T * H * b. With moe_tp = 1 and n = T / ep that is

    all-to-all:  T * H * b * (ep - 1) / ep * (2 * k / ep + 1)
    all-reduce:  T * H * b * (ep - 1) / ep * 2                     (ring: reduce-scatter + all-gather)

plus w * E / ep int64 counts and one host sync to read them. So while attention is replicated the
all-to-all form moves more bytes than the all-reduce for k > ep / 2 (GPT-OSS k = 4, MiniMax-M2 k = 8);
it saves little compute (each rank combines only its T / w tokens). Its gain comes once attention is data
parallel (every rank its own requests): no replicated tokens and no all-gather, 2 * k / ep of a [T, H]
per layer.

Shapes depend on the routing (the split sizes), so this runs only eagerly; a CUDA graph captures the
masked all-reduce form (minakv/parallel/experts.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minakv.parallel.group import Parallel

if TYPE_CHECKING:
    from minakv.parallel.experts import Experts

# torch 2.13 renamed all_gather_into_tensor (and deprecates the old name); pyproject allows torch 2.11
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shares(tokens: int, world: int) -> list[int]:
    """How many rows each rank takes: T // w each, one more on the first T % w ranks."""
    return [tokens // world + (r < tokens % world) for r in range(world)]


def dispatch_experts(
    experts: Experts,  # this rank's block of experts (and its slice of their I)
    x: torch.Tensor,  # [T, H], the same on every rank
    weights: torch.Tensor,  # [T, k] float32, the same on every rank
    ids: torch.Tensor,  # [T, k], global expert ids
    num_experts: int,
    parallel: Parallel,
) -> torch.Tensor:
    """The whole MoE output [T, H] in x's dtype, the same on every rank, computed by all-to-all exchange."""
    world, moe_tp, group = parallel.world, parallel.moe_tp, parallel.group
    per_block = num_experts // parallel.ep
    sizes = shares(x.shape[0], world)
    start, n = sum(sizes[: parallel.rank]), sizes[parallel.rank]
    mine, k, hidden = ids[start : start + n], ids.shape[1], x.shape[1]

    # One entry per (token, slot, moe_tp rank): its destination rank and local expert there, as one key,
    # so a stable sort groups the rows by destination, then by expert, and keeps token order inside.
    block = mine // per_block
    dest = (block * moe_tp)[..., None] + torch.arange(moe_tp, device=x.device)  # [n, k, moe_tp]
    key = (dest * per_block + (mine - block * per_block)[..., None]).reshape(-1)
    order = torch.argsort(key, stable=True)
    send_counts = torch.bincount(key, minlength=world * per_block)  # [world * per_block]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # what each rank sends me, per expert
    sent, received = torch.stack([send_counts, recv_counts]).view(2, world, per_block).sum(-1).tolist()

    rows = x[start : start + n].index_select(0, order // (k * moe_tp))
    got = x.new_empty(sum(received), hidden)
    dist.all_to_all_single(got, rows, received, sent, group=group)

    if got.shape[0]:  # a rank may receive nothing (T < world, or no pair routed to its experts)
        local = torch.arange(per_block, device=x.device).repeat(world)
        local = local.repeat_interleave(recv_counts, output_size=got.shape[0])
        ones = torch.ones(got.shape[0], 1, dtype=torch.float32, device=x.device)
        done = experts(got, ones, local[:, None])  # weight 1: the combine weighs in fp32
    else:
        done = got
    back = x.new_empty(rows.shape)
    dist.all_to_all_single(back, done.contiguous(), sent, received, group=group)

    entries = torch.empty_like(back)
    entries[order] = back  # back to (token, slot, moe_tp rank) order
    w = weights[start : start + n].float().repeat_interleave(moe_tp, dim=1)  # [n, k * moe_tp]
    out = (entries.view(n, k * moe_tp, hidden).float() * w[:, :, None]).sum(1).to(x.dtype)

    # The all-gather needs equal pieces: every share padded to the first (largest) one.
    piece = sizes[0]
    if n < piece:
        out = torch.cat([out, out.new_zeros(piece - n, hidden)])
    gathered = x.new_empty(world * piece, hidden)
    all_gather_single(gathered, out, group=group)
    if sizes[-1] == piece:
        return gathered
    return torch.cat([gathered[r * piece : r * piece + s] for r, s in enumerate(sizes)])
