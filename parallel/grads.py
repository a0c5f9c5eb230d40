"""What the engines do to gradients and learning rates: clipping (with the tensor-parallel norm),
the sequence-parallel gradient sum, and setting the lr of every parameter group."""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from parallel.dist import collective
from parallel.layers import is_tensor_parallel
from parallel.mesh import layout


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (in place if it is a tensor, to keep its identity)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def step_on_device(param_groups) -> bool:
    """Whether AdamW keeps its `step` on the parameters' device: fused or capturable groups do (torch's rule),
    the others keep it on the CPU. State written in directly, not by load_state_dict, must follow it."""
    return any(g.get("fused") or g.get("capturable") for g in param_groups)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total L2 norm of the gradients (fp32 tensor, before clipping); clip to `max_norm` if > 0.

    Both paths stay on the device (no `.item()`), so logging the norm later costs the only sync.
    Parameters without a gradient are ignored.
    """
    if not (0 <= max_norm < math.inf):
        raise ValueError(f"max_norm must be non-negative and finite (0 disables clipping), got {max_norm}")
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float32)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True).float()
    grads = [p.grad for p in params]
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads, foreach=True).float()
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(grads[0].device) for g in grads])
    return torch.linalg.vector_norm(norms)


def all_reduce_flat(grads: list[torch.Tensor], group, what: str, scale: float = 1.0) -> None:
    """Sum (then scale) gradients over `group` in place, one flat buffer per dtype."""
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        collective(f"all_reduce({what})", dist.all_reduce, flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_tp_grads(grads: list[torch.Tensor]) -> None:
    """Sum gradients over the TP group in one flat buffer."""
    if grads:
        all_reduce_flat(grads, layout().tp_group, "sequence-parallel grads")


def grad_square_sum(params: list[torch.nn.Parameter], device: torch.device | None = None) -> torch.Tensor:
    """The sum of squared gradients over the model when some parameters are TP shards (their squares
    summed over the TP group) and the rest are replicated (counted once): a float32 scalar, on `device`
    (default: the parameters'; a pipeline stage with no gradient of its own still joins the stages' sum)."""
    sharded = [p.grad for p in params if p.grad is not None and is_tensor_parallel(p)]
    replicated = [p.grad for p in params if p.grad is not None and not is_tensor_parallel(p)]
    device = device or next((p.device for p in params), torch.device("cpu"))
    # on the gradients' device: no copy to the host (a sync), and NCCL reduces device tensors only
    sq = [torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else
          torch.zeros((), dtype=torch.float32, device=device) for grads in (sharded, replicated)]
    if layout().tp > 1:
        collective("all_reduce(grad norm)", dist.all_reduce, sq[0], group=layout().tp_group)
    return sq[0] + sq[1]


def tensor_parallel_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients of a TP layout (grad_square_sum's root)."""
    return grad_square_sum(params).sqrt()
