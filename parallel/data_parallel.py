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


def dp_rank_and_size() -> tuple[int, int]:
    """(data-parallel rank, size); (0, 1) without a process group."""
    lay = layout()
    if lay.dp > 1 or lay.megatron:
        return lay.dp_rank, lay.dp
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Sum over the data-parallel ranks in place (no-op on one); a stuck peer is reported, not waited on."""
    if dp_rank_and_size()[1] > 1:
        collective(f"all_reduce({what})", dist.all_reduce, tensor, group=layout().dp_group)
    return tensor


def accumulation_steps(global_batch: int, micro_batch: int, dp: int = 1,
                       names: tuple[str, str] = ("global_batch_size", "micro_batch_size")) -> int:
    """Micro batches per optimizer step on each data-parallel rank: global / (micro x dp), which must
    divide exactly (ValueError naming the two settings `names` otherwise). The one place this
    arithmetic lives: the config, the trainer, the sampler and the ZeRO engine all ask here."""
    g, m = names
    if global_batch % (micro_batch * dp):
        per = f"{m} {micro_batch}" if dp == 1 else f"{m} * dp_size = {micro_batch} * {dp} = {micro_batch * dp}"
        raise ValueError(f"{g} {global_batch} is not divisible by {per}")
    return global_batch // (micro_batch * dp)
