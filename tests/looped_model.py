"""A tiny test architecture that applies ONE block several times per step (like CRT's K passes or
CART's R loops), registered as "test_looped" when this module is imported.

It exists to prove that weight reuse within a step works with activation checkpointing under every
data-parallel engine (gradients reduced once, recomputation that replays the same block).
"""
from dataclasses import dataclass

from torch import nn

from parallel.layers import LMHead, VocabEmbedding
from pretrain.models import baseline
from pretrain.models.registry import ArchSpec, Support, register


@dataclass
class LoopedConfig(baseline.BaselineConfig):
    arch: str = "test_looped"
    loops: int = 3  # applications of the one block per forward


class Looped(baseline.TransformerPP):
    def __init__(self, cfg: LoopedConfig):
        nn.Module.__init__(self)
        cfg.validate()
        self.cfg = cfg
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std)
        self.block = baseline.Block(cfg)
        self.blocks = [self.block] * cfg.loops  # the same module, applied `loops` times by hidden()
        self.norm = baseline.RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = LMHead(cfg.d_model, cfg.vocab_size, tied=self.embed, init_std=cfg.init_std)
        cos, sin = baseline.rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


SPEC = register(ArchSpec(
    name="test_looped", config_cls=LoopedConfig, build=Looped,
    flops_per_token=lambda cfg, T: cfg.loops * baseline.flops_per_token(cfg, T),
    new_state=baseline.new_state, step=baseline.step, tp_dims=baseline.tp_dims,
    recompute_units=lambda model: [model.block],
))

# The same model with a restricted support matrix, to test that refusals happen in validate().
RESTRICTED = register(ArchSpec(
    name="test_looped_restricted", config_cls=LoopedConfig, build=Looped,
    flops_per_token=SPEC.flops_per_token, new_state=baseline.new_state, step=baseline.step,
    supports=Support(tp=False, sp=False, zero_stages=(0, 1, 2),
                     reasons={"tp": "its time loop is strictly sequential", "zero": "not shown to work yet"}),
))
