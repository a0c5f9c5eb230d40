"""Engines: how one training step's gradients are reduced and applied over the layout's ranks.

Every engine is built the same way, `Engine(model, optimizer, settings)`, by parallel.apply.parallelize
(which also applies the layout, recompute and compile first), and the trainer drives every engine
through the same calls, never branching on which one runs:

    loss, diagnostics = engine.forward_backward(micro_batches, weights, ctx, autocast, timer)
    grad_norm = engine.finish_grads(max_norm)    # reduce, clip; the pre-clip norm (None: known after step)
    engine.step(); engine.zero_grad()

`forward_backward` runs the model contract (`model(batch, ctx) -> (loss, diagnostics)`, see
pretrain/models/base.py) over one optimizer step's micro batches, calling `timer.mark("forward")` and
`timer.mark("backward")` as each phase ends (pretrain/phase_timer.py; CUDA events on a GPU); the
pipeline engine (parallel/pipeline.py) implements it with megatron-core's 1F1B schedule.
`engine.describe()` says what runs, for the start line.

An engine is also the checkpoint view of its model and optimizer (parallel/state.py): it hands over
full tensors keyed by the single-device model's parameter names and takes them back, whatever its
sharding, so checkpoints are layout-free.

Engines: "ddp" (torch DDP, also over the data-parallel group of a TP layout), "megatron"
(megatron-core DDP, optionally its distributed optimizer: parallel/megatron_ddp.py) and "deepspeed"
(ZeRO stage 1/2/3: parallel/zero.py). Gradients are averaged over data-parallel ranks by each engine.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from parallel.dist import collective
from parallel.grads import all_reduce_tp_grads, clip_grad_norm, set_lr, tensor_parallel_grad_norm
from parallel.layers import is_tensor_parallel, sequence_parallel_params
from parallel.mesh import layout
from parallel.stages import TIED
from parallel.state import LocalState


@dataclass(frozen=True)
class EngineSettings:
    """What an engine needs from a run's config (read duck-typed: parallel/ imports nothing of pretrain/)."""

    parallel: Any  # a ParallelConfig: data_parallel, zero_stage, distributed_optimizer, timeout_s, ...
    grad_clip: float  # the max norm finish_grads is called with (DeepSpeed clips inside its step)
    micro_batch_seqs: int  # sequences per forward/backward on one rank
    global_batch_seqs: int  # sequences per optimizer step over all data-parallel ranks
    wrap: bool | None = None  # torch DDP even on one rank (the overhead benchmark); None: when dp > 1

    @classmethod
    def from_run(cls, cfg, **kw) -> "EngineSettings":
        return cls(cfg.parallel, cfg.optim.grad_clip, cfg.train.micro_batch_seqs, cfg.train.global_batch_seqs, **kw)


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
        self.sharded = {}  # parameters and buffers that hold a TP shard, by every name they are saved under
        for module_name, module in model.named_modules():  # a tied weight is also saved under its other names
            prefix = f"{module_name}." if module_name else ""
            for name, p in module.named_parameters(recurse=False):
                if is_tensor_parallel(p):
                    self.sharded[prefix + name] = p
                    # a weight tied across pipeline stages keeps its optimizer state under its canonical
                    # name (the embedding's), which the last stage's head does not otherwise hold
                    self.sharded.setdefault(getattr(p, TIED, prefix + name), p)
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


class NoTimer:
    """forward_backward's timer when the caller times nothing."""

    def mark(self, phase: str) -> None:
        """Records nothing."""


# -- the shared reductions -------------------------------------------------------------------------

# -- torch DDP -------------------------------------------------------------------------------------

class Engine:
    """torch's DDP over the data-parallel group (nothing at all on one rank); the base of the others."""

    name = "ddp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: EngineSettings):
        lay = layout()
        self.model, self.optimizer, self.settings = model, optimizer, settings
        self.wrapped = model
        if lay.dp > 1 if settings.wrap is None else settings.wrap:
            device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
            # gradient_as_bucket_view: gradients live in DDP's buckets (no copy in and out per step)
            self.wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                                     process_group=lay.dp_group,
                                                                     gradient_as_bucket_view=True)
        self.forward = self.wrapped
        self.sp_params = sequence_parallel_params(model)  # marked by their layer only under SP
        self.state = FullState(LocalState(model, self.optimizer), model)

    def describe(self) -> str:
        return "torch DDP" if self.wrapped is not self.model else "single process"

    @property
    def inference_model(self) -> torch.nn.Module:
        """What evaluation calls as model(batch, ctx) -> (loss, diagnostics) (a pipeline runs its stages)."""
        return self.model

    # the training step
    def forward_backward(self, micro_batches: list, weights: torch.Tensor, ctx, autocast=nullcontext,
                         timer=NoTimer()):
        """Forward and backward of one optimizer step's micro batches, micro batch i's loss scaled by
        weights[i]; returns (sum of weights[i] x loss_i, {name: sum of weights[i] x diagnostic_i}).
        Gradients stay unreduced until the last micro batch."""
        loss_sum = torch.zeros((), device=weights.device, dtype=weights.dtype)
        diagnostics: dict = {}
        for i, batch in enumerate(micro_batches):
            with self.accumulating(last=i == len(micro_batches) - 1):
                with autocast():
                    loss, diag = self.forward(batch, ctx)
                timer.mark("forward")
                self.backward(loss * weights[i])
            loss_sum += loss.detach() * weights[i]
            for name, value in diag.items():
                share = value.detach().float() * weights[i]
                diagnostics[name] = diagnostics[name] + share if name in diagnostics else share
            timer.mark("backward")
        return loss_sum, diagnostics

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

    # the checkpoint view (parallel/state.py)
    has_optimizer = True

    def get_state(self):
        return self.state.get_state()

    def model_template(self):
        return self.state.model_template()

    def optim_template(self):
        return self.state.optim_template()

    def set_state(self, model_sd, optim_state, groups):
        self.state.set_state(model_sd, optim_state, groups)
