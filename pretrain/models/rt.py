"""The Recurrent Transformer (spec-003; Oncescu et al. 2026), and the paper's Transformer rows.

In every RT layer the key/value pair position i shows later positions is computed from its output z_i
of the same layer, not from its input x_i; position i itself attends to a temporary pair computed from
x_i with the same weights (spec §2.3, in the code's form, A7):

    q, k~, v~ = pre(x_i)            norm, q | k v projections, QK-norm, (RoPE)
    a_i       = attention of q over the persistent pairs of positions < i and the temporary pair
    z_i       = post(x_i, a_i)      h = x + r W_O a;  z = h + r MLP(norm(h))   (r: residual_multiplier)
    k_i, v_i  = kv(z_i)             the same norm, projection and QK-norm as pre, on z_i

No parameter is added over the Transformer of the same shape; `model.recurrent=false` is that
Transformer (the paper's "T" rows), built from the same shared block with the same parameter names.
Training and prefill run the exact dyadic tile schedule with its custom backward
(kernels/rt_prefill: the "tiled" path; "naive" is the definition); decode is a KV-cache decode with one
extra K/V projection per token and layer (spec §2.5), the cache holding the persistent pairs (the
"rt_decode" op: the same schedule after the cached prefix).

The choices the paper leaves open are config fields (spec §7): `norm` rms | layer (A1; layer is the
released configs' gain-only LayerNorm), `qk_norm` full | head (A2), `positions` alibi | rope (A6),
`residual_multiplier` (A4; 1 as in the code, 1/sqrt(L) for the paper's equations), `leaf_block` (A8:
an exact variant of the schedule), `init` mitchell (the code's) | normal.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from kernels.lm_loss import memory_columns
from kernels.rt_prefill import rt_decode, rt_prefill, schedule
from parallel.layers import trunc_normal_
from pretrain.models.blocks import Attend, Attention, Block, BlockOptions, apply_rope, make_norm, mlp
from pretrain.models.decoder import Decoder, DecoderConfig, pipeline_split
from pretrain.hf_remote.adapter import RemoteAdapter
from pretrain.models.registry import ArchSpec, DecodeRelation, Support, register
from pretrain.models.units import Unit, unit_modules


@dataclass
class RTConfig(DecoderConfig):
    arch: str = "rt"
    recurrent: bool = True  # false: the paper's Transformer rows (the same blocks, attending to their inputs)
    vocab_size: int = 32128
    n_layers: int = 12
    d_model: int = 1024
    n_heads: int = 16
    ffn_hidden: int = 0  # 0: 4 d_model (a GELU MLP)
    max_seq_len: int = 512
    norm: str = "rms"  # rms | layer (A1: the released configs' mean-centred LayerNorm, gain only)
    qk_norm: str = "full"  # full (over all heads, the code's) | head (A2)
    positions: str = "alibi"  # alibi | rope (A6; RoPE applied after QK-norm)
    alibi_max: float = 8.0
    residual_multiplier: float = 1.0  # r in h = x + r W_O a, z = h + r MLP(norm(h)) (A4)
    leaf_block: int = 1  # the tile schedule's leaf (A8, spec §3.8): any power of two, the same values
    init: str = "mitchell"  # mitchell (OLMo's, the code's) | normal (N(0, init_std), depth-scaled outputs)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    def block_options(self, depth: int) -> BlockOptions:
        return replace(super().block_options(depth), norm="layer_nobias" if self.norm == "layer" else "rms",
                       mlp="gelu", qk_norm=self.qk_norm, positions=self.positions, alibi_max=self.alibi_max,
                       init=self.init, residual_scale=self.residual_multiplier, scale_ffn_out=True)

    def validate(self) -> None:
        for name, value, allowed in (("norm", self.norm, ("rms", "layer")), ("qk_norm", self.qk_norm, ("full", "head")),
                                     ("positions", self.positions, ("alibi", "rope")),
                                     ("init", self.init, ("mitchell", "normal"))):
            if value not in allowed:  # before the shared blocks' own check, which names its options, not ours
                raise ValueError(f"model.{name} must be one of {', '.join(allowed)} (one position scheme: ALiBi and "
                                 f"RoPE do not combine), got {value!r}" if name == "positions" else
                                 f"model.{name} must be one of {', '.join(allowed)}, got {value!r}")
        super().validate()
        schedule.check_leaf(self.leaf_block)
        if self.n_kv_heads and self.n_kv_heads != self.n_heads:
            raise ValueError("model.n_kv_heads: the RT's persistent and temporary pairs share one projection with "
                             "as many key/value heads as query heads (spec §2.3); set model.n_kv_heads=0")
        if self.document_mask:
            raise ValueError("model.document_mask=true is not supported by RT: the paper packs across documents and "
                             "its recurrence state flows over EOS (spec A17); the tile schedule has no segment masks")
        if self.window:
            raise ValueError("model.window is not supported by RT (every position reads all earlier persistent pairs)")
        if self.residual_multiplier <= 0:
            raise ValueError(f"model.residual_multiplier must be positive, got {self.residual_multiplier}")

    def validate_run(self, run) -> None:
        if self.recurrent and run.parallel.recompute != "none":
            raise ValueError(f"parallel.recompute={run.parallel.recompute} adds nothing to RT: its tiled backward already "
                             "keeps only each layer's input and output and recomputes the rest (spec §3.5-3.6), and "
                             "checkpointing a layer would rerun its sequential forward; set parallel.recompute=none")
        if run.data.reset_positions:
            raise ValueError("data.reset_positions=true restarts positions at each document, but RT's recurrence runs "
                             "across documents (spec A17); set data.reset_positions=false")


class LayerView:
    """One RT layer as kernels/rt_prefill sees it (pre, post, kv, scale, slopes, parameters), with the
    RoPE tables of the positions being computed (base: the position of their first)."""

    def __init__(self, block: "RTBlock", rope: tuple[Tensor, Tensor] | None, base: int):
        self.block, self.rope, self.base = block, rope, base
        attn = block.attn
        self.scale = 1.0 / math.sqrt(attn.head_dim)
        self.slopes = attn.alibi.slopes if attn.positions == "alibi" else None

    # A captured region (kernels/captured.py, through kernels/rt_prefill/tiled.py) knows the layer by its
    # block, the same every step, and takes the RoPE tables, made per forward, as inputs.
    @property
    def region_key(self) -> int:
        return id(self.block)

    def tensors(self) -> list[Tensor]:
        return list(self.rope) if self.rope is not None else []

    def with_tensors(self, tables: list[Tensor]) -> "LayerView":
        return type(self)(self.block, tuple(tables), self.base)  # a subclass (tests, benchmarks) stays itself

    def _tables(self, offset: int, n: int):
        if self.rope is None:
            return None
        i = offset - self.base
        return self.rope[0][:, :, i:i + n], self.rope[1][:, :, i:i + n]

    def pre(self, x: Tensor, offset: int):
        b = self.block
        xn, rope = b.attn_norm(x), self._tables(offset, x.shape[1])
        return (b.attn.queries(xn, rope), *b.attn.keys(xn, rope))

    def pre_kept(self, x: Tensor, offset: int):
        """pre(x), and what pre_grads reads of it: the query and key projections before their norms (in the
        products' dtype: under autocast bf16, 4 bytes a token and model dimension kept through the backward's
        loop; the key's copied out of the k | v projection's output, which is not kept)."""
        b, kept = self.block, []
        xn, rope = b.attn_norm(x), self._tables(offset, x.shape[1])
        q, (k, v) = b.attn.queries(xn, rope, kept), b.attn.keys(xn, rope, kept)
        return q, k, v, kept[0], kept[1].contiguous()

    def pre_grads(self, x: Tensor, offset: int, kept: list, dq: Tensor, dk: Tensor, dv: Tensor, params: tuple) -> list:
        """[dL/dx, *the parameter gradients (aligned with params; None: not read by pre)] of pre(x), given the
        gradients at its outputs q, k, v [B, H, N, Dh] and pre_kept's projections: its backward without its
        autograd graph (which held the norms' float32 copies of every input), one product per matrix."""
        b, attn = self.block, self.block.attn
        rope, out = self._tables(offset, x.shape[1]), {}
        q_pre, k_pre = kept

        def through_norm(d: Tensor, pre: Tensor, norm: nn.Module) -> Tensor:
            stats = norm.grad_stats(pre if attn.qk_norm == "full" else pre.unflatten(-1, (-1, attn.head_dim)))
            d_out, d_in = _qk_norm_grad(attn, norm, d, stats, rope)
            _norm_grads(out, norm, d_out.reshape(stats.xhat.shape), stats)
            return d_in

        dq = through_norm(dq, q_pre, attn.q_norm)
        dkv = torch.cat([through_norm(dk, k_pre, attn.k_norm), dv.transpose(1, 2).flatten(2)], -1)
        xs = b.attn_norm.grad_stats(x)
        _gain_and_linear(out, b.attn_norm, attn.q, dq, xs)
        _gain_and_linear(out, b.attn_norm, attn.kv, dkv, xs)
        dn = (dq @ attn.q.weight).to(x.dtype) + (dkv @ attn.kv.weight).to(x.dtype)
        return [b.attn_norm.input_grad(None, dn, xs), *(out.get(id(p)) for p in params)]

    # One position (the loops' calls) through the block's steps, compiled under train.compile; the backward's
    # batched calls over all positions as written: compiled too they would take a second cache entry per
    # piece and shape (dynamo keeps 8), for a handful of kernels in all.
    def _steps(self, n: int) -> "Steps":
        return self.block.steps if n == 1 else PLAIN_STEPS

    def kv(self, z: Tensor, offset: int):
        return self._steps(z.shape[1]).kv(self.block, z, self._tables(offset, z.shape[1]))

    def post(self, x: Tensor, a: Tensor) -> Tensor:
        return self._steps(x.shape[1]).post(self.block, x, a)

    def position(self, x: Tensor, O: Tensor, l: Tensor, offset: int, z_out: Tensor, k_out: Tensor,
                 v_out: Tensor) -> None:
        """One position of the tiled forward as one piece (the loop's call): its output z = post(x, O / l) and
        persistent pair kv(z), written into z_out, k_out, v_out."""
        self.block.steps.position(self.block, x, O, l, self._tables(offset, 1), z_out, k_out, v_out)

    def parameters(self):
        return self.block.parameters()

    def in_loop(self, low: torch.dtype | None):
        """A context for the tiled loops' per-position calls: under autocast (`low`, its dtype) the block's linear
        weights cast to it once, where the pieces would cast them at every position. Compiled (Steps), they do:
        inductor traces autocast's casts into the graph and keeps no weight cache, so each position read every
        fp32 weight of the layer and wrote its bf16 copy, three times the bytes the position's products read.
        The loops only read the weights (their gradients come from the batched graphs after), and autocast
        would cast to the same values: the numbers are unchanged."""
        if low is None:
            return contextlib.nullcontext()
        with torch.no_grad():
            cast = {f"{name}.{p}": t.to(low) for name, m in self.block.named_modules() if isinstance(m, nn.Linear)
                    for p, t in m.named_parameters(recurse=False) if t.dtype == torch.float32}
        return _reparametrize_module(self.block, cast)

    def parameters_as(self, leaves: tuple[Tensor, ...]):
        """A context in which the block computes with `leaves` in place of its trainable parameters (in
        parameters() order; the tiled backward's aliases of them, kernels/rt_prefill/tiled.py)."""
        trainable = [(name, p) for name, p in self.block.named_parameters() if p.requires_grad]
        return _reparametrize_module(self.block, {name: t for (name, _), t in zip(trainable, leaves, strict=True)})

    # Hand-written input gradients of kv and post, for the backward's sequential phase (one position at
    # a time: building and walking an autograd graph there costs more than the arithmetic). Checked
    # against autograd by tests/test_rt.py through the whole backward. What they read of the forward
    # (norm statistics, the key before its norm, GELU's slope) does not depend on the gradient, so the
    # backward computes it for all positions at once before its loop (vjp_prepare) and passes each
    # position's slice: on a GPU every position's kernels are the loop's cost (docs/gpu-results.md).
    def vjp_prepare(self, x: Tensor, a: Tensor, z: Tensor, offset: int) -> "VjpPrep":
        """The forward quantities vjp_kv and vjp_post read, for layer input x, attention outputs a
        [B, H, N, Dh] and output z at positions offset.. (VjpPrep.at(t) gives position offset + t's), and the
        buffers into which they write, position by position, the gradients that weight_grads reads after the
        loop (`act`, GELU's slope, is overwritten by the gradient at fc1's output)."""
        prep = VjpPrep({**self._prep_post(x, a), **self._prep_kv(z)})
        B, N, d = x.shape
        low = prep["act"].dtype  # the products' dtype: autocast's, or x's without it
        width = self.block.attn.kv.weight.shape[0]
        prep.update(dh=x.new_empty(B, N, d), dkv=x.new_empty(B, N, width, dtype=low))
        if "k" in prep:
            prep["dkn"] = x.new_empty(B, N, width // 2, dtype=low)
        return prep

    def _prep_kv(self, z: Tensor) -> dict:
        b, attn = self.block, self.block.attn
        out = {"z": b.attn_norm.grad_stats(z)}
        if attn.qk_norm in ("head", "full"):
            width = attn.kv.weight.shape[0] // 2  # this rank's key heads x head_dim (the weight stacks K, V)
            k = b.attn_norm(z) @ attn.kv.weight[:width].T
            out["k"] = attn.k_norm.grad_stats(k.unflatten(-1, (-1, attn.head_dim)) if attn.qk_norm == "head" else k)
        return out

    def _prep_post(self, x: Tensor, a: Tensor) -> dict:
        b = self.block
        h = x + b.scale * b.attn.proj(a.transpose(1, 2).flatten(2))
        return {"h": b.ffn_norm.grad_stats(h), "act": _gelu_grad(b.ffn.fc1(b.ffn_norm(h)))}

    def vjp_kv(self, z: Tensor, offset: int, dk: Tensor, dv: Tensor, prep: "VjpPrep | None" = None) -> Tensor:
        """dL/dz of kv(z) given dL/dk, dL/dv [B, H, n, Dh]; prep: this position's slice of vjp_prepare's
        (computed here when not given)."""
        p = prep if prep is not None else VjpPrep(self._prep_kv(z))
        dz, (dkn, dkv) = self.block.steps.vjp_kv(self.block, dk, dv, p.get("k"), p["z"], self._tables(offset, z.shape[1]))
        _write(p, dkn=dkn, dkv=dkv)
        return dz

    def position_grad(self, offset: int, dk: Tensor, dv: Tensor, gz: Tensor, A: Tensor, prep: "VjpPrep",
                      dz_out: Tensor, g_out: Tensor, D_out: Tensor) -> None:
        """One position of the tiled backward as one piece (the loop's call), given what z's persistent pair
        received (dk, dv), the upstream gradient gz, the attention output A and prep (this position's
        vjp_prepare): dL/dz, dL/da and D = <A, dL/da>, written into dz_out, g_out, D_out."""
        self.block.steps.position_grad(self.block, dk, dv, prep.get("k"), prep["z"], self._tables(offset, 1), gz,
                                       prep["act"], prep["h"], A, dz_out, g_out, D_out,
                                       (prep["dh"], prep["dkv"], prep.get("dkn")))

    def vjp_post(self, x: Tensor, a: Tensor, dz: Tensor, prep: "VjpPrep | None" = None) -> Tensor:
        """dL/da of post(x, a) given dL/dz [B, n, d]; a [B, H, n, Dh]; prep as vjp_kv's."""
        p = prep if prep is not None else VjpPrep(self._prep_post(x, a))
        g, (dh, du) = self.block.steps.vjp_post(self.block, dz, p["act"], p["h"])
        if "dh" in p:  # the tiled backward's buffers (act's storage takes du: GELU's slope is read once)
            _write(p, dh=dh, act=du)
        return g.unflatten(-1, (a.shape[1], a.shape[3])).transpose(1, 2)

    def weight_grads(self, x: Tensor, a: Tensor, dz: Tensor, prep: "VjpPrep", params: tuple) -> tuple:
        """After the backward's loop: post's input gradient and the parameter gradients of kv (through the
        persistent pairs) and of post, each a list aligned with params (None: not read there), from what the loop
        wrote into prep (the gradients at the k | v projection's, the key norm's and fc1's outputs, and between
        attention and MLP) and prep's norm statistics; dz: dL/dz of every position. Autograd through kv() and
        post() again (as for a layer without this) would recompute both, then their input gradients, which the
        loop already has. Consumes prep (each tensor dropped once read). RT's linears and norms have no bias.

        A norm's gain and the linear after it share one product: for n = g * xhat and y = n W^T, with M = dy^T
        xhat, dL/dW = M diag(g) and dL/dg = sum over outputs of W * M, so the loop keeps no gradient at n."""
        b, attn = self.block, self.block.attn
        kv, post = {}, {}
        _gain_and_linear(kv, b.attn_norm, attn.kv, prep.pop("dkv"), prep.pop("z"))
        if "dkn" in prep:
            k = prep.pop("k")
            _norm_grads(kv, attn.k_norm, prep.pop("dkn").view(k.xhat.shape), k)
        h = prep.pop("h")
        _gain_and_linear(post, b.ffn_norm, b.ffn.fc1, prep.pop("act"), h)  # act's storage holds fc1's du
        if b.ffn.fc2.weight.requires_grad:  # fc2 read GELU(fc1(n)): made again, its input gradient not kept
            gelu = torch.nn.functional.gelu(b.ffn.fc1(_normed(b.ffn_norm, h)))
            _linear_grads(post, b.ffn.fc2, _scaled(b.scale, dz), gelu)
            del gelu
        dh = prep.pop("dh")
        _linear_grads(post, attn.proj, _scaled(b.scale, dh), a.transpose(1, 2).flatten(2))
        return dh, [kv.get(id(p)) for p in params], [post.get(id(p)) for p in params]


def _write(prep: "VjpPrep", **values) -> None:
    """A position's gradients into prep's buffers (those it has)."""
    for name, v in values.items():
        if name in prep:
            prep[name].copy_(v.flatten(2) if v.dim() > 3 else v)


def _scaled(scale: float, t: Tensor) -> Tensor:
    return t if scale == 1.0 else scale * t


def _normed(norm: nn.Module, stats) -> Tensor:
    """A gain-only norm's output from its grad_stats: the normalised input times the gain."""
    return (stats.xhat * norm.weight.to(stats.xhat.dtype)).to(stats.dtype)


def _linear_grads(out: dict, linear: nn.Module, dy: Tensor, x: Tensor) -> None:
    """out[id(weight)] = the gradient of a bias-free linear's weight given dL/d(its output) dy and its input x,
    over all positions: one product (under autocast in its dtype, as autograd's)."""
    if linear.weight.requires_grad:
        out[id(linear.weight)] = (dy.flatten(0, -2).T @ x.flatten(0, -2)).to(linear.weight.dtype)


def _gain_and_linear(out: dict, norm: nn.Module, linear: nn.Module, dy: Tensor, stats) -> None:
    """out[id(p)] = the gradients of a gain-only norm's weight g and the bias-free linear that reads it, given
    dL/d(the linear's output) dy and the norm's grad_stats (weight_grads says how)."""
    g, w = norm.weight, linear.weight
    if not (g.requires_grad or w.requires_grad):
        return
    M = (dy.flatten(0, -2).T @ stats.xhat.flatten(0, -2).to(dy.dtype)).to(stats.xhat.dtype)
    if w.requires_grad:
        out[id(w)] = (M * g.to(M.dtype)).to(w.dtype)
    if g.requires_grad:  # added to what other linears reading the norm gave (pre's q and k | v)
        dg = (M * w.to(M.dtype)).sum(0).to(g.dtype)
        out[id(g)] = out[id(g)] + dg if id(g) in out else dg


def _norm_grads(out: dict, norm: nn.Module, dy: Tensor, stats) -> None:
    """out[id(weight)] = the gradient of a gain-only norm's weight given dL/d(its output) dy and its grad_stats."""
    if norm.weight.requires_grad:
        out[id(norm.weight)] = (dy.to(stats.xhat.dtype) * stats.xhat).flatten(0, -2).sum(0).to(norm.weight.dtype)


# -- one position's pieces, as functions of the block and tensors: the tiled loops call them once per position,
# so under train.compile they are compiled (RT.compile), each into a few fused kernels, and shared by the layers
def _post(block: "RTBlock", x: Tensor, a: Tensor) -> Tensor:
    h = x + block.scale * block.attn.proj(a.transpose(1, 2).flatten(2))
    return h + block.scale * block.ffn(block.ffn_norm(h))


def _kv(block: "RTBlock", z: Tensor, rope) -> tuple[Tensor, Tensor]:
    return block.attn.keys(block.attn_norm(z), rope)


def _vjp_kv(block: "RTBlock", dk: Tensor, dv: Tensor, k_stats, z_stats, rope):
    """dL/dz of kv(z) given dL/dk, dL/dv [B, H, n, Dh], and the gradients at the key norm's output (dkn, heads
    split) and at the k | v projection's output (dkv)."""
    attn = block.attn
    dkn, dk = _qk_norm_grad(attn, getattr(attn, "k_norm", None), dk, k_stats, rope)
    dkv = torch.cat([dk, dv.transpose(1, 2).flatten(2)], -1)
    return block.attn_norm.input_grad(None, dkv @ attn.kv.weight, z_stats), (dkn, dkv)


def _qk_norm_grad(attn, norm, d: Tensor, stats, rope):
    """Given the gradient d [B, H, n, Dh] at a query's or key's heads (QK-normed, then rotated): the gradient
    at the norm's output [B, n, H, Dh] and at its input [B, n, H Dh] (the projection's output)."""
    if rope is not None:  # a rotation's transpose rotates back
        d = apply_rope(d, rope[0], -rope[1])
    d = d.transpose(1, 2)  # [B, n, H, Dh]
    if attn.qk_norm == "head":
        return d, norm.input_grad(None, d, stats).flatten(2)
    if attn.qk_norm == "full":
        return d, norm.input_grad(None, d.flatten(2), stats)
    return d, d.flatten(2)


def _vjp_post(block: "RTBlock", dz: Tensor, act: Tensor, h_stats):
    """dL/d(the attention outputs, heads flattened) [B, n, H Dh], and the gradients at the residual stream
    between attention and MLP (dh) and at fc1's output (du)."""
    d_act = (block.scale * dz) @ block.ffn.fc2.weight
    du = act * d_act
    dh = dz + block.ffn_norm.input_grad(None, du @ block.ffn.fc1.weight, h_stats)
    return block.scale * dh @ block.attn.proj.weight, (dh, du)


# A whole position of each loop as one piece, written in place into the loop's buffers: compiled, the writes
# (and the forward's division, the backward's sums) fuse into the kernels that produce their values, where
# the pieces apart left them to kernels of their own between compiled calls (benchmarks/rt_ops_per_position.py
# --compiled counts them). The operations and their order are those of the pieces apart.
def _position(block: "RTBlock", x: Tensor, O: Tensor, l: Tensor, rope, z_out: Tensor, k_out: Tensor,
              v_out: Tensor) -> None:
    """Position t of the tiled forward: its attention output O / l, z = post(x, a), and z's persistent pair."""
    z = _post(block, x, (O / l[..., None]).to(x.dtype))
    k, v = _kv(block, z, rope)
    z_out.copy_(z)
    k_out.copy_(k)
    v_out.copy_(v)


def _position_grad(block: "RTBlock", dk: Tensor, dv: Tensor, k_stats, z_stats, rope, gz: Tensor, act: Tensor,
                   h_stats, A: Tensor, dz_out: Tensor, g_out: Tensor, D_out: Tensor, grads_out: tuple) -> None:
    """Position t of the tiled backward: dL/dz (upstream gz plus what z's persistent pair received), the
    attention gradient g it gives through post(), and D = <A, g> (A in the accumulators' dtype); and into
    grads_out (dh, dkv, dkn or None) and act's storage (du), what LayerView.weight_grads reads."""
    # no out= arguments: dynamo breaks the graph at them (a kernel more, and the piece's remainder traced apart)
    dz_kv, (dkn, dkv) = _vjp_kv(block, dk, dv, k_stats, z_stats, rope)
    dz = (dz_kv + gz).to(dz_out.dtype)
    dz_out.copy_(dz)
    g, (dh, du) = _vjp_post(block, dz, act, h_stats)
    g_out.copy_(g.unflatten(-1, (A.shape[1], A.shape[3])).transpose(1, 2))
    D_out.copy_((A * g_out).sum(-1))
    dh_out, dkv_out, dkn_out = grads_out
    dh_out.copy_(dh)
    act.copy_(du)
    dkv_out.copy_(dkv)
    if dkn_out is not None:
        dkn_out.copy_(dkn.flatten(2))


class Steps:
    """The per-position pieces an RT layer's tiled loops call: as written, or (RT.compile) compiled with
    torch.compile, static shapes; one set per model, shared by its layers (their parameters are inputs)."""

    def __init__(self, compile: bool = False, **compile_kwargs):
        options = {**compile_kwargs, "dynamic": False}
        wrap = (lambda f: torch.compile(f, **options)) if compile else (lambda f: f)
        self.compiled = compile
        self.post, self.kv, self.vjp_kv, self.vjp_post = wrap(_post), wrap(_kv), wrap(_vjp_kv), wrap(_vjp_post)
        self.position, self.position_grad = wrap(_position), wrap(_position_grad)


PLAIN_STEPS = Steps()


class VjpPrep(dict):
    """LayerView.vjp_prepare's tensors, each [B, N, ...] (a norm's NormStats or a tensor)."""

    def at(self, t: int) -> "VjpPrep":
        return VjpPrep({k: v.at(t) if hasattr(v, "at") else v[:, t:t + 1] for k, v in self.items()})


def _gelu_grad(x: Tensor) -> Tensor:
    """d gelu(x) / dx for the exact (erf) GELU: Phi(x) + x phi(x). Two temporaries the size of x, written in
    place (vjp_prepare runs it on every position's MLP at once, the layer backward's peak as a formula with
    one temporary per operation); the operations and their order are the formula's."""
    x_phi = torch.mul(x, -0.5).mul_(x).exp_().mul_(x).div_(math.sqrt(2 * math.pi))
    return torch.mul(x, math.sqrt(0.5)).erf_().add_(1.0).mul_(0.5).add_(x_phi)


class RTBlock(nn.Module):
    """An RT layer: the shared block's modules (same names as the Transformer's Block), applied by the
    tile schedule in training and prefill, and one position at a time against the cache in decode."""

    def __init__(self, o: BlockOptions, leaf: int):
        super().__init__()
        self.attn_norm = make_norm(o.norm, o.d_model, o.norm_eps)
        self.attn = Attention(o)
        self.ffn_norm = make_norm(o.norm, o.d_model, o.norm_eps)
        self.ffn = mlp(o)
        self.scale = o.residual_scale
        self.leaf = leaf
        self.steps = PLAIN_STEPS  # RT.compile swaps in the compiled pieces

    def forward(self, h: Tensor, a: Attend) -> Tensor:
        cache = a.cache
        offset = 0 if cache is None else cache.length
        view = LayerView(self, a.rope, offset)
        if cache is None:
            return rt_prefill(h, view, self.leaf, 0)
        n = h.shape[1]
        prefix = (cache.k[a.slot][:, :, :offset], cache.v[a.slot][:, :, :offset])
        z, k, v = rt_decode(h, view, self.leaf, offset, prefix)  # exact; decode needs no gradient
        cache.k[a.slot][:, :, offset:offset + n] = k
        cache.v[a.slot][:, :, offset:offset + n] = v
        return z


class RT(Decoder):
    """embed -> L RT layers (or Transformer blocks) -> norm -> untied head."""

    def __init__(self, cfg: RTConfig):
        super().__init__(cfg)
        L = cfg.n_layers
        if cfg.recurrent:
            self.blocks = nn.ModuleList(RTBlock(replace(cfg.block_options(L), layer=i), cfg.leaf_block) for i in range(L))
        else:
            self.blocks = nn.ModuleList(Block(replace(cfg.block_options(L), layer=i)) for i in range(L))
        if cfg.init == "mitchell":  # the embedding and the untied head: N(0, 1/d), truncated at 3 sigma
            std = 1.0 / math.sqrt(cfg.d_model)
            for w in {id(p): p for p in (self.embed.weight, self.head.weight)}.values():
                trunc_normal_(w, std, 3.0)

    def applications(self) -> list[nn.Module]:
        return list(self.blocks)

    def compile(self, *args, **kwargs) -> None:
        """train.compile of RT: the read-out (final norm, head, loss) and the pieces a layer's tiled loops run
        at each position (post, kv and their input gradients: Steps), not the loops. Tracing a layer unrolls
        its N positions into one graph (d 64 at N = 32: 201 s to the first step on a CPU; the issue's RT-300M
        at N = 512 had not compiled after 80 s on an H100); the pieces compile once for all layers and
        positions (static shapes), and each becomes a few fused kernels where it ran about 20 (on a GPU the
        loop's cost is its kernels: docs/gpu-results.md, 2026-11-29). The loops run as written, or as CUDA
        graphs under train.cuda_graphs, calling them. Compiling the model around disabled layers broke its
        graph at every layer and recompiled the loop's remainder per layer; the embedding left out is a
        gather. The Transformer rows compile whole."""
        if self.cfg.recurrent:
            self.stage_output = torch.compile(self.stage_output, *args, **kwargs)
            steps = Steps(compile=True, **kwargs)  # each position's pieces (_post, _kv, their vjps)
            for block in self.blocks:
                block.steps = steps
            return
        super().compile(*args, **kwargs)

    def compile_blocks(self, **kwargs) -> None:
        """train.compile_scope=blocks: the Transformer rows compile block by block; RT's own layers stay out as
        under `compile`, so for them it is `compile`."""
        if self.cfg.recurrent:
            return self.compile(**kwargs)
        super().compile_blocks(**kwargs)

    def units(self) -> list[Unit]:
        """A layer each (an RT layer's position loop is a captured region: kernels/rt_prefill/tiled.py)."""
        return [Unit.block(b, i) for i, b in enumerate(self.blocks)]

    def stage_inputs(self, batch):
        """The training forward (the decoder's run_stage): positions run over the packed sample (no
        resets), no document mask."""
        tokens = batch.tokens
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return tokens, self.attend(positions, self.mask(None))


def flops_per_token(cfg: RTConfig, seq_len: int, ctx=None) -> float:
    """Training FLOPs per token (FLOPS_FORMULA)."""
    d, L, f = cfg.d_model, cfg.n_layers, cfg.ffn
    projections = (6 if cfg.recurrent else 4) * d * d  # q, o, and k|v once (T) or twice: from x and from z (RT)
    return 6.0 * (L * (projections + 2 * d * f) + cfg.vocab_size * d) + 12.0 * L * d * seq_len


def activation_bytes(cfg: RTConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """Peak activation bytes of one micro batch (fp32), in columns of N = batch x seq_len (fitted to
    tests/test_plan.py's measurements). RT's layer keeps only 1.8 d + 0.125 f through its custom backward,
    which recomputes the layer (a Transformer row's 14.6 d + 2.125 f, with ALiBi's biased attention) when
    its turn comes; a Transformer row keeps 14.6 d + 2.125 f, or 1.75 d under recompute. The embedding
    and final norm keep 5 d, the loss its kept columns (kernels/lm_loss's memory_columns: the logits, V,
    unchunked) and adds its peak (2 V unchunked) in the backward; an RT layer's recomputation comes after
    the loss's backward, which frees both. Parameter gradients are left out."""
    d, f, V, L = cfg.d_model, cfg.ffn, cfg.vocab_size, cfg.n_layers
    row = 14.6 * d + 2.125 * f
    kept, peak = memory_columns(V, d, batch * seq_len, cfg.loss_chunk)
    if cfg.recurrent:  # the loss's columns are freed before the first layer's backward begins
        columns = 5 * d + L * (1.8 * d + 0.125 * f) + max(kept + peak, row)
    elif recompute == "none":
        columns = kept + 5 * d + L * row + peak
    else:
        columns = kept + 5 * d + L * 1.75 * d + max(peak, row + 2 * d)
    return int(4 * batch * seq_len * columns)


def captured_bytes(cfg: RTConfig, seq_len: int, batch: int) -> int:
    """The static buffers of RT's captured loops (train.cuda_graphs; kernels/captured.py), one set for all
    layers: the forward's input x and output Z, the backward's x, Z, its incoming gradient and dx (six fp32
    [B, T, d]), the two regions' softmax statistics (fp32 [B, H, T] each), and one layer's parameter
    gradients (fp32). tests/test_captured.py checks it against the emulated backend's buffers; on the H200 it was
    8,583 MiB at 512 x 512 tokens (rt/300m-12l), which the planner had left out."""
    if not cfg.recurrent:
        return 0
    d, f, H = cfg.d_model, cfg.ffn, cfg.n_heads
    return 4 * (batch * seq_len * (6 * d + 2 * H) + 4 * d * d + 2 * d * f + 4 * d)


def serial_loop(cfg: RTConfig, seq_len: int) -> tuple[int, float] | None:
    """Each RT layer produces its positions one at a time (spec §3): T dependent steps per layer. What runs
    inside them, per token and layer (spec §3.3, §3.5): forward the output projection and MLP (2 d^2 +
    4 d f), the persistent key/value projection (4 d^2) and the tile attention (2 d T on average); backward
    the key/value input gradient (4 d^2), post() recomputed and its input gradient (4 d^2 + 8 d f) and the
    tiles' dK, dV (4 d T). The queries, the temporary pairs and every weight gradient run batched."""
    if not cfg.recurrent:
        return None
    d, f, T = cfg.d_model, cfg.ffn, seq_len
    return cfg.n_layers * T, float(cfg.n_layers * (14 * d * d + 12 * d * f + 6 * d * T))


FLOPS_FORMULA = ("6 * (L * (p d^2 + 2 d f) + V d) + 12 * L * d * T: forward x 3, p = 6 for RT (q, the output, and the "
                 "key/value projection twice: the temporary pair from x, the persistent one from z; spec §2.5: +1/6 "
                 "of the d^2 terms) or 4 for the Transformer rows, a GELU MLP of width f, the untied head, attention at "
                 "length T (L layers, width d, vocabulary V)")


SPEC = register(ArchSpec(
    name="rt",
    config_cls=RTConfig,
    build=RT,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    decode=DecodeRelation("exact"),
    pipeline_split=pipeline_split,
    activation_bytes=activation_bytes,
    captured_bytes=captured_bytes,
    serial_loop=serial_loop,
    hf=RemoteAdapter("rt"),  # --format hf: remote code generated from this file (pretrain/hf_remote)
    supports=Support(tp=False, sp=False, pp=True, zero_stages=(0, 1, 2), reasons={
        "zero": "ZeRO-3 partitions parameters and gathers them around each module's forward, but RT's custom backward "
                "runs the layer's modules again inside the backward pass, on parameters ZeRO-3 has released",
        "tp": "RT's QK-norm normalises over the heads tensor parallelism would split, and its output projection "
              "and MLP run once per position inside the sequential loop: two all-reduces per position and layer "
              "in the forward and again in the backward (spec §3.8; measured at TP2 with gloo by "
              "benchmarks/bench_rt.py: 2.5-5% of a d=1024 layer's step on CPU, 84-169% at d=64)",
        "sp": "the recurrence runs over the whole sequence: a sequence slice cannot be computed without the "
              "previous slice's outputs (spec §3.8)"}),
    recompute_units=unit_modules,  # each block: the Transformer rows only (validate_run refuses RT's)
    captured_regions=lambda run: ("RT's per-layer position loops (the tile schedule's forward and backward)", None)
    if run.model.recurrent else (None, "model.recurrent=false: the Transformer rows have no position loop"),
))
