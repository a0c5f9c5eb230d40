"""Data parallelism applied to a single-device model: the trainer never branches on the engine.

Only torch DDP so far; megatron-core DDP (with its distributed optimizer) and DeepSpeed ZeRO plug in
behind the same three calls. Gradients are averaged over ranks by the engine, so the trainer scales
each micro batch's loss by (its tokens x dp_size / the global batch's tokens): the result is the
token-weighted mean over the whole global batch, equal to one process running that batch.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from parallel.dist import collective


def world() -> tuple[int, int]:
    """(data-parallel rank, size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wrap_data_parallel(model: torch.nn.Module, engine: str) -> torch.nn.Module:
    """The model the training step calls: itself on one rank, else wrapped by `engine`."""
    _, size = world()
    if size == 1:
        return model
    if engine != "ddp":
        raise ValueError(f"parallel.data_parallel={engine!r} is not available yet (only 'ddp')")
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def no_sync(model: torch.nn.Module, last_micro_batch: bool):
    """Skip the gradient all-reduce on all but the last micro batch of a step."""
    if last_micro_batch or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def all_reduce_sum(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Sum over ranks in place (no-op on one rank); a stuck peer is reported, not waited on."""
    if world()[1] > 1:
        collective(f"all_reduce({what})", dist.all_reduce, tensor)
    return tensor
