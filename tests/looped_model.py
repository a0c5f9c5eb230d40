"""A tiny test architecture that applies ONE block several times per step (like CRT's K passes or
CART's R loops), registered as "test_looped" when this module is imported.

It exists to prove that weight reuse within a step works with activation checkpointing under every
data-parallel engine (gradients reduced once, recomputation that replays the same block), and that
the decoder skeleton (pretrain/models/decoder.py) serves a looped model: its init sees the effective
depth, its decode cache has a slot per application, its FLOPs count every application.
"""
from dataclasses import dataclass

import torch
from torch import nn

from pretrain.models import baseline, decoder
from pretrain.models.blocks import Block
from pretrain.models.base import EVAL
from pretrain.models.registry import ArchSpec, Support, register


@dataclass
class LoopedConfig(baseline.BaselineConfig):
    arch: str = "test_looped"
    loops: int = 3  # applications of the one block per forward (model.n_layers is not used)


class Looped(decoder.Decoder):
    def __init__(self, cfg: LoopedConfig):
        super().__init__(cfg)
        self.block = Block(cfg.block_options(depth=cfg.loops))

    def applications(self) -> list[nn.Module]:
        return [self.block] * self.cfg.loops

    def forward(self, batch, ctx=EVAL):
        """The decoder's loss, with diagnostics that test their reduction: a copy of the loss (reduced
        like it, so it must log equal to it) and, in training, a draw from the step's generator (the
        same on every rank and micro batch, so it must log equal to that draw)."""
        loss, _ = super().forward(batch, ctx)
        diagnostics = {"loss_copy": loss.detach()}
        if ctx.training:
            diagnostics["draw"] = torch.rand((), generator=ctx.generator())
        return loss, diagnostics


def flops_per_token(cfg: LoopedConfig, seq_len: int, ctx=None) -> float:
    return baseline.flops_per_token(cfg, seq_len, ctx, depth=cfg.loops)


ENTRY = dict(config_cls=LoopedConfig, build=Looped, flops_per_token=flops_per_token,
             flops_formula=baseline.FLOPS_FORMULA.replace("L block applications", "L = loops applications"),
             tp_dims=decoder.tp_dims)
SPEC = register(ArchSpec(name="test_looped", recompute_units=lambda model: [model.block], progress=("draw",),
                         **ENTRY))

# The same model with a restricted support matrix, to test that refusals happen in validate().
RESTRICTED = register(ArchSpec(
    name="test_looped_restricted", **ENTRY,
    supports=Support(tp=False, sp=False, zero_stages=(0, 1, 2),
                     reasons={"tp": "its time loop is strictly sequential", "sp": "it refuses tensor parallelism",
                              "zero": "not shown to work yet"}),
))
