"""The ranks one model is spread over, as the model sees them, and the sums it needs between them.

A model runs on `world = max(tp, ep)` ranks of one process group (NCCL on GPUs, gloo on CPU: the same
calls). Two numbers say how it is cut:

- `tp` (tensor_parallel_size): attention's heads are split `tp` ways. `tp` is 1 (attention replicated on
  every rank) or `world` (split over all of them), so attention's sum runs over the whole group and no
  subgroup is ever needed: `new_group` is collective over the *default* world, which would tie this to
  whatever else shares that world (prefill and decode workers).
- `ep` (expert_parallel_size): the experts are split `ep` ways, contiguously; the `world // ep` ranks
  that hold the same experts split each expert's intermediate dimension between them.

      world 2:  tp=2 ep=1               tp=1 ep=2               tp=2 ep=2
                rank 0  heads 0..H/2    all heads               heads 0..H/2
                        experts all,    experts 0..E/2, whole   experts 0..E/2, whole
                        rows 0..I/2
                rank 1  heads H/2..H    all heads               heads H/2..H
                        experts all,    experts E/2..E, whole   experts E/2..E, whole
                        rows I/2..I

Every rank sees every token. After attention (when tp > 1) an all-reduce sums the partial outputs; the
MoE block ends with an all-reduce of partial outputs or (ep > 1, `expert_dispatch="all_to_all"`) an
all-to-all exchange of its tokens and an all-gather (experts.py), so every rank ends each layer with the
same hidden states. At world 1 every collective is a no-op and the model is exactly the single-device one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

EXPERT_DISPATCH = ("all_to_all", "all_reduce")


class ParallelError(ValueError):
    """A parallel layout the model cannot be cut into: says which size does not divide what."""


@dataclass(frozen=True)
class Parallel:
    rank: int = 0  # this process's rank in `group`
    tp: int = 1  # tensor_parallel_size: attention heads split this many ways (1 or world)
    ep: int = 1  # expert_parallel_size: experts split this many ways (divides world)
    group: dist.ProcessGroup | None = None  # None: the default group (only used when world > 1)
    # How the MoE block's ranks meet when ep > 1 (experts.py): "all_reduce" sums partials (EngineConfig's
    # default), "all_to_all" sends each token to the ranks of its experts and back (eager steps; a CUDA
    # graph capture falls back to the all-reduce).
    expert_dispatch: str = "all_reduce"

    def __post_init__(self) -> None:
        world = self.world
        if self.tp < 1 or self.ep < 1:
            raise ParallelError(
                f"tensor_parallel_size {self.tp} and expert_parallel_size {self.ep} must be >= 1"
            )
        if self.tp not in (1, world) or world % self.ep:
            raise ParallelError(
                f"tensor_parallel_size {self.tp}, expert_parallel_size {self.ep}: attention is split over all "
                f"{world} ranks or none, and the experts over a divisor of {world}"
            )
        if self.expert_dispatch not in EXPERT_DISPATCH:
            raise ParallelError(f"expert_dispatch {self.expert_dispatch!r} is not one of {EXPERT_DISPATCH}")
        if not 0 <= self.rank < world:
            raise ParallelError(f"rank {self.rank} is outside a world of {world}")
        if world > 1 and dist.is_initialized() and dist.get_world_size(self.group) != world:
            raise ParallelError(
                f"the process group has {dist.get_world_size(self.group)} ranks, tp={self.tp} ep={self.ep} "
                f"need {world}"
            )

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def attn_rank(self) -> int:
        """Which slice of the heads this rank holds (0 when attention is replicated)."""
        return self.rank if self.tp > 1 else 0

    @property
    def ep_rank(self) -> int:
        """Which block of experts this rank holds."""
        return self.rank // self.moe_tp

    @property
    def moe_tp(self) -> int:
        """How many ranks share one block of experts, each with a slice of their intermediate dim."""
        return self.world // self.ep

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the experts this rank holds."""
        count = num_experts // self.ep
        return self.ep_rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over every rank, in place (the MoE's partial outputs)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks that split attention (nothing to sum when it is replicated)."""
        return self.all_reduce(x) if self.tp > 1 else x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool: every rank must allocate the same pages)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = Parallel()


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL sums only CUDA tensors; gloo only CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
