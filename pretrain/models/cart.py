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
from torch.utils.checkpoint import checkpoint

from kernels.lm_loss import memory_columns
from parallel.layers import ColumnLinear, ReplicatedLinear, replicated_parameter
from parallel.stages import balanced_split
from parallel.recompute import Recompute, apply_recompute
from pretrain.models.blocks import Attend, Attention, Block, BlockOptions, make_norm, mlp
from pretrain.models import decoder
from pretrain.models.base import StepContext
from pretrain.models.decoder import Decoder, DecoderConfig, KVCache
from pretrain.hf_remote.adapter import RemoteAdapter
from pretrain.models.registry import ArchSpec, DecodeRelation, Support, register
from pretrain.models.units import Run, Unit

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
    dense: bool = False  # the paper's Dense baseline: n_layers full-rank self-attention layers, no loop machinery
    # Random depth per training step (Huginn's recipe, beyond the paper): fixed (always n_loops) | uniform
    # (R ~ U{loops_min..n_loops}) | huginn (R = 1 + Poisson(lambda), lambda ~ LogNormal(log(n_loops - 1) - 1/8,
    # 1/2), at most loops_max); drawn from the step's generator, so every rank and a resume agree.
    # Evaluation and inference run n_loops.
    loops_sampling: str = "fixed"
    loops_min: int = 1
    loops_max: int = 32
    backprop_loops: int = 0  # k > 0: the first R - k passes run without gradient (truncated backprop)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or math.ceil(int(8 * self.d_model / 3) / 256) * 256

    @property
    def rank(self) -> int:
        return self.kv_rank or self.d_model // 4

    def block_options(self, depth: int) -> BlockOptions:
        return replace(super().block_options(depth), init="plain", kv_rank=self.rank)

    def validate(self) -> None:
        if self.n_loops < 1:
            raise ValueError(f"model.n_loops must be >= 1 (R core passes), got {self.n_loops}")
        if self.n_layers < 1:
            raise ValueError(f"model.n_layers must be >= 1 (P prelude layers, or the Dense baseline's layers), got "
                             f"{self.n_layers}")
        if not self.kv_rank and self.d_model % 4:
            raise ValueError(f"model.d_model {self.d_model} is not divisible by 4 for the d/4 key/value latent; set "
                             "model.kv_rank")
        super().validate()
        if self.core_update not in ("reference", "paper"):
            raise ValueError(f"model.core_update must be reference or paper, got {self.core_update!r}")
        if self.kv_rank < 0:
            raise ValueError(f"model.kv_rank must be >= 0 (0: d_model / 4), got {self.kv_rank}")
        if self.self_attn_core and not self.unshare_core:
            raise ValueError("model.self_attn_core=true needs model.unshare_core=true (ablation W replaces the shared "
                             "cross-attention core by unshared self-attention layers)")
        if self.loops_sampling not in ("fixed", "uniform", "huginn"):
            raise ValueError(f"model.loops_sampling must be fixed, uniform or huginn, got {self.loops_sampling!r}")
        if self.loops_sampling == "uniform" and not 1 <= self.loops_min <= self.n_loops:
            raise ValueError(f"model.loops_min {self.loops_min} must lie in 1..model.n_loops ({self.n_loops}): the "
                             "draw needs mass at R >= 1")
        if self.loops_sampling == "huginn" and (self.loops_max < 1 or self.n_loops < 2):
            raise ValueError(f"model.loops_sampling=huginn needs model.n_loops >= 2 (its mean) and model.loops_max >= 1,"
                             f" got {self.n_loops} and {self.loops_max}")
        fewest = {"fixed": self.n_loops, "uniform": self.loops_min, "huginn": 1}[self.loops_sampling]
        if not 0 <= self.backprop_loops <= fewest:
            raise ValueError(f"model.backprop_loops={self.backprop_loops} must lie in 0..{fewest}, the fewest passes a "
                             "step can draw (0: backpropagate through every pass)")
        if self.dense and (self.unfreeze_kv or self.unshare_core or self.self_attn_core or self.loops_sampling != "fixed"):
            raise ValueError("model.dense=true is the Dense baseline: it has no core, so the core's fields "
                             "(unfreeze_kv, unshare_core, self_attn_core, loops_sampling) must stay off")
        if self.lie_dim < 2 or self.lie_dim % 2:
            raise ValueError(f"model.lie_dim must be an even number >= 2, got {self.lie_dim}")
        if self.n_kv_heads and self.n_kv_heads != self.n_heads:
            raise ValueError("model.n_kv_heads must be 0: CART's anchor keys have as many heads as its queries")
        if self.window:
            raise ValueError("model.window is not supported by CART (the core reads every earlier anchor position)")

    def draw_loops(self, ctx) -> int:
        """R for the step of StepContext ctx (n_loops in evaluation or without ctx)."""
        if ctx is None or not ctx.training or self.loops_sampling == "fixed":
            return self.n_loops
        g, cpu = ctx.generator(), "cpu"  # drawn on the CPU under any default device (a meta dry run draws too)
        if self.loops_sampling == "uniform":
            return int(torch.randint(self.loops_min, self.n_loops + 1, (1,), generator=g, device=cpu))
        lam = torch.exp(torch.randn(1, generator=g, dtype=torch.float64, device=cpu) * 0.5 + math.log(self.n_loops - 1) - 0.125)
        return min(self.loops_max, 1 + int(torch.poisson(lam, generator=g)))

    def expected_loops(self) -> float:
        """E[R] over the draws (a fixed sample of huginn's), for FLOPs without a step."""
        if self.loops_sampling == "fixed":
            return float(self.n_loops)
        if self.loops_sampling == "uniform":
            return (self.loops_min + self.n_loops) / 2
        return sum(self.draw_loops(StepContext(i, i)) for i in range(2000)) / 2000


def loop_embedding(r: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    """The loop index r as a sinusoid [dim]: sin at even, cos at odd dimensions, base 10000 over dim."""
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    angle = r / 10000.0 ** (i / dim)
    return torch.stack([angle.sin(), angle.cos()], -1).flatten().to(dtype)


class AnchorKV(nn.Module):
    """kv_proj: the anchor's keys and values through the bottleneck, [B, H, T, 64] each, no RoPE."""

    def __init__(self, o: BlockOptions):
        super().__init__()
        self.kv_down = ReplicatedLinear(o.d_model, o.kv_rank, init_std=o.init_std)
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
        if cfg.dense:  # full-rank self-attention layers and nothing else (spec §2.11)
            self.prelude = nn.ModuleList(Block(replace(o, kv_rank=0)) for _ in range(cfg.n_layers))
            return
        self.prelude = nn.ModuleList(Block(o) for _ in range(cfg.n_layers))
        if not cfg.self_attn_core:
            self.kv_proj = AnchorKV(o)
        core = (lambda: Block(o)) if cfg.self_attn_core else (lambda: CoreBlock(o))
        self.core = nn.ModuleList(core() for _ in range(cfg.n_loops)) if cfg.unshare_core else core()
        self.hyper = replicated_parameter(torch.tensor([1.0, 0.0, 0.0]))  # raw; softmax at use (spec §7.4)
        self.a = replicated_parameter(torch.full((cfg.d_model,), math.log(9.0)))  # sigmoid(a) = 0.9
        self.lie = ReplicatedLinear(cfg.lie_dim, cfg.d_model, init_std=cfg.init_std)
        self.coda = Block(o)
        self.recompute_passes = False  # policy "pass": each core pass checkpointed whole (_recompute_passes)

    def applications(self) -> list[nn.Module]:
        """The self-attention layers with a decode cache slot each (the prelude's and the coda's)."""
        return list(self.prelude) if self.cfg.dense else [*self.prelude, self.coda]

    def core_at(self, r: int) -> nn.Module:
        return self.core[r] if self.cfg.unshare_core else self.core

    def spectral_radius(self) -> Tensor:
        """rho as the paper logs it: the largest channel of sigmoid(a)."""
        return torch.sigmoid(self.a).max()

    def diagnostics(self, R: int) -> dict[str, Tensor]:
        """rho (the paper's max of sigmoid(a)), its min and mean, the blend weights, and this step's R."""
        gate = torch.sigmoid(self.a.detach())
        w = torch.softmax(self.hyper.detach(), 0)
        return {"rho": gate.max(), "rho_min": gate.min(), "rho_mean": gate.mean(), "blend0": w[0], "blend1": w[1],
                "blend2": w[2], "loops": torch.tensor(float(R), device=gate.device)}

    # -- the units: the prelude's layers, the core (all R passes: one pipeline unit), the coda ----------
    def units(self) -> list[Unit]:
        if self.cfg.dense:
            return super().units()
        P = self.cfg.n_layers
        core = tuple(x for x in (getattr(self, "kv_proj", None), self.core, self.lie, self.hyper, self.a) if x is not None)
        return [*(Unit.block(layer, i) for i, layer in enumerate(self.prelude)), Unit(self._core, core),
                Unit.block(self.coda, P)]

    def _core(self, e: Tensor, run: Run) -> Tensor:
        """The core unit: R passes, R from the step's context (the same on every stage) or the inference
        override; the gate's diagnostics."""
        R = run.loops or self.cfg.draw_loops(run.ctx)
        run.diagnostics.update(self.diagnostics(R))
        return self.loops(e, run.attend, run.cache, run.offset, R)

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
        frozen = R - cfg.backprop_loops if cfg.backprop_loops and torch.is_grad_enabled() else 0
        for r in range(R):
            with torch.set_grad_enabled(r >= frozen and torch.is_grad_enabled()):  # truncated backprop over passes
                if self.recompute_passes and torch.is_grad_enabled() and cache is None:
                    # keeps only the new state (the blend's inputs are earlier passes' states)
                    buf = checkpoint(self._pass, r, buf, w, gate, k, v, a, cache, offset, slot0, use_reentrant=False)
                else:
                    buf = self._pass(r, buf, w, gate, k, v, a, cache, offset, slot0)
            if states is not None:
                states.append(buf[0])
        return buf[0]

    def _pass(self, r: int, buf: list[Tensor], w, gate, k, v, a: Attend, cache, offset: int, slot0: int) -> list[Tensor]:
        """One core pass: blend, loop-index embedding, the core block, the gate; the new state buffer."""
        cfg, e = self.cfg, buf[0]
        h_in = buf[0] if cfg.disable_hyper else w[0] * buf[0] + w[1] * buf[1] + w[2] * buf[2]
        if not cfg.disable_lie:
            h_in = h_in + self.lie(loop_embedding(r, cfg.lie_dim, e.device, e.dtype))
        block = self.core_at(r)
        if cfg.self_attn_core:  # a residual block: its output is h_in + delta already
            full = block(h_in, a.at(slot0 + r))
            out = full if cfg.core_update == "reference" else full - h_in
        else:
            if cfg.unfreeze_kv:
                k, v = self.kv_proj(h_in)
                if cache is not None:
                    k, v, _ = cache.extend(slot0 + r, k, v)
            delta = block(h_in, k, v, a, offset)
            out = delta + h_in if cfg.core_update == "reference" else delta
        h = h_in + out if cfg.disable_lti else gate * h_in + out
        return [h, buf[0], buf[1]]

    def new_state(self, batch_size: int) -> KVCache:
        cfg, p = self.cfg, self.embed.weight
        anchors = 0 if cfg.dense else cfg.n_loops if (cfg.unfreeze_kv or cfg.self_attn_core) else 1
        slots = cfg.n_layers + (0 if cfg.dense else 1) + anchors
        o = cfg.block_options(1)
        return KVCache(slots, batch_size, o.kv_heads, cfg.max_seq_len, o.head_dim, p.device, p.dtype)


def parameter_counts(cfg: CARTConfig) -> dict[str, int]:
    """Spec §2.10's accounting: stored, the core's, the anchor projection's, effective at cfg.n_loops."""
    d, f, r = cfg.d_model, cfg.ffn, cfg.rank
    if cfg.dense:
        stored = cfg.vocab_size * d + cfg.n_layers * (4 * d * d + 3 * d * f + 2 * d) + d
        return {"stored": stored, "core": 0, "kv": 0, "effective": stored}
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
    """Training FLOPs per token (FLOPS_FORMULA) at the step's R (its expected value without ctx); passes
    run without gradient under truncated backprop count their forward only."""
    d = cfg.d_model
    if cfg.dense:
        return 6.0 * (cfg.n_layers * (4 * d * d + 3 * d * cfg.ffn) + cfg.vocab_size * d) + 12.0 * cfg.n_layers * d * seq_len
    R = cfg.expected_loops() if ctx is None else cfg.draw_loops(ctx)
    n = parameter_counts(cfg)
    layer = 2 * d * d + 3 * d * cfg.rank + 3 * d * cfg.ffn
    core = n["core"] - 2 * d
    kv = n["kv"]
    fixed = (cfg.n_layers + 1) * layer + (0 if cfg.unfreeze_kv else kv) + cfg.vocab_size * d
    per_pass = core + cfg.lie_dim * d + (n["kv"] if cfg.unfreeze_kv else 0)
    trained = min(R, cfg.backprop_loops) if cfg.backprop_loops else R  # the rest run forward only: 2, not 6
    passes = 6.0 * trained + 2.0 * (R - trained)
    return 6.0 * fixed + passes * per_pass + 12.0 * (cfg.n_layers + 1) * d * seq_len + passes * 2 * d * seq_len


FLOPS_FORMULA = ("6 * ((P + 1) * (2.75 d^2 + 3 d f) + 0.75 d^2 + V d) + 12 * (P + 1) * d * T + c * (2 d^2 + 3 d f + 32 d + "
                 "2 d T) with c = 6 per pass with gradient and 2 per pass without (truncated backprop): forward x 3, the P "
                 "prelude layers and the coda (low-rank keys and values), the anchor's keys and values once (in every "
                 "pass with unfreeze_kv), R core passes (queries and output only, the loop-index projection), the tied "
                 "head, attention at length T in every layer and pass; R is the step's draw, its expected value in "
                 "`pretrain info` (d width, f SwiGLU width, V vocabulary). The Dense baseline: the baseline's formula")


def info(cfg: CARTConfig) -> list[str]:
    n = parameter_counts(cfg)
    if cfg.dense:
        return ["the Dense baseline: no core, nothing counted more than once"]
    return [f"effective parameters at R={cfg.n_loops}: {n['effective']:,} (the shared core counted once per pass, "
            f"spec §2.10; {n['effective'] / n['stored']:.2f}x the {n['stored']:,} stored)"]


def inference_settings(cfg: CARTConfig, seq_len: int) -> list[str]:
    if cfg.dense:
        return []
    return [f"R = {cfg.n_loops} core passes (model.n_loops; another R' evaluates the same weights)"]


def _recompute_loop(model: CART) -> None:
    """Policy loop: each core pass whole (blend, loop-index embedding, core block, gate), non-reentrant;
    a pass keeps only its new state. The Dense baseline recomputes its layers."""
    if model.cfg.dense:
        apply_recompute(list(model.prelude))
    else:
        model.recompute_passes = True


def _recompute_all(model: CART) -> None:
    """Policy pass: the loop's passes as in policy loop, and the prelude's and the coda's blocks: a
    step keeps only block inputs and pass states (the loss's own memory aside, model.loss_chunk)."""
    _recompute_loop(model)
    if not model.cfg.dense:
        apply_recompute([*model.prelude, model.coda])


def _block_units(model: CART) -> list[nn.Module]:
    """Every block: the prelude's, each core pass's block and the coda (those of this pipeline stage)."""
    if model.cfg.dense:
        return list(model.prelude)
    core = [] if model.core is None else list(model.core) if model.cfg.unshare_core else [model.core]
    return [*model.prelude, *core, model.coda]


def activation_bytes(cfg: CARTConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """Peak activation bytes of one micro batch (fp32), in columns of N = batch x seq_len (fitted to
    tests/test_plan.py's measurements). A prelude or coda layer keeps 10.5 d + 4.2 f (a block with the
    low-rank key/value bottleneck), a core pass 7.8 d + 4.2 f; the embedding, anchor projection and head
    7.2 d and the loss its kept columns (the logits, V, unchunked: kernels/lm_loss's memory_columns); the
    loss's backward adds its peak (2 V unchunked). Policy loop keeps one state (d) per pass instead; block
    and pass keep each layer's input (1.46 d) and each pass's state (block: 2 d, its block input too), with
    8.7 d outside, and recompute one layer or pass at a time in the backward, after the loss's backward has
    freed what the loss kept. Parameter gradients are left out. The Dense baseline is the decoder's."""
    if cfg.dense:
        return decoder.activation_bytes(cfg, seq_len, batch, "none" if recompute == "none" else "full")
    d, f, V, P, R = cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.n_layers, cfg.n_loops
    layer, core = 10.5 * d + 4.2 * f, 7.8 * d + 4.2 * f
    kept, peak = memory_columns(V, d, batch * seq_len, cfg.loss_chunk)  # the loss's: V and 2 V unchunked
    if recompute == "none":
        columns = kept + 7.2 * d + (P + 1) * layer + R * core + peak
    elif recompute == "loop":
        columns = 7.2 * d + (P + 1) * layer + R * d + max(kept + peak, core)
    else:  # pass (= full) or block
        columns = 8.7 * d + (P + 1) * 1.46 * d + R * (2 if recompute == "block" else 1) * d + max(kept + peak, layer)
    return int(4 * batch * seq_len * columns)


def pipeline_split(cfg: CARTConfig, pp: int) -> list[int]:
    """Stages over the units (prelude layers, the core with its R passes, the coda) of the smallest
    largest cost: a layer costs 1, the core its expected number of passes; the Dense baseline's layers
    split as a decoder's."""
    if cfg.dense:
        return decoder.pipeline_split(cfg, pp)
    P = cfg.n_layers
    if P + 2 < pp:
        raise ValueError(f"CART has {P + 2} pipeline units at model.n_layers={P} (the prelude's layers, the core, "
                         f"the coda): too few for {pp} pipeline stages (parallel.pp x parallel.virtual_stages)")
    return balanced_split([1.0] * P + [cfg.expected_loops(), 1.0], pp)


SPEC = register(ArchSpec(
    name="cart",
    config_cls=CARTConfig,
    build=CART,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    info=info,
    inference_settings=inference_settings,
    progress=("rho", "loops"),
    decode=DecodeRelation("exact"),
    hf=RemoteAdapter("cart"),  # --format hf: remote code generated from this file (pretrain/hf_remote)
    supports=Support(pp=True),
    pipeline_split=pipeline_split,
    activation_bytes=activation_bytes,
    recompute_units={"pass": Recompute(configure=_recompute_all), "loop": Recompute(configure=_recompute_loop),
                     "block": _block_units},
))
