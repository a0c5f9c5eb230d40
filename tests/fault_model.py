"""A test architecture that injects numerical faults at given steps: the baseline, whose training
forward at a listed step (1-based, as the trainer logs steps) returns

- `nan_loss_steps`: a NaN loss whose gradients stay finite (a constant NaN added to the loss);
- `nan_grad_steps`: a finite loss whose gradients are all NaN (through PoisonGrad's backward);
- `spike_steps`: the loss times `spike_factor` (a loss and grad-norm spike, for the outlier rule);

on every rank, or only on `fault_rank` (>= 0). Production code holds no test hook: the architecture
is registered as "test_faults" only by `registered()` (and unregistered after), so the registry-wide
tests never see it; a subprocess or a spawned rank calls `register()` itself.
"""
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
    fault_rank: int = -1  # -1: every rank; else only this global rank


class PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN gradients backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


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
        return loss, diagnostics


SPEC = ArchSpec(name=NAME, config_cls=FaultConfig, build=Faulty, flops_per_token=baseline.flops_per_token,
                flops_formula=baseline.FLOPS_FORMULA, tp_dims=baseline.decoder.tp_dims,
                recompute_units=lambda model: list(model.blocks))


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
    """`pretrain` (pretrain.cli.main) with this architecture registered: python fault_model.py train ..."""
    register()
    from pretrain.cli import main

    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(cli_main())
