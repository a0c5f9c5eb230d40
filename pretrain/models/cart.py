"""CART, the Context-Anchored Recurrent Transformer (spec-004; Capps 2026).

Three depth zones over the shared blocks:

    prelude   P pre-norm layers: causal self-attention with keys and values through a d/4 bottleneck
              (MLA without its decoupled key) and RoPE, then SwiGLU; their output is the anchor e
    anchor    K, V = kv_proj(e), computed once (no RoPE)
    core      ONE shared block applied R times to a state that starts at e: a softmax blend of the last
              three states (HyperConnection), plus a loop-index embedding (LIE), causal cross-attention
              of the state's queries to the frozen anchor K/V (no RoPE), SwiGLU, and the LTI gate
              h = sigmoid(a) * h_in + out
    coda      one layer like the prelude's, then the final RMSNorm and the tied head

`model.core_update`: `reference` (the released code: the block returns h_in + deltas, so
h = (1 + sigmoid(a)) h_in + deltas, expansive; spec §2.5) or `paper` (h = sigmoid(a) h_in + deltas,
the paper's equation). The ablations of spec §2.12 are fields: unfreeze_kv (X), n_loops=1 (Y),
unshare_core (Z), self_attn_core (W, with unshare_core), disable_hyper, disable_lti, disable_lie.
Every linear starts N(0, 0.02), output layers unscaled (init `plain`). The loop-index sinusoid is
computed for any r (interleaved sin/cos over lie_dim, spec §8.3), so inference may run any R.

Decode: the P prelude layers' caches, one anchor cache (R with unfreeze_kv or a self-attention core)
and the coda's; each position's R core passes run against the anchor keys of positions <= t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kernels.attention import causal
from parallel.layers import ColumnLinear
from pretrain.models.base import EVAL
from pretrain.models.blocks import Attend, Attention, Block, BlockOptions, make_norm, mlp
from pretrain.models.decoder import Decoder, DecoderConfig, KVCache
from pretrain.models.registry import ArchSpec, DecodeRelation, Support, register

HEAD_DIM = 64


@dataclass
class CARTConfig(DecoderConfig):
    arch: str = "cart"
    vocab_size: int = 32000
    d_model: int = 1024
    n_heads: int = 16  # d_model / 64 in the paper (64-wide heads)
    ffn_hidden: int = 0  # 0: ceil(int(8 d / 3) / 256) * 256
    kv_rank: int = 0  # the key/value bottleneck; 0: d_model / 4
    n_layers: int = 6  # P, the prelude's layers (the coda is one more)
    n_loops: int = 6  # R, core passes (any R at inference)
    lie_dim: int = 32
    max_seq_len: int = 1024
    core_update: str = "reference"  # reference (the code's) | paper (the paper's equation)
    unfreeze_kv: bool = False  # X: K, V = kv_proj(h_in) in every pass
    unshare_core: bool = False  # Z: R distinct core blocks
    self_attn_core: bool = False  # W: the core is a self-attention layer (needs unshare_core in the paper)
    disable_hyper: bool = False
    disable_lti: bool = False
    disable_lie: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or math.ceil(int(8 * self.d_model / 3) / 256) * 256

    @property
    def rank(self) -> int:
        return self.kv_rank or self.d_model // 4

    def block_options(self, depth: int) -> BlockOptions:
        return replace(super().block_options(depth), init="plain", kv_rank=self.rank)

    def validate(self) -> None:
        super().validate()
        if self.core_update not in ("reference", "paper"):
            raise ValueError(f"model.core_update must be reference or paper, got {self.core_update!r}")
        if self.n_loops < 1:
            raise ValueError(f"model.n_loops must be >= 1 (R core passes), got {self.n_loops}")
        if self.lie_dim < 2 or self.lie_dim % 2:
            raise ValueError(f"model.lie_dim must be an even number >= 2, got {self.lie_dim}")
        if self.n_kv_heads and self.n_kv_heads != self.n_heads:
            raise ValueError("model.n_kv_heads must be 0: CART's anchor keys have as many heads as its queries")
        if self.window:
            raise ValueError("model.window is not supported by CART (the core reads every earlier anchor position)")


def loop_embedding(r: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    """The loop index r as a sinusoid [dim]: sin at even, cos at odd dimensions, base 10000 over dim."""
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    angle = r / 10000.0 ** (i / dim)
    return torch.stack([angle.sin(), angle.cos()], -1).flatten().to(dtype)


class AnchorKV(nn.Module):
    """kv_proj: the anchor's keys and values through the bottleneck, [B, H, T, 64] each, no RoPE."""

    def __init__(self, o: BlockOptions):
        super().__init__()
        self.kv_down = ColumnLinear(o.d_model, o.kv_rank, init_std=o.init_std)
        self.k_up = ColumnLinear(o.kv_rank, o.d_model, init_std=o.init_std)
        self.v_up = ColumnLinear(o.kv_rank, o.d_model, init_std=o.init_std)
        self.head_dim = o.head_dim

    def forward(self, e: Tensor) -> tuple[Tensor, Tensor]:
        c = self.kv_down(e)
        return tuple(t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (self.k_up(c), self.v_up(c)))


class CoreBlock(nn.Module):
    """The shared core block: causal cross-attention of the state to the anchor, then SwiGLU, each
    pre-normed; returns the deltas (the caller adds h_in as its core_update says)."""

    def __init__(self, o: BlockOptions):
        super().__init__()
        self.norm1 = make_norm(o.norm, o.d_model, o.norm_eps)
        self.attn = Attention(replace(o, positions="none"), cross=True)
        self.norm2 = make_norm(o.norm, o.d_model, o.norm_eps)
        self.ffn = mlp(o)

    def forward(self, h: Tensor, k: Tensor, v: Tensor, a: Attend, offset: int) -> Tensor:
        d_attn = self.attn.attend(self.attn.queries(self.norm1(h)), k, v, a, offset)
        z = h + d_attn
        return d_attn + self.ffn(self.norm2(z))


class CART(Decoder):
    def __init__(self, cfg: CARTConfig):
        super().__init__(cfg)
        o = cfg.block_options(1)
        self.prelude = nn.ModuleList(Block(o) for _ in range(cfg.n_layers))
        if not cfg.self_attn_core:
            self.kv_proj = AnchorKV(o)
        core = (lambda: Block(o)) if cfg.self_attn_core else (lambda: CoreBlock(o))
        self.core = nn.ModuleList(core() for _ in range(cfg.n_loops)) if cfg.unshare_core else core()
        self.hyper = nn.Parameter(torch.tensor([1.0, 0.0, 0.0]))  # raw; softmax at use (spec §7.4)
        self.a = nn.Parameter(torch.full((cfg.d_model,), math.log(9.0)))  # sigmoid(a) = 0.9
        self.lie = ColumnLinear(cfg.lie_dim, cfg.d_model, init_std=cfg.init_std)
        self.coda = Block(o)

    def applications(self) -> list[nn.Module]:
        """The self-attention layers with a decode cache slot each (the prelude's and the coda's)."""
        return [*self.prelude, self.coda]

    def core_at(self, r: int) -> nn.Module:
        return self.core[r] if self.cfg.unshare_core else self.core

    def spectral_radius(self) -> Tensor:
        """rho as the paper logs it: the largest channel of sigmoid(a)."""
        return torch.sigmoid(self.a).max()

    def loops(self, e: Tensor, a: Attend, cache: KVCache | None, offset: int, n_loops: int | None = None,
              states: list | None = None) -> Tensor:
        """The R core passes over states e [B, n, d] at positions offset.. (n_loops: another R at inference;
        `states` collects each pass's h, for diagnostics and tests)."""
        cfg = self.cfg
        R = n_loops or cfg.n_loops
        slot0 = cfg.n_layers + 1  # the anchor's cache slots come after the prelude's and the coda's
        kv_once = not (cfg.unfreeze_kv or cfg.self_attn_core)
        k = v = None
        if kv_once:
            k, v = self.kv_proj(e)
            if cache is not None:
                k, v, _ = cache.extend(slot0, k, v)
        w = torch.softmax(self.hyper, 0)
        buf = [e, e, e]
        gate = torch.sigmoid(self.a)
        for r in range(R):
            h_in = buf[0] if cfg.disable_hyper else w[0] * buf[0] + w[1] * buf[1] + w[2] * buf[2]
            if not cfg.disable_lie:
                h_in = h_in + self.lie(loop_embedding(r, cfg.lie_dim, e.device, e.dtype))
            block = self.core_at(r)
            if cfg.self_attn_core:
                delta = block(h_in, a.at(slot0 + r)) - h_in
            else:
                if cfg.unfreeze_kv:
                    k, v = self.kv_proj(h_in)
                    if cache is not None:
                        k, v, _ = cache.extend(slot0 + r, k, v)
                delta = block(h_in, k, v, a, offset)
            out = delta + (h_in if cfg.core_update == "reference" else 0.0)
            h = h_in + out if cfg.disable_lti else gate * h_in + out
            buf = [h, buf[0], buf[1]]
            if states is not None:
                states.append(h)
        return buf[0]

    def body(self, tokens: Tensor, positions: Tensor, mask, cache=None, n_loops: int | None = None) -> Tensor:
        a = self.attend(positions, mask, cache)
        x = self.embed(tokens)
        for i, layer in enumerate(self.prelude):
            x = layer(x, a.at(i))
        offset = 0 if cache is None else cache.length
        h = self.loops(x, a, cache, offset, n_loops)
        return self.coda(h, a.at(self.cfg.n_layers))

    def new_state(self, batch_size: int) -> KVCache:
        cfg, p = self.cfg, self.embed.weight
        anchors = cfg.n_loops if (cfg.unfreeze_kv or cfg.self_attn_core) else 1
        o = cfg.block_options(1)
        return KVCache(cfg.n_layers + 1 + anchors, batch_size, o.kv_heads, cfg.max_seq_len, o.head_dim, p.device,
                       p.dtype)


def parameter_counts(cfg: CARTConfig) -> dict[str, int]:
    """Spec §2.10's accounting: stored, the core's, the anchor projection's, effective at cfg.n_loops."""
    d, f, r = cfg.d_model, cfg.ffn, cfg.rank
    layer = 2 * d * d + 3 * d * r + 3 * d * f + 2 * d
    core = (2 * d * d + 3 * d * f + 2 * d) if not cfg.self_attn_core else layer
    kv = 0 if cfg.self_attn_core else 3 * d * r
    misc = 3 + d + cfg.lie_dim * d + d
    n_core = cfg.n_loops if cfg.unshare_core else 1
    stored = cfg.vocab_size * d + cfg.n_layers * layer + kv + n_core * core + layer + misc
    effective = stored if cfg.unshare_core else stored + (cfg.n_loops - 1) * core
    if cfg.unfreeze_kv:
        effective += (cfg.n_loops - 1) * kv
    return {"stored": stored, "core": core, "kv": kv, "effective": effective}


def flops_per_token(cfg: CARTConfig, seq_len: int, ctx=None) -> float:
    """Training FLOPs per token (FLOPS_FORMULA)."""
    d, R = cfg.d_model, cfg.n_loops
    n = parameter_counts(cfg)
    layer = 2 * d * d + 3 * d * cfg.rank + 3 * d * cfg.ffn
    core = n["core"] - 2 * d
    kv = n["kv"] * (R if cfg.unfreeze_kv else 1)
    matmul = (cfg.n_layers + 1) * layer + R * core + kv + cfg.vocab_size * d + cfg.lie_dim * d * R
    return 6.0 * matmul + 12.0 * (cfg.n_layers + 1 + R) * d * seq_len


FLOPS_FORMULA = ("6 * ((P + 1) * (2.75 d^2 + 3 d f) + R * (2 d^2 + 3 d f) + 0.75 d^2 + V d) + 12 * (P + 1 + R) * d * T: "
                 "forward x 3, the P prelude layers and the coda (low-rank keys and values), R core passes (queries and "
                 "output only), the anchor's keys and values once (R times with unfreeze_kv), the tied head, attention at "
                 "length T in every layer and pass (d width, f SwiGLU width, V vocabulary)")


def effective_params(cfg: CARTConfig) -> int:
    return parameter_counts(cfg)["effective"]


def _recompute_units(model: CART) -> list[nn.Module]:
    """Each prelude layer, each core pass (the shared block is checkpointed at every call) and the coda."""
    core = list(model.core) if model.cfg.unshare_core else [model.core]
    return [*model.prelude, *core, model.coda]


SPEC = register(ArchSpec(
    name="cart",
    config_cls=CARTConfig,
    build=CART,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    formula_params=effective_params,
    formula_params_note="effective (the shared core counted once per pass, spec §2.10)",
    decode=DecodeRelation("exact"),
    supports=Support(tp=False, sp=False, reasons={
        "tp": "the key/value bottleneck (kv_down, d -> d/4) is shared by every head, so tensor parallelism would "
              "have to replicate it and gather its latent (spec §5); not written",
        "sp": "sequence parallelism needs tensor parallelism, which CART refuses"}),
    tp_dims=None,
    recompute_units=_recompute_units,
))
