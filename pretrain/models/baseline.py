"""Transformer++: the Llama-style baseline every recurrent architecture is compared with.

Pre-norm decoder: h = h + Attn(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)); a final RMSNorm and an
output head tied to the embedding. RoPE on q and k, no biases, optional document masking from the
sample's doc_ids. Initialisation follows the SPS paper's code (spec-001 section 2.1): N(0, 0.02)
everywhere, the attention output projection scaled by 1/sqrt(2L), norms at one.

Linears, the embedding and the loss come from parallel.layers, so this file is the same at any
tensor-parallel size; attention goes through kernels.attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels.attention import attention, cached_attention
from parallel.layers import ColumnLinear, LMHead, RowLinear, VocabEmbedding
from pretrain.models.registry import ArchSpec, register


@dataclass
class BaselineConfig:
    arch: str = "baseline"
    vocab_size: int = 50304
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    ffn_hidden: int = 0  # 0 means 3 * d_model, as in the SPS paper
    max_seq_len: int = 4096  # length of the RoPE table and of the generation cache
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    document_mask: bool = False  # attend only within a document of the packed sample
    init_std: float = 0.02

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 3 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be positive (or 0 for 3 * d_model), got {self.ffn_hidden}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by model.n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model head dimension d_model / n_heads = {self.head_dim} must be even for RoPE")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError("model.norm_eps, model.rope_theta and model.init_std must be positive")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (bf16 statistics are too coarse)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim / 2] for rotating the pairs (x[2i], x[2i+1]) (Llama's layout)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, Dh]; cos, sin [B, 1, T, Dh/2] already gathered at the tokens' positions."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class KVCache:
    """Keys and values of every layer for streaming decode, [B, H, max_len, Dh] each, filled to `length`."""

    def __init__(self, cfg: BaselineConfig, batch_size: int, device, dtype):
        shape = (batch_size, cfg.n_heads, cfg.max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0


class Attention(nn.Module):
    def __init__(self, cfg: BaselineConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = ColumnLinear(cfg.d_model, 3 * cfg.d_model, init_std=cfg.init_std, stacked=3)  # q | k | v
        self.proj = RowLinear(cfg.d_model, cfg.d_model, init_std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def forward(self, x, cos, sin, doc_ids, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        # Shapes come from the projection's output: under tensor/sequence parallelism it holds this
        # rank's heads and the whole sequence while x may hold a slice of the sequence.
        q, k, v = self.qkv(x).unflatten(-1, (3, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        T = q.shape[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = attention(q, k, v, doc_ids)
        else:  # streaming: attend to everything cached plus, causally, the new tokens
            start = cache.length
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            keys, values = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
            y = cached_attention(q, keys, values, start)
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
    def __init__(self, cfg: BaselineConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, h, cos, sin, doc_ids, cache=None, layer=0) -> Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, doc_ids, cache, layer)
        return h + self.ffn(self.ffn_norm(h))


class TransformerPP(nn.Module):
    def __init__(self, cfg: BaselineConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = LMHead(cfg.d_model, cfg.vocab_size, tied=self.embed if cfg.tie_embeddings else None,
                           init_std=cfg.init_std)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden(self, tokens: Tensor, positions: Tensor, doc_ids: Tensor | None = None,
               cache: KVCache | None = None) -> Tensor:
        """Final-normed hidden states [B, T, d] of tokens [B, T] at positions [B, T]."""
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, doc_ids, cache, i)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.norm(h)

    def forward(self, batch) -> tuple[Tensor, dict]:
        """Mean next-token loss over the batch's loss_mask, and diagnostics (none for the baseline)."""
        doc_ids = batch.doc_ids if self.cfg.document_mask else None
        h = self.hidden(batch.tokens, batch.positions, doc_ids)
        return self.head.loss(h, batch.labels, batch.loss_mask), {}


def flops_per_token(cfg: BaselineConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (matmul parameters, output head included) + 12 * L * d * T
    (QK^T and AV at full length T, forward and backward, 2 FLOPs per multiply-add)."""
    d, L = cfg.d_model, cfg.n_layers
    matmul_params = L * (4 * d * d + 3 * d * cfg.ffn) + cfg.vocab_size * d
    return 6.0 * matmul_params + 12.0 * L * d * seq_len


def new_state(model: TransformerPP, batch_size: int) -> KVCache:
    p = model.embed.weight
    return KVCache(model.cfg, batch_size, p.device, p.dtype)


def step(model: TransformerPP, tokens: Tensor, state: KVCache) -> tuple[Tensor, KVCache]:
    """Feed tokens [B, n] after the cached ones; logits [B, n, vocab] (float32)."""
    n = tokens.shape[1]
    if state.length + n > model.cfg.max_seq_len:
        raise ValueError(f"generation would exceed model.max_seq_len {model.cfg.max_seq_len}")
    positions = torch.arange(state.length, state.length + n, device=tokens.device).expand(tokens.shape[0], n)
    return model.head.logits(model.hidden(tokens, positions, None, state)), state


def tp_dims(cfg: BaselineConfig) -> dict[str, int]:
    return {"model.n_heads": cfg.n_heads, "model.ffn_hidden": cfg.ffn, "model.vocab_size": cfg.vocab_size}


SPEC = register(ArchSpec(
    name="baseline",
    config_cls=BaselineConfig,
    build=TransformerPP,
    flops_per_token=flops_per_token,
    new_state=new_state,
    step=step,
    tp_dims=tp_dims,
    recompute_units=lambda model: list(model.blocks),
))
