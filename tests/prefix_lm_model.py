"""A test architecture added by following docs/adding-an-architecture.md only: a prefix LM built from
the shared blocks with an attention mask of its own, registered as "test_prefix_lm" when imported.

The first `model.prefix` positions of every sample see each other in both directions (a prefix LM's
encoder part); every later position is causal. The mask is one predicate in this file; nothing in
kernels/ or the house knows it. Decode uses the same mask value with the cache's offset, which is
exact as long as the first step feeds the whole prefix (refused otherwise).
"""
from dataclasses import dataclass

from torch import nn

from kernels.attention import Mask
from pretrain.models import baseline, decoder
from pretrain.models.blocks import Block
from pretrain.models.decoder import Decoder, DecoderConfig
from pretrain.models.registry import ArchSpec, register


@dataclass
class PrefixLMConfig(DecoderConfig):
    arch: str = "test_prefix_lm"
    # positions 0 .. prefix-1 attend to each other both ways; 3, so the registry-wide tests' shortest
    # first decode step (a 3-token prompt in the export round trip) covers it
    prefix: int = 3

    def validate(self) -> None:
        super().validate()
        if self.prefix < 0:
            raise ValueError(f"model.prefix must be >= 0, got {self.prefix}")


class PrefixLM(Decoder):
    def __init__(self, cfg: PrefixLMConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Block(cfg.block_options(cfg.n_layers)) for _ in range(cfg.n_layers))

    def applications(self) -> list[nn.Module]:
        return list(self.blocks)

    def mask(self, doc_ids=None) -> Mask:
        P = self.cfg.prefix
        both_ways = Mask(lambda b, h, q, kv: (q < P) & (kv < P), f"prefix_lm({P})")
        return super().mask(doc_ids) | both_ways

    def step(self, tokens, state):
        if state.length < self.cfg.prefix and state.length + tokens.shape[1] < self.cfg.prefix:
            raise ValueError(f"the first decode step must feed the whole prefix of model.prefix={self.cfg.prefix} "
                             f"tokens (got {tokens.shape[1]})")
        return super().step(tokens, state)


SPEC = register(ArchSpec(name="test_prefix_lm", config_cls=PrefixLMConfig, build=PrefixLM,
                         flops_per_token=baseline.flops_per_token, flops_formula=baseline.FLOPS_FORMULA,
                         tp_dims=decoder.tp_dims, recompute_units=lambda model: list(model.blocks)))
