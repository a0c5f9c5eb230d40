"""Engines: how one training step's gradients are reduced and applied over the layout's ranks.

The trainer drives every engine through the same calls and never branches on which one runs:

    engine = build_engine(model, cfg)            # after parallel.mesh.setup_layout, model built under it
    for i, batch in enumerate(micro_batches):
        with engine.accumulating(last=i == n - 1):
            loss, diag = engine.forward(batch, ctx)   # the model contract: pretrain/models/base.py
            engine.backward(loss * weight_i)
    grad_norm = engine.finish_grads(max_norm)    # reduce, clip; the pre-clip norm (None: known after step)
    engine.step(); engine.zero_grad()

An engine is also the checkpoint view of its model and optimizer (pretrain.checkpoint.as_state): it
hands over full tensors keyed by the single-device model's parameter names and takes them back,
whatever its sharding, so checkpoints are layout-free.

Engines: "ddp" (torch DDP, also over the data-parallel group of a TP layout), "megatron"
(megatron-core DDP, optionally its distributed optimizer: parallel/megatron_ddp.py) and "deepspeed"
(ZeRO stage 1/2/3: parallel/zero.py). Gradients are averaged over data-parallel ranks by each engine.
"""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parallel.dist import collective
from parallel.layers import is_tensor_parallel, sequence_parallel_params
from parallel.mesh import layout
from pretrain.checkpoint import LocalState
from pretrain.optim import build_optimizer, clip_grad_norm, set_lr


# -- full tensors from tensor-parallel shards, and back ---------------------------------------------

def _blocks(t: torch.Tensor, p) -> list[torch.Tensor]:
    """This rank's shard of p-shaped tensor t as its `partition_stride` stacked blocks."""
    return list(t.chunk(getattr(p, "partition_stride", 1), dim=p.partition_dim))


def gather_full(local: torch.Tensor, p) -> torch.Tensor:
    """The full tensor of which `local` is this rank's TP shard (shaped like parameter p)."""
    lay = layout()
    parts = [torch.empty_like(local) for _ in range(lay.tp)]
    collective("all_gather(checkpoint shard)", dist.all_gather, parts, local.contiguous(), group=lay.tp_group)
    per_rank = [_blocks(x, p) for x in parts]  # rank r holds block b's r-th slice
    stride = len(per_rank[0])
    return torch.cat([per_rank[r][b] for b in range(stride) for r in range(lay.tp)], dim=p.partition_dim)


def local_of_full(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's TP shard of full tensor `full` (the inverse of gather_full)."""
    lay = layout()
    stride = getattr(p, "partition_stride", 1)
    blocks = full.chunk(stride, dim=p.partition_dim)
    return torch.cat([b.chunk(lay.tp, dim=p.partition_dim)[lay.tp_rank] for b in blocks], dim=p.partition_dim)


def full_shape(p) -> torch.Size:
    shape = list(p.shape)
    shape[p.partition_dim] *= layout().tp
    return torch.Size(shape)


class FullState:
    """A checkpoint view that turns the TP-sharded entries of an inner view's state into full
    tensors on save and back into this rank's shards on load (identity without TP)."""

    def __init__(self, inner, model: torch.nn.Module):
        self.inner, self.has_optimizer = inner, inner.has_optimizer
        self.model = model
        self.sharded = {}  # parameters and buffers that hold a TP shard, by every name they are saved under
        for module_name, module in model.named_modules():  # a tied weight is also saved under its other names
            prefix = f"{module_name}." if module_name else ""
            for name, p in module.named_parameters(recurse=False):
                if is_tensor_parallel(p):
                    self.sharded[prefix + name] = p
            # A module holding a TP-sharded buffer names it in `tp_buffers` {name: partition_dim} (an
            # attribute on the buffer itself would not survive .to(), which replaces buffers).
            for name, dim in getattr(module, "tp_buffers", {}).items() if layout().tp > 1 else ():
                buf = module.get_buffer(name)
                self.sharded[prefix + name] = SimpleNamespace(partition_dim=dim, partition_stride=1, shape=buf.shape)

    def _map(self, model_sd: dict, optim_state: dict | None, fn) -> tuple[dict, dict | None]:
        # (megatron's layers add `_extra_state: None` entries, which hold nothing; they are left out
        # and recreated by megatron's load hook; any other non-tensor is refused by the checkpoint)
        model_sd = {k: fn(v, self.sharded[k]) if k in self.sharded else v for k, v in model_sd.items()
                    if not (k.endswith("._extra_state") and v is None)}
        if optim_state is not None:
            optim_state = {k: {n: fn(v, self.sharded[k]) if k in self.sharded and v.dim() else v
                               for n, v in s.items()} for k, s in optim_state.items()}
        return model_sd, optim_state

    def get_state(self):
        model_sd, optim_sd = self.inner.get_state()
        model_sd, state = self._map(model_sd, optim_sd["state"] if optim_sd else None, gather_full)
        return model_sd, (None if optim_sd is None else {**optim_sd, "state": state})

    def model_template(self) -> dict:
        return self._map(self.inner.model_template(), None, lambda v, p: torch.empty(full_shape(p), dtype=v.dtype))[0]

    def optim_template(self) -> dict:
        return self._map({}, self.inner.optim_template(), lambda v, p: torch.empty(full_shape(p), dtype=v.dtype))[1]

    def set_state(self, model_sd: dict, optim_state: dict, groups) -> None:
        model_sd, optim_state = self._map(model_sd, optim_state, local_of_full)
        self.inner.set_state(model_sd, optim_state, groups)


# -- the shared reductions -------------------------------------------------------------------------

def sequence_parallel_grads_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Under SP, the parameters whose gradients are partial (each rank saw a slice of the sequence)
    and must be summed over the TP group: those their layer marked (parallel.layers.RMSNorm)."""
    lay = layout()
    return sequence_parallel_params(model) if lay.sp and lay.tp > 1 else []


def all_reduce_tp_grads(grads: list[torch.Tensor]) -> None:
    """Sum gradients over the TP group in one flat buffer."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    collective("all_reduce(sequence-parallel grads)", dist.all_reduce, flat, group=layout().tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def tensor_parallel_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients when some parameters are TP shards (their squares summed over
    the TP group) and the rest are replicated (counted once)."""
    sharded = [p.grad for p in params if p.grad is not None and is_tensor_parallel(p)]
    replicated = [p.grad for p in params if p.grad is not None and not is_tensor_parallel(p)]
    sq = torch.zeros(2, dtype=torch.float32)
    for i, grads in enumerate((sharded, replicated)):
        if grads:
            sq[i] = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    collective("all_reduce(grad norm)", dist.all_reduce, sq[:1], group=layout().tp_group)
    return sq.sum().sqrt()


# -- torch DDP -------------------------------------------------------------------------------------

class Engine:
    """torch's DDP over the data-parallel group (nothing at all on one rank); the base of the others."""

    name = "ddp"

    def __init__(self, model: torch.nn.Module, optim_cfg, compile: bool = False, wrap: bool | None = None):
        """`wrap`: use DDP (default: when there are several data-parallel ranks; the overhead
        benchmark forces it at one rank)."""
        lay = layout()
        self.model = model
        self.optimizer = build_optimizer(model, optim_cfg)
        self.wrapped = model
        if lay.dp > 1 if wrap is None else wrap:
            device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
            # gradient_as_bucket_view: gradients live in DDP's buckets (no copy in and out per step)
            self.wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                                     process_group=lay.dp_group,
                                                                     gradient_as_bucket_view=True)
        self.forward = torch.compile(self.wrapped) if compile else self.wrapped
        self.sp_params = sequence_parallel_grads_params(model)
        self.state = FullState(LocalState(model, self.optimizer), model)

    # the training step
    def accumulating(self, last: bool):
        """Skip the gradient all-reduce on all but the last micro batch of a step."""
        if last or not hasattr(self.wrapped, "no_sync"):
            return nullcontext()
        return self.wrapped.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_grads(self, max_norm: float) -> torch.Tensor | None:
        all_reduce_tp_grads([p.grad for p in self.sp_params if p.grad is not None])
        params = list(self.model.parameters())
        if layout().tp == 1:
            return clip_grad_norm(params, max_norm)
        norm = tensor_parallel_grad_norm(params)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
        return norm

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def grad_norm_after_step(self) -> torch.Tensor:
        raise NotImplementedError(f"the {self.name} engine reports the grad norm from finish_grads")

    # the checkpoint view (pretrain.checkpoint.as_state)
    has_optimizer = True

    def get_state(self):
        return self.state.get_state()

    def model_template(self):
        return self.state.model_template()

    def optim_template(self):
        return self.state.optim_template()

    def set_state(self, model_sd, optim_state, groups):
        self.state.set_state(model_sd, optim_state, groups)


def build_engine(model: torch.nn.Module, cfg) -> Engine:
    """The engine `cfg.parallel.data_parallel` names, around a model built under the current layout."""
    kind = cfg.parallel.data_parallel
    if kind == "megatron":
        from parallel.megatron_ddp import MegatronEngine

        return MegatronEngine(model, cfg)
    if kind == "deepspeed":
        from parallel.zero import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg)
    return Engine(model, cfg.optim, compile=cfg.train.compile)
