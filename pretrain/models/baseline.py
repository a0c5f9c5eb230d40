"""Transformer++: the Llama-style baseline every recurrent architecture is compared with.

Pre-norm decoder: h = h + Attn(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)); a final RMSNorm and an
output head tied to the embedding. RoPE on q and k, no biases, optional document masking from the
sample's doc_ids, optional grouped-query attention (model.n_kv_heads: fewer key/value heads than
query heads, a smaller KV cache in decode). Initialisation follows the SPS paper's code (spec-001
section 2.1): N(0, 0.02) everywhere, the attention output projection scaled by 1/sqrt(2L), norms at one.

Linears, the embedding and the loss come from parallel.layers, so this file is the same at any
tensor-parallel size; attention goes through kernels.attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels.attention import attention, cached_attention
from parallel.layers import ColumnLinear, RMSNorm, RowLinear
from pretrain.models import decoder
from pretrain.models.base import ModelConfig
from pretrain.models.decoder import Decoder, apply_rope
from pretrain.models.hf_llama import ADAPTER as LLAMA
from pretrain.models.registry import ArchSpec, register


@dataclass
class BaselineConfig(ModelConfig):
    arch: str = "baseline"
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 0  # key/value heads, dividing n_heads (grouped-query attention); 0 means n_heads
    ffn_hidden: int = 0  # 0 means 3 * d_model, as in the SPS paper
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    document_mask: bool = False  # attend only within a document of the packed sample
    window: int = 0  # sliding attention window in keys, the query's own included (0 = unlimited)
    init_std: float = 0.02

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 3 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def validate(self) -> None:
        super().validate()
        for name in ("d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be positive (or 0 for 3 * d_model), got {self.ffn_hidden}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads}")
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads {self.n_kv_heads} must divide model.n_heads {self.n_heads} "
                             "(or be 0 for n_heads)")
        if self.head_dim % 2:
            raise ValueError(f"model head dimension d_model / n_heads = {self.head_dim} must be even for RoPE")
        if self.window < 0:
            raise ValueError(f"model.window must be >= 0 (0 = unlimited attention), got {self.window}")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError("model.norm_eps, model.rope_theta and model.init_std must be positive")


class Attention(nn.Module):
    def __init__(self, cfg: BaselineConfig, depth: int, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, dropout  # dropout: of attention probabilities, in training
        self.window = cfg.window or None
        # q, then k | v (fewer heads under GQA). Created in this order, they draw from the generator what
        # the fused q | k | v projection they replace did when d_model^2 is a multiple of 16 (normal_
        # fills blocks of 16), so MHA models start from the same weights as before the split.
        self.q = ColumnLinear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias, init_std=cfg.init_std)
        self.kv = ColumnLinear(cfg.d_model, 2 * cfg.kv_heads * cfg.head_dim, bias, init_std=cfg.init_std,
                               stacked=2)  # k | v: TP gives every rank whole heads of both
        # the output projection's init scales with the effective depth (block applications per token)
        self.proj = RowLinear(cfg.d_model, cfg.d_model, bias, init_std=cfg.init_std / math.sqrt(2 * depth))

    def forward(self, x, cos, sin, doc_ids, cache=None, layer: int = 0) -> Tensor:
        # Shapes come from the projection's output: under tensor/sequence parallelism it holds this
        # rank's heads and the whole sequence while x may hold a slice of the sequence.
        q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = attention(q, k, v, doc_ids, window=self.window, dropout_p=self.dropout if self.training else 0.0)
        else:  # streaming: attend to everything cached plus, causally, the new tokens
            keys, values, start = cache.extend(layer, k, v)  # a windowed cache may hold only the last keys
            y = cached_attention(q, keys, values, start, window=self.window)
        return self.proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, cfg: BaselineConfig):
        super().__init__()
        self.gate = ColumnLinear(cfg.d_model, cfg.ffn, init_std=cfg.init_std)
        self.up = ColumnLinear(cfg.d_model, cfg.ffn, init_std=cfg.init_std)
        self.down = RowLinear(cfg.ffn, cfg.d_model, init_std=cfg.init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: BaselineConfig, depth: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, depth)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, h, cos, sin, doc_ids, cache=None, layer=0) -> Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, doc_ids, cache, layer)
        return h + self.ffn(self.ffn_norm(h))


class TransformerPP(Decoder):
    """A stack of n_layers blocks, each applied once (the skeleton in decoder.py does the rest)."""

    def __init__(self, cfg: BaselineConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Block(cfg, cfg.n_layers) for _ in range(cfg.n_layers))

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


def upgrade_state(state: dict, cfg: BaselineConfig) -> dict:
    """Weights saved before grouped-query attention: the fused attn.qkv (rows q | k | v) split into
    attn.q and attn.kv (exact: the same rows)."""
    for name in [n for n in state if n.endswith(".attn.qkv.weight") or n.endswith(".attn.qkv.bias")]:
        prefix, kind = name.rsplit(".attn.qkv.", 1)
        fused = state.pop(name)
        state[f"{prefix}.attn.q.{kind}"], state[f"{prefix}.attn.kv.{kind}"] = fused[:cfg.d_model], fused[cfg.d_model:]
    return state


SPEC = register(ArchSpec(
    name="baseline",
    config_cls=BaselineConfig,
    build=TransformerPP,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    tp_dims=decoder.tp_dims,
    recompute_units=lambda model: list(model.blocks),
    hf=LLAMA,  # transformers' LlamaForCausalLM (pretrain export --format hf, pretrain import)
    upgrade_state=upgrade_state,
))
