"""Expert parallelism, the simple form: every rank sees every token, runs the (token, expert) pairs whose
expert it holds, and the MoE block's all-reduce sums the ranks' partial outputs.

    tokens (replicated)   router (replicated)   rank r: pairs with an expert in [first, first + count)
      x [T, H]        ->  ids, weights [T, k] ->  out_r [T, H] (zero where no pair is local)
                                                    all-reduce: out = sum_r out_r

This costs one all-reduce of [T, H] per layer (the same as tensor parallelism) and no dispatch: the
all-to-all form (send each token only to the ranks of its experts, then send the results back) moves
k / ep of the tokens instead of all of them and would also split the router and attention by tokens
(data parallel), but needs variable-size exchanges. That is the next step, not built.

Two ways to run only the local pairs:
- `compact` (eager): gather the local pairs (a host sync to learn how many) and run them as k = 1
  routing, so each rank computes ~k/ep pairs per token.
- masked (while a CUDA graph is being captured, where shapes must not depend on data): every pair stays,
  the foreign ones get weight 0 and local expert 0. The sum is exact (a weight of 0 adds 0), at the price
  of computing the foreign pairs too: fine for decode's few tokens, wasteful for prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weights, ids) -> out


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
        compact = not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if not compact:
        return experts(x, torch.where(mine, weights, 0.0), torch.where(mine, local, 0))
    tokens, slots = mine.nonzero(as_tuple=True)
    if tokens.numel() == 0:  # no pair here; the sum still needs this rank's zeros
        return torch.zeros_like(x)
    y = experts(x.index_select(0, tokens), weights[tokens, slots, None], local[tokens, slots, None])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float())  # a token's pairs summed in fp32, like the kernels do
    return out.to(x.dtype)
