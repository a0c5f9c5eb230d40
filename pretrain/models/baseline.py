"""Transformer++: the Llama-style baseline every recurrent architecture is compared with.

Pre-norm decoder: h = h + Attn(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)); a final RMSNorm and an
output head tied to the embedding. RoPE on q and k, no biases, optional document masking from the
sample's doc_ids, optional grouped-query attention (model.n_kv_heads: fewer key/value heads than
query heads, a smaller KV cache in decode). Initialisation follows the SPS paper's code (spec-001
section 2.1): N(0, 0.02) everywhere, the attention output projection scaled by 1/sqrt(2L), norms at one.

This file is the baseline's config, its composition of the shared blocks (pretrain/models/blocks.py)
and its registration; the decoder skeleton (decoder.py) does the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pretrain.models import decoder
from pretrain.models.blocks import Block, upgrade_attention_state
from pretrain.models.decoder import Decoder, DecoderConfig
from pretrain.models.hf_llama import ADAPTER as LLAMA
from pretrain.models.registry import ArchSpec, Support, register
from pretrain.models.units import unit_modules


@dataclass
class BaselineConfig(DecoderConfig):
    arch: str = "baseline"


class TransformerPP(Decoder):
    """A stack of n_layers blocks, each applied once (the skeleton in decoder.py does the rest)."""

    def __init__(self, cfg: BaselineConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Block(cfg.block_options(cfg.n_layers)) for _ in range(cfg.n_layers))

    def applications(self) -> list[nn.Module]:
        return list(self.blocks)


def flops_per_token(cfg: BaselineConfig, seq_len: int, ctx=None, depth: int | None = None) -> float:
    """Training FLOPs per token (FLOPS_FORMULA); `depth` block applications (default n_layers)."""
    d, L = cfg.d_model, cfg.n_layers if depth is None else depth
    attn_params = 2 * d * d + 2 * d * cfg.kv_heads * cfg.head_dim  # q and output, k and v
    matmul_params = L * (attn_params + 3 * d * cfg.ffn) + cfg.vocab_size * d
    span = min(seq_len, cfg.window) if cfg.window else seq_len  # keys a query attends to, at most
    return 6.0 * matmul_params + 12.0 * L * d * span


FLOPS_FORMULA = ("6 * (L * (2 d^2 + 2 d d_kv + 3 d f) + V d) + 12 * L * d * T: forward x 3 (forward plus "
                 "backward), 2 FLOPs per multiply-add, the output head included, attention scores and values at "
                 "full length T, or at the window when model.window < T (L block applications, width d, key/value "
                 "width d_kv = n_kv_heads * head_dim, d without GQA, FFN width f, vocabulary V)")




SPEC = register(ArchSpec(
    name="baseline",
    config_cls=BaselineConfig,
    build=TransformerPP,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    supports=Support(pp=True),
    pipeline_split=decoder.pipeline_split,
    activation_bytes=decoder.activation_bytes,
    recompute_units=unit_modules,  # each block
    hf=LLAMA,  # transformers' LlamaForCausalLM (pretrain export --format hf, pretrain import)
    upgrade_state=upgrade_attention_state,
))
