"""Expert parallelism: `run_experts` gives the whole MoE output on every rank, from the rank's block of
experts, in one of two forms (docs/parallel.md):

- all-to-all (`Parallel.expert_dispatch == "all_to_all"`, eager steps only): each rank takes
  1/world of the tokens, sends each (token, expert) pair to the ranks holding the expert, gets the results
  back, combines its tokens and all-gathers them (minakv/parallel/dispatch.py, which also counts the bytes).
- all-reduce (`"all_reduce"`, the default: while attention is replicated it moves fewer bytes; and always while a CUDA graph is captured, or with ep = 1, where every rank
  holds every expert and tensor parallelism splits their I): every rank runs the pairs of all tokens whose
  expert it holds, and an all-reduce sums the ranks' partial outputs:

    tokens (replicated)   router (replicated)   rank r: pairs with an expert in [first, first + count)
      x [T, H]        ->  ids, weights [T, k] ->  out_r [T, H] (zero where no pair is local)
                                                    all-reduce: out = sum_r out_r

  One all-reduce of [T, H] per layer, the same as tensor parallelism. Two ways to run only the local pairs
  (`local_experts`):
  - `compact` (eager): gather the local pairs (a host sync to learn how many) and run them as k = 1
    routing, so each rank computes ~k/ep pairs per token.
  - masked (while a CUDA graph is being captured, where shapes must not depend on data): every pair stays,
    the foreign ones get weight 0 and local expert 0. The sum is exact (a weight of 0 adds 0), at the
    price of computing the foreign pairs too: fine for decode's few tokens, wasteful for prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minakv.parallel.dispatch import dispatch_experts
from minakv.parallel.group import Parallel

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weights, ids) -> out


def run_experts(
    experts: Experts,
    x: torch.Tensor,  # [T, H], the same on every rank
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k], global expert ids
    num_experts: int,
    parallel: Parallel,
) -> torch.Tensor:
    """The MoE output [T, H] in x's dtype, the same on every rank; `experts` holds this rank's share."""
    if parallel.ep > 1 and parallel.expert_dispatch == "all_to_all" and not capturing(x):
        return dispatch_experts(experts, x, weights, ids, num_experts, parallel)
    first, count = parallel.expert_range(num_experts)
    return parallel.all_reduce(local_experts(experts, x, weights, ids, first, count, num_experts))


def capturing(x: torch.Tensor) -> bool:
    """Is a CUDA graph being captured on x's stream (shapes must not depend on data)?"""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def local_experts(
    experts: Experts,
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k], global expert ids
    first: int,
    count: int,
    num_experts: int,
    compact: bool | None = None,  # None: compact unless a CUDA graph is being captured
) -> torch.Tensor:
    """This rank's share of the MoE output, [T, H] in x's dtype; `experts` holds experts first..first+count."""
    if count == num_experts:
        return experts(x, weights, ids)
    local = ids - first
    mine = (local >= 0) & (local < count)
    if compact is None:
        compact = not capturing(x)
    if not compact:
        return experts(x, torch.where(mine, weights, 0.0), torch.where(mine, local, 0))
    tokens, slots = mine.nonzero(as_tuple=True)
    if tokens.numel() == 0:  # no pair here; the sum still needs this rank's zeros
        return torch.zeros_like(x)
    y = experts(x.index_select(0, tokens), weights[tokens, slots, None], local[tokens, slots, None])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float())  # a token's pairs summed in fp32, like the kernels do
    return out.to(x.dtype)
