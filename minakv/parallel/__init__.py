"""Tensor-parallel attention and expert-parallel MoE across the ranks of one process group
(docs/parallel.md): the layout and its collectives (`group.py`), which slice of each weight a rank holds
(`shard.py`), and running only the rank's experts (`experts.py`)."""

from minakv.parallel.group import SINGLE, Parallel, ParallelError

__all__ = ["SINGLE", "Parallel", "ParallelError"]
