"""A test architecture that injects numerical faults at given steps: the baseline, whose training
forward at a listed step (1-based, as the trainer logs steps) returns

- `nan_loss_steps`: a NaN loss whose gradients stay finite (a constant NaN added to the loss);
- `nan_grad_steps`: a finite loss whose gradients are all NaN (through PoisonGrad's backward);
- `spike_steps`: the loss times `spike_factor` (a loss and grad-norm spike, for the outlier rule);
- `raise_steps`: a RuntimeError raised in the backward (an exception inside the step, compiled or not),
  leaving `busy_compile_s` seconds of work in inductor's compile pools (thread pool and subprocess
  pool: what a process's exit would wait for; TORCHINDUCTOR_COMPILE_THREADS >= 2) when that is > 0;
- `oom_steps`: torch.OutOfMemoryError raised in the forward, as the CUDA allocator raises it (on the
  CPU too: tests/test_oom.py); the architecture has the baseline's activation estimate with
  `activation_estimate`, none otherwise (the planner's two cases). `python fault_model.py train ...`
  takes the device's memory from FAULT_MODEL_DEVICE_GIB when set (pretrain.oom.device_memory);

on every rank, or only on `fault_rank` (>= 0). Production code holds no test hook: the architecture
is registered as "test_faults" only by `registered()` (and unregistered after), so the registry-wide
tests never see it; a subprocess or a spawned rank calls `register()` itself.
"""
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pretrain.models import baseline
from pretrain.models.base import EVAL
from pretrain.models.registry import _REGISTRY, ArchSpec, register as register_spec

NAME = "test_faults"


@dataclass
class FaultConfig(baseline.BaselineConfig):
    arch: str = NAME
    nan_loss_steps: list[int] = field(default_factory=list)
    nan_grad_steps: list[int] = field(default_factory=list)
    spike_steps: list[int] = field(default_factory=list)
    spike_factor: float = 20.0
    raise_steps: list[int] = field(default_factory=list)
    busy_compile_s: float = 0.0
    oom_steps: list[int] = field(default_factory=list)
    activation_estimate: bool = False
    fault_rank: int = -1  # -1: every rank; else only this global rank


class PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN gradients backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _busy_compile_workers(seconds: float) -> None:
    """Jobs still running in inductor's compile pools, as a failed compiled step can leave them."""
    import time

    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.pool().submit(time.sleep, seconds)  # a non-daemon thread, joined at interpreter exit
    AsyncCompile.process_pool().submit(time.sleep, seconds)  # the sidecar that inductor's atexit waits for


@torch._dynamo.disable  # eager, outside a compiled graph: the step is read without recompiling per step
def _maybe_raise_in_backward(loss, cfg, ctx):
    def fail(grad):
        if cfg.busy_compile_s > 0:
            _busy_compile_workers(cfg.busy_compile_s)
        print(f"fault_model: raising in the backward of step {ctx.step + 1}", file=sys.stderr, flush=True)
        raise RuntimeError(f"injected failure in the backward of step {ctx.step + 1} (tests/fault_model.py)")

    if ctx.step + 1 in cfg.raise_steps and loss.requires_grad:
        loss.register_hook(fail)
    return loss


@torch._dynamo.disable  # eager, outside a compiled graph (see above)
def _maybe_out_of_memory(cfg, ctx):
    if ctx.step + 1 in cfg.oom_steps:
        print(f"fault_model: out of memory in the forward of step {ctx.step + 1}", file=sys.stderr, flush=True)
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected in step "
                                     f"{ctx.step + 1} by tests/fault_model.py)")


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Faulty(baseline.TransformerPP):
    def forward(self, batch, ctx=EVAL):
        loss, diagnostics = super().forward(batch, ctx)
        c, step = self.cfg, ctx.step + 1
        if not ctx.training or (c.fault_rank >= 0 and c.fault_rank != _this_rank()):
            return loss, diagnostics
        if step in c.nan_loss_steps:
            loss = loss + torch.tensor(float("nan"), device=loss.device)
        if step in c.nan_grad_steps:
            loss = PoisonGrad.apply(loss)
        if step in c.spike_steps:
            loss = loss * c.spike_factor
        if c.raise_steps:
            loss = _maybe_raise_in_backward(loss, c, ctx)
        if c.oom_steps:
            _maybe_out_of_memory(c, ctx)
        return loss, diagnostics


SPEC = ArchSpec(name=NAME, config_cls=FaultConfig, build=Faulty, flops_per_token=baseline.flops_per_token,
                flops_formula=baseline.FLOPS_FORMULA, tp_dims=baseline.decoder.tp_dims,
                recompute_units=lambda model: list(model.blocks),
                activation_bytes=lambda cfg, T, b, policy: baseline.decoder.activation_bytes(cfg, T, b, policy)
                if cfg.activation_estimate else None)


def register() -> ArchSpec:
    return register_spec(SPEC) if _REGISTRY.get(NAME) is not SPEC else SPEC


@contextmanager
def registered():
    register()
    try:
        yield SPEC
    finally:
        _REGISTRY.pop(NAME, None)


def cli_main() -> int:
    """`pretrain` (pretrain.cli.main, as the program: its arguments from sys.argv) with this
    architecture registered: python fault_model.py train ..."""
    register()
    if os.environ.get("FAULT_MODEL_DEVICE_GIB"):  # the device's memory, as a GPU would report it
        import pretrain.oom

        total = int(float(os.environ["FAULT_MODEL_DEVICE_GIB"]) * 2**30)
        pretrain.oom.device_memory = lambda device: (total, None)
    from pretrain.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(cli_main())
