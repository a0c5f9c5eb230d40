"""The shared blocks every architecture composes: attention, MLPs, norms, the pre-norm block, RoPE.

No architecture owns these (torchtitan keeps shared modules apart from the models that register); an
architecture picks its options once, as a `BlockOptions` value its config builds, and composes:

    BlockOptions   width, heads, GQA, FFN width, norm (rms | layer), MLP (swiglu | gelu), biases,
                   dropout, QK-norm (none | head | full), positions (rope | alibi | none), init
    Attend         what a block needs to attend, as one value: the mask (kernels.attention.masks),
                   the RoPE tables at the queries' positions, the decode cache and its slot; a new mask
                   or position scheme changes no block signature
    Attention      self-attention, or cross-attention to given keys and values (`kv=`)
    SwiGLU, GeluMLP, mlp(options, ...), make_norm(kind, dim, eps)
    Block          h += drop(Attn(norm(h))); h += drop(MLP(norm(h)))
    Rope, Alibi    the RoPE tables and ALiBi slopes (float64 in a float64 model), rope_tables, apply_rope, alibi_slopes

Parameter names are those the baseline and CRT always had (attn.q, attn.kv, attn.proj, ffn.gate/up/
down or ffn.fc1/fc2, attn_norm, ffn_norm), and layers are created in the same order, so a model
built from one seed is the same model it was before these were shared and old checkpoints load.
Linears and norms come from parallel.layers, so this file is the same at any tensor-parallel size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kernels.attention import Mask, attention
from parallel.layers import ColumnLinear, LayerNorm, ReplicatedLinear, RMSNorm, RowLinear, local_heads, refuse_under_tp

NORMS = ("rms", "layer", "layer_nobias")
INITS = ("normal", "mitchell", "plain")
MLPS = ("swiglu", "gelu")
QK_NORMS = ("none", "head", "full")
POSITIONS = ("rope", "alibi", "none")


@dataclass(frozen=True)
class BlockOptions:
    d_model: int
    n_heads: int
    kv_heads: int  # key/value heads (grouped-query attention: fewer than n_heads, dividing it)
    ffn: int  # hidden width of the MLP
    norm: str = "rms"  # rms (RMSNorm) | layer (LayerNorm with bias) | layer_nobias (gain only, OLMo's)
    norm_eps: float = 1e-6
    mlp: str = "swiglu"  # swiglu (gate, up, down) | gelu (fc1, fc2)
    bias: bool = False  # biases on every linear of the block
    dropout: float = 0.0  # attention probabilities and each sublayer's output, in training
    qk_norm: str = "none"  # none | head (a norm of head_dim on each head) | full (over all heads, before the split)
    positions: str = "rope"  # rope | alibi | none (what the Attend value's tables are used for)
    alibi_max: float = 8.0  # ALiBi slopes 2^(-alibi_max * h / H), h = 1..H
    init_std: float = 0.02
    # effective depth (block applications per token): output projections start at init_std / sqrt(2 depth)
    depth: int = 1
    scale_ffn_out: bool = False  # the MLP's output layer scaled like the attention's (GPT-2) or not (Llama/SPS)
    # normal: N(0, init_std) and the output layers as above; mitchell (OLMo's, the RT paper's): every linear
    # N(0, 1 / fan_in) truncated at 3 sigma, the two output layers 1 / (2 fan_in (layer + 1)) in variance;
    # plain: every linear N(0, init_std), output layers unscaled (CART's)
    init: str = "normal"
    # keys and values through a low-rank bottleneck (MLA without its decoupled RoPE key): x -> kv_down
    # (kv_rank) -> k_up | v_up; 0: one k | v projection
    kv_rank: int = 0
    layer: int = 0  # this block's index (0-based), for the mitchell init
    residual_scale: float = 1.0  # each sublayer's output is multiplied by it before the residual add

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def out_std(self) -> float:
        return self.init_std / math.sqrt(2 * self.depth)

    @property
    def trunc(self) -> float:
        return 3.0 if self.init == "mitchell" else 0.0

    def in_std(self, fan_in: int) -> float:
        """The init std of a linear reading fan_in features."""
        return 1.0 / math.sqrt(fan_in) if self.init == "mitchell" else self.init_std

    def output_std(self, fan_in: int, scaled: bool = True) -> float:
        """The init std of an output layer (attention projection, MLP down) reading fan_in features;
        `scaled` False: the normal init's unscaled MLP output (init_std)."""
        if self.init == "mitchell":
            return 1.0 / math.sqrt(2 * fan_in * (self.layer + 1))
        return self.out_std if scaled and self.init == "normal" else self.init_std

    def validate(self) -> None:
        for name, value, allowed in (("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS),
                                     ("qk_norm", self.qk_norm, QK_NORMS), ("positions", self.positions, POSITIONS),
                                     ("init", self.init, INITS)):
            if value not in allowed:
                raise ValueError(f"block option {name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"model head dimension d_model / n_heads = {self.head_dim} must be even for RoPE")


class Attend:
    """What a block needs to attend, as one value (built once per forward by the model):
    `mask` (kernels.attention.masks), `rope` = (cos, sin) [B, 1, T, Dh/2] at the queries' positions
    (None without RoPE), `cache` (a decode or BPTT cache with extend(slot, k, v); None in training) and
    the cache `slot` of the block application being run (`at(slot)`)."""

    __slots__ = ("mask", "rope", "cache", "slot")

    def __init__(self, mask: Mask, rope: tuple[Tensor, Tensor] | None = None, cache: Any = None, slot: int = 0):
        self.mask, self.rope, self.cache, self.slot = mask, rope, cache, slot

    def at(self, slot: int) -> "Attend":
        return Attend(self.mask, self.rope, self.cache, slot)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rms" else LayerNorm(dim, eps, bias=kind == "layer")


def dropout(p: float) -> nn.Module:
    # nn.Dropout(0) returns its input on CPU without touching the generator; Identity says so plainly
    return nn.Dropout(p) if p else nn.Identity()


# -- positions ----------------------------------------------------------------------------------------
def rope_tables(head_dim: int, max_len: int, theta: float, dtype=torch.float32, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim / 2] for rotating the pairs (x[2i], x[2i+1]) (Llama's layout),
    computed in float64 and rounded once to `dtype`."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device=device), freqs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, Dh]; cos, sin [B, 1, T, Dh/2] already gathered at the tokens' positions."""
    pairs = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Rope(nn.Module):
    """The RoPE tables as (non-persistent) buffers. When the model moves to another dtype they are
    computed again from float64 angles at that dtype instead of being cast, so a float64 model has
    float64 tables, not float32 values cast up (and a float32 model the same tables as always)."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        dtype = torch.get_default_dtype()
        cos, sin = rope_tables(head_dim, max_len, theta, dtype if dtype.is_floating_point else torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype.is_floating_point:
            self.cos, self.sin = rope_tables(self.head_dim, self.max_len, self.theta, self.cos.dtype, self.cos.device)
        return self

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, Dh/2] at positions [B, T]."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> Tensor:
    """ALiBi's per-head slopes 2^(-max_bias * h / H), h = 1..H (Press et al.; OLMo's alibi_bias_max)."""
    return 2.0 ** (-max_bias * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)


class Alibi(nn.Module):
    """This rank's ALiBi slopes as a (non-persistent) buffer `slopes`, computed again from float64 when
    the model moves to another dtype, as Rope's tables are: a float64 model gets the exact 2^(-8h/H)
    (float32 values cast up are off by up to 3e-8 where H is not a power of two), a float32 model the
    same slopes as always."""

    def __init__(self, n_heads: int, max_bias: float):
        super().__init__()
        self.n_heads, self.max_bias, self.heads = n_heads, max_bias, local_heads(n_heads)
        self.register_buffer("slopes", self._values(torch.float32, None), persistent=False)

    def _values(self, dtype, device) -> Tensor:
        return alibi_slopes(self.n_heads, self.max_bias)[self.heads].to(device=device, dtype=dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.slopes.dtype.is_floating_point:
            self.slopes = self._values(self.slopes.dtype, self.slopes.device)
        return self


# -- attention and MLPs -------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention through kernels.attention: q, then k | v (fewer heads under GQA), an output
    projection; optional QK-norm, RoPE or ALiBi, biases and probability dropout. `cross=True` builds
    no key/value projection: forward then takes `kv` = (k, v) [B, H_kv, Tk, Dh] computed elsewhere
    (CART's anchor), and RoPE, if any, rotates the queries only."""

    def __init__(self, o: BlockOptions, cross: bool = False):
        super().__init__()
        o.validate()
        self.head_dim, self.dropout, self.positions, self.qk_norm = o.head_dim, o.dropout, o.positions, o.qk_norm
        self.kv_rank = o.kv_rank
        d, H, H_kv, Dh = o.d_model, o.n_heads, o.kv_heads, o.head_dim
        # q, then k | v. Created in this order, they draw from the generator what the fused q | k | v
        # projection they replaced did when d_model^2 is a multiple of 16 (normal_ fills blocks of 16).
        self.q = ColumnLinear(d, H * Dh, o.bias, init_std=o.in_std(d), trunc=o.trunc)
        if not cross and o.kv_rank:  # every head reads the bottleneck: whole on every TP rank, heads split after it
            self.kv_down = ReplicatedLinear(d, o.kv_rank, o.bias, init_std=o.in_std(d), trunc=o.trunc)
            self.k_up = ColumnLinear(o.kv_rank, H_kv * Dh, o.bias, init_std=o.in_std(o.kv_rank), trunc=o.trunc)
            self.v_up = ColumnLinear(o.kv_rank, H_kv * Dh, o.bias, init_std=o.in_std(o.kv_rank), trunc=o.trunc)
        elif not cross:  # k | v stacked: TP gives every rank whole heads of both
            self.kv = ColumnLinear(d, 2 * H_kv * Dh, o.bias, init_std=o.in_std(d), stacked=2, trunc=o.trunc)
        self.proj = RowLinear(H * Dh, d, o.bias, init_std=o.output_std(H * Dh), trunc=o.trunc)
        if o.qk_norm != "none":
            # a weight shared by heads that TP splits over ranks (head) or statistics over every head (full)
            refuse_under_tp(f"QK-norm ({o.qk_norm})", "its norm spans heads that tensor parallelism splits")
            q_dim, k_dim = (Dh, Dh) if o.qk_norm == "head" else (H * Dh, H_kv * Dh)
            self.q_norm, self.k_norm = make_norm(o.norm, q_dim, o.norm_eps), make_norm(o.norm, k_dim, o.norm_eps)
        if o.positions == "alibi":
            self.alibi = Alibi(H, o.alibi_max)

    def _heads(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        """[B, T, n * Dh] -> [B, n, T, Dh], QK-normed when `norm` is given."""
        if norm is not None and self.qk_norm == "full":
            x = norm(x)
        x = x.unflatten(-1, (-1, self.head_dim))
        if norm is not None and self.qk_norm == "head":
            x = norm(x)
        return x.transpose(1, 2)

    def queries(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kept: list | None = None) -> Tensor:
        """[B, T, d] -> q [B, H, T, Dh]: projected, QK-normed, rotated when the block uses RoPE. kept: a list
        the projection before its QK-norm is appended to (a custom backward's, RT's; QK-normed blocks only)."""
        if self.qk_norm == "none":
            q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        else:
            q = self.q(x)
            if kept is not None:
                kept.append(q)
            q = self._heads(q, self.q_norm)
        return apply_rope(q, *rope) if self.positions == "rope" else q

    def keys(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None,
             kept: list | None = None) -> tuple[Tensor, Tensor]:
        """[B, T, d] -> k, v [B, H_kv, T, Dh]: projected, k QK-normed and rotated as the queries are; kept as
        queries' (k's projection, a view of k | v's)."""
        if self.kv_rank:
            c = self.kv_down(x)
            k, v = self._heads(self.k_up(c), getattr(self, "k_norm", None)), self._heads(self.v_up(c), None)
        elif self.qk_norm == "none":
            k, v = self.kv(x).unflatten(-1, (2, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        else:
            k, v = self.kv(x).unflatten(-1, (2, -1)).unbind(-2)
            if kept is not None:
                kept.append(k)
            k, v = self._heads(k, self.k_norm), self._heads(v, None)
        return (apply_rope(k, *rope) if self.positions == "rope" else k), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, a: Attend, offset: int = 0) -> Tensor:
        """The attention of q over k, v under a.mask, through the output projection: [B, Tq, d]."""
        y = attention(q, k, v, a.mask, offset, dropout_p=self.dropout if self.training else 0.0,
                      alibi_slopes=self.alibi.slopes if self.positions == "alibi" else None)
        return self.proj(y.transpose(1, 2).flatten(2))

    def forward(self, x: Tensor, a: Attend, kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        # Shapes come from the projection's output: under tensor/sequence parallelism it holds this
        # rank's heads and the whole sequence while x may hold a slice of the sequence.
        q = self.queries(x, a.rope)
        k, v = self.keys(x, a.rope) if kv is None else kv
        offset = 0
        if a.cache is not None and kv is None:  # decode: everything cached plus, causally, the new tokens
            k, v, offset = a.cache.extend(a.slot, k, v)  # a windowed cache may hold only the last keys
        return self.attend(q, k, v, a, offset)


class SwiGLU(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, init_std: float, out_std: float, bias: bool = False,
                 trunc: float = 0.0):
        super().__init__()
        self.gate = ColumnLinear(d_in, hidden, bias, init_std=init_std, trunc=trunc)
        self.up = ColumnLinear(d_in, hidden, bias, init_std=init_std, trunc=trunc)
        self.down = RowLinear(hidden, d_out, bias, init_std=out_std, trunc=trunc)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, init_std: float, out_std: float, bias: bool = False,
                 trunc: float = 0.0):
        super().__init__()
        self.fc1 = ColumnLinear(d_in, hidden, bias, init_std=init_std, trunc=trunc)
        self.fc2 = RowLinear(hidden, d_out, bias, init_std=out_std, trunc=trunc)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def mlp(o: BlockOptions, d_in: int | None = None, d_out: int | None = None, out_std: float | None = None) -> nn.Module:
    """The block family's MLP (o.mlp) from d_in (default d_model) through o.ffn to d_out (default
    d_model); its output layer starts at out_std (default: o.out_std if o.scale_ffn_out else init_std,
    or the mitchell init's; 0 gives a zero output layer)."""
    if out_std is None:
        out_std = o.output_std(o.ffn, scaled=o.scale_ffn_out)
    cls = SwiGLU if o.mlp == "swiglu" else GeluMLP
    d_in = d_in or o.d_model
    return cls(d_in, o.ffn, d_out or o.d_model, o.in_std(d_in), out_std, o.bias, o.trunc)


class Block(nn.Module):
    """The pre-norm block: h += drop(Attn(norm(h))); h += drop(MLP(norm(h)))."""

    def __init__(self, o: BlockOptions):
        super().__init__()
        self.attn_norm = make_norm(o.norm, o.d_model, o.norm_eps)
        self.attn = Attention(o)
        self.ffn_norm = make_norm(o.norm, o.d_model, o.norm_eps)
        self.ffn = mlp(o)
        self.drop = dropout(o.dropout)
        self.scale = o.residual_scale

    def forward(self, h: Tensor, a: Attend) -> Tensor:
        if self.scale != 1.0:  # (a multiplication by 1 would be exact, but is work)
            h = h + self.scale * self.drop(self.attn(self.attn_norm(h), a))
            return h + self.scale * self.drop(self.ffn(self.ffn_norm(h)))
        h = h + self.drop(self.attn(self.attn_norm(h), a))
        return h + self.drop(self.ffn(self.ffn_norm(h)))


def upgrade_attention_state(state: dict, cfg) -> dict:
    """An ArchSpec.upgrade_state for any model built from these blocks: weights saved before grouped-query
    attention had a fused attn.qkv (rows q | k | v), split here into attn.q and attn.kv (exact: the same
    rows). cfg needs d_model."""
    for name in [n for n in state if n.endswith(".attn.qkv.weight") or n.endswith(".attn.qkv.bias")]:
        prefix, kind = name.rsplit(".attn.qkv.", 1)
        fused = state.pop(name)
        state[f"{prefix}.attn.q.{kind}"], state[f"{prefix}.attn.kv.{kind}"] = fused[:cfg.d_model], fused[cfg.d_model:]
    return state
