"""The data-parallel coordinates of this rank and reductions over its data-parallel group.

Under tensor parallelism the ranks of one TP group read the same samples, so sample positions, token
counts and logged losses are per data-parallel rank, not per process (parallel.mesh.Layout). The
engines that reduce gradients over these ranks live in parallel/engine.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.dist import collective
from parallel.mesh import layout


def world() -> tuple[int, int]:
    """(data-parallel rank, size); (0, 1) without a process group."""
    lay = layout()
    if lay.dp > 1 or lay.megatron:
        return lay.dp_rank, lay.dp
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Sum over the data-parallel ranks in place (no-op on one); a stuck peer is reported, not waited on."""
    if world()[1] > 1:
        collective(f"all_reduce({what})", dist.all_reduce, tensor, group=layout().dp_group)
    return tensor
