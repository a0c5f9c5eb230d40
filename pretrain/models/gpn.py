"""Grounded Prediction Networks (spec-002; Wang 2026): GPN and GPN+M, one wide state revisited per token.

One state vector (width d) and, in GPN+M, one matrix memory per head carry everything; every token
runs one step, in the released code's order (spec §2.2), here with the step's first half moved to
the top of the loop (iteration t grounds token t, then predicts):

    s^g   = Gate_f(s^p) * s^p + G_t                  ground: G_t = rms(emb(x_t)) W_fuse, hoisted
          (a step boundary of spec §2.2 falls here: the state is (s^g, the previous s^g, M))
    M     = alpha M + beta k (v - M^T k)^T           write (GPN+M): k from the previous s^g, v from s^g
    s     = s^g; per sub-layer: s = Gate_p(s) * s + FFN(s) + Read(M, s)      predict
    s^p   = s                                        decoded after the loop: (rms(s^p) W_dproj) Emb^T

With a zero state s^p, the first prediction is exactly 0 (uniform logits), so the code's window,
where position 0 is a target predicted from nothing, is the same recurrence with its predictions
shifted by one: `position0: uniform` (the paper's), and `position0: context` predicts the batch's
labels after each token (every target has context, as the other architectures here; spec A8).

Training form (spec §5.2): embeddings, the fuse projection, the decode and the loss run outside the
time loop over all positions at once; inside it, every projection of a state shares that state's
RMS factor, so the norm weights are folded into the matrices once per forward and each state takes
one matrix product (layer 0 and the memory write: W_1 | W_pg | W_q | W_rg | W_v | W_beta | W_a;
the key W_k reads the previous s^g). BPTT runs over the whole window by segments of `segment` steps
(default ceil(sqrt(T))): under parallel.recompute=full (the configs' default) each segment is one
autograd node that runs again in the backward (_Segment), so a step keeps its segment-start states and
one live segment (O(T/S + S) memories instead of T).

Truncated BPTT (`tbptt` K, spec A10 and §8.2) detaches the carried state (s^g, the previous s^g, M)
at the §2.2 step boundaries t = K, 2K, ..., between Ground and Write: in this loop, inside the
iteration that grounds the (mK)-th token of the code's window (the cut's own token then gets no
gradient through the fuse path, and W_k still gets one from the key of the detached previous s^g).

The state (the last s^g as its RMS-normalised s^g / rms(s^g), the only form the next step reads, M,
s^p) is the whole decode cache: streaming runs the same iteration, so decode equals the training
forward exactly.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import captured
from kernels.delta_memory import memory_read, memory_step
from kernels.lm_loss import memory_columns
from parallel.layers import LMHead, ReplicatedLinear, RMSNorm, VocabEmbedding, replicated_parameter
from parallel.recompute import Recompute
from pretrain.models.base import EVAL, ModelConfig, check_eos_id, doc_ids_of
from pretrain.hf_remote.adapter import RemoteAdapter
from pretrain.models.registry import ArchSpec, DecodeRelation, Support, register
from pretrain.models.units import Whole

POSITION0 = ("context", "uniform")


@dataclass
class GPNConfig(ModelConfig):
    arch: str = "gpn"
    vocab_size: int = 32000
    max_seq_len: int = 1 << 20  # no table depends on it: the window is the data's seq_len
    d_emb: int = 768  # E (spec A1)
    d_state: int = 2496  # d
    d_ffn: int = 6656  # F
    n_layers: int = 1  # predict sub-layers per token (the paper's "layers"); bare GPN: 1
    mem_heads: int = 15  # H; 0 is bare GPN (no memory)
    d_key: int = 128
    d_value: int = 256
    decoder_bias: bool = False  # b_dec (the §7.2 ablation only)
    position0: str = "context"  # context | uniform (the paper's code: position 0 a target, predicted from zeros)
    reset_at_documents: bool = False  # zero the state where a document starts (the paper does not, A9)
    eos_id: int = 2  # the tokenizer's end of a document: where inference resets (model.reset_at_documents)
    segment: int = 0  # S, steps per BPTT segment (recomputed under parallel.recompute=full); 0: ceil(sqrt(T))
    tbptt: int = 0  # K: detach the carried state at the step boundaries K, 2K, ... (spec A10; 0: full BPTT)
    norm_eps: float = 1e-6
    init_std: float = 0.02  # the embedding's and W_o's
    loss_chunk: int = 0  # > 0: the loss that many positions at a time (kernels/lm_loss "chunked")

    def validate(self) -> None:
        super().validate()
        for name in ("d_emb", "d_state", "d_ffn", "n_layers", "d_key", "d_value"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.mem_heads < 0:
            raise ValueError(f"model.mem_heads must be >= 0 (0: bare GPN, no memory), got {self.mem_heads}")
        if self.mem_heads == 0 and self.n_layers != 1:
            raise ValueError(f"bare GPN (model.mem_heads=0) has one predict sub-layer (spec §2.4), got "
                             f"model.n_layers={self.n_layers}")
        if self.position0 not in POSITION0:
            raise ValueError(f"model.position0 must be one of {', '.join(POSITION0)}, got {self.position0!r}")
        for name in ("segment", "tbptt", "loss_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0 (0: {'the default' if name != 'tbptt' else 'off'}), "
                                 f"got {getattr(self, name)}")
        check_eos_id(self, "reset_at_documents")

    def validate_run(self, run) -> None:
        check_eos_id(self, "reset_at_documents", run)
        T = run.data.seq_len
        if self.segment > T:
            raise ValueError(f"model.segment={self.segment} is longer than the window (data.seq_len={T}); use at most "
                             f"{T} (0: ceil(sqrt(T)) = {math.isqrt(T - 1) + 1})")
        if self.tbptt > T:
            raise ValueError(f"model.tbptt={self.tbptt} is longer than the window (data.seq_len={T}): the truncation "
                             "would never cut; use 0 for full BPTT or a length below the window")

    def segment_for(self, T: int) -> int:
        """The segments' length at window T: model.segment, or ceil(sqrt(T)); the last one may be shorter."""
        return self.segment or max(1, math.isqrt(max(T - 1, 0)) + 1)

    def segments(self, T: int) -> tuple[list[tuple[int, int]], set[int]]:
        """The window's BPTT segments [start, end) over T steps, and the steps where truncated BPTT cuts: every
        segment_for(T) steps, and a segment also starts at each cut (the step boundary mK of the code's window
        falls in the step grounding its (mK)-th token)."""
        S, K = self.segment_for(T), self.tbptt
        cuts = set(range(K - 1, T, K)) if K else set()
        starts = sorted(set(range(0, T, S)) | cuts)
        return list(zip(starts, starts[1:] + [T])), cuts


def _lecun(fan_in: int, fan_out: int, bias: bool = False) -> ReplicatedLinear:
    """flax's lecun_normal: variance 1 / fan_in after truncation at two standard deviations."""
    return ReplicatedLinear(fan_in, fan_out, bias=bias, init_std=math.sqrt(1.0 / fan_in) / 0.87962566103423978,
                            trunc=2.0)


def _zero(fan_in: int, fan_out: int, bias: bool = False) -> ReplicatedLinear:
    layer = ReplicatedLinear(fan_in, fan_out, bias=bias)
    nn.init.zeros_(layer.weight)
    return layer


def _hat(x: Tensor, eps: float) -> Tensor:
    """x / rms(x), the factor every RMSNorm of x shares (its weight folded into the next matrix)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _state_precision(M: Tensor):
    """Autocast off around the memory's arithmetic (spec A14: M stays fp32 under bf16)."""
    on = M.device.type != "meta" and torch.is_autocast_enabled(M.device.type)  # a dry run computes on meta
    return torch.autocast(M.device.type, enabled=False) if on else nullcontext()


def _kept(state: list[Tensor], keep: Tensor) -> list[Tensor]:
    """The state [s^g, M, s^p] with the rows where keep [B] is 0 zeroed (a document start)."""
    k = keep[:, None]
    return [state[0] * k, state[1] * k[..., None, None], state[2] * k]


def _unit(x: Tensor) -> Tensor:
    """The spec's l2n per head: x / sqrt(|x|^2 + 1e-12) (0 stays 0)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)


def _product(taps: dict[str, Tensor] | None, kept: dict[str, Tensor], name: str, x: Tensor, *Wb: Tensor) -> Tensor:
    """F.linear(x, *Wb): one of a step's matrix products, `name` its place in Folded.products(). Tapped (a
    segment's backward, _Segment): x is kept under the name and the zero taps[name] added to the output, so
    the gradient of taps[name] is the output's; the segment forms the matrix's gradient over all its steps
    in one product instead of one per step."""
    if taps is None or name not in taps:
        return F.linear(x, *Wb)
    x = x.to(Wb[0].dtype)  # what autocast multiplies (the matrices cast once: Folded.cast_for_loop)
    kept[name] = x
    return F.linear(x, *Wb) + taps[name]


class Gate(nn.Module):
    """sigmoid(rms(x) W + b), W a full d x d matrix, zero at init (the gate starts at 0.5)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.proj = _zero(d, d, bias=True)


class MemoryWrite(nn.Module):
    """The write's projections (one norm shared by the key's and the value's sources) and the decay's
    per-head parameters (spec §2.5, §2.9)."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, H = cfg.d_state, cfg.mem_heads
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.k = _lecun(d, H * cfg.d_key, bias=True)
        self.v = _lecun(d, H * cfg.d_value)
        self.beta = _lecun(d, H)
        self.a = _lecun(d, H)
        self.A_log = replicated_parameter(torch.log(torch.empty(H).uniform_(0, 16).clamp(min=1e-8)))
        dt = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias = replicated_parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


class PredictLayer(nn.Module):
    """One predict sub-layer: its gate, SwiGLU FFN (W_2 zero at init) and, in GPN+M, its memory read."""

    def __init__(self, cfg: GPNConfig):
        super().__init__()
        d, F_, H = cfg.d_state, cfg.d_ffn, cfg.mem_heads
        self.gate = Gate(d, cfg.norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps)
        self.w1 = _lecun(d, 2 * F_)
        self.w2 = _zero(F_, d)
        if H:
            self.read_norm = RMSNorm(d, cfg.norm_eps)
            self.q = _lecun(d, H * cfg.d_key, bias=True)
            self.rg = _lecun(d, H * cfg.d_value)
            self.out_norm = RMSNorm(H * cfg.d_value, cfg.norm_eps)
            self.o = ReplicatedLinear(H * cfg.d_value, d, init_std=cfg.init_std)


@dataclass
class Folded:
    """The loop's matrices for one forward: norm weights folded in, projections of one state stacked."""

    fuse_gate: tuple[Tensor, Tensor]  # (W, b) on s^p
    first: tuple[Tensor, Tensor]  # (W, b) on s^g: layer 0's W_1 | W_pg | W_q | W_rg, the write's W_v | W_beta | W_a
    later: list[tuple[Tensor, Tensor]]  # layers 1..: W_1 | W_pg | W_q | W_rg on the previous sub-layer's output
    sizes_first: list[int]
    sizes_later: list[int]
    outs: list[Tensor]  # per layer: W_o diag(w_onorm) (the read-out norm's weight folded in)
    downs: list[Tensor]  # per layer: the FFN's W_2
    neg_A: Tensor | None  # -exp(A_log): the decay's per-head rate
    key: tuple[Tensor, Tensor] | None  # (W_k, b_k) on the previous s^g

    # Every parameter the loop uses comes through these tensors (never a module's own), so that a
    # segment's backward can return their gradients as its inputs' (_Segment).
    def tensors(self) -> list[Tensor]:
        flat = [*self.fuse_gate, *self.first, *(t for pair in self.later for t in pair), *self.outs, *self.downs]
        return flat + ([self.neg_A, *self.key] if self.key is not None else [])

    def cast_for_loop(self, like: Tensor) -> "Folded":
        """This Folded with its fp32 matrices in autocast's dtype on like's device (as is without autocast),
        cast once for a loop whose steps take no gradient of them (a segment's forward, evaluation, and a
        segment's backward, which forms their gradients itself: _Segment). Compiled (train.compile), a step
        would cast them at every step: inductor traces autocast's casts and keeps no weight cache, so each
        step read the loop's ~100M fp32 numbers and wrote their bf16 copies (gpn-m-130m): three times the
        bytes its products read. The decay rate stays fp32 (the memory's own arithmetic)."""
        on, low = captured.autocast_state(like.device)  # off on meta (a dry run)
        if not on:
            return self
        return self.with_tensors([t.to(low) if t is not self.neg_A and t.dtype == torch.float32 else t
                                  for t in self.tensors()])

    def products(self) -> dict[str, tuple[int, int | None]]:
        """Each matrix product of a step, by the name iterate gives it: where its matrix and its bias (None:
        none) are in tensors(): read off this Folded rebuilt with the positions in place of its tensors."""
        ix = self.with_tensors(list(range(len(self.tensors()))))
        at = {"fuse_gate": ix.fuse_gate, "first": ix.first, **{f"later{i}": p for i, p in enumerate(ix.later, 1)}}
        at.update({f"out{i}": (j, None) for i, j in enumerate(ix.outs)})
        at.update({f"down{i}": (j, None) for i, j in enumerate(ix.downs)})
        if ix.key is not None:
            at["key"] = ix.key
        return at

    def skeleton(self) -> "Folded":
        """This Folded without its tensors (None in their places): what with_tensors needs to rebuild one."""
        return self.with_tensors([None] * len(self.tensors()))

    def with_tensors(self, flat: list[Tensor]) -> "Folded":
        it = iter(flat)
        take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
        fuse_gate, first = tuple(take(2)), tuple(take(2))
        later = [tuple(take(2)) for _ in self.later]
        outs, downs = take(len(self.outs)), take(len(self.downs))
        neg_A, key = (next(it), tuple(take(2))) if self.key is not None else (None, None)
        return Folded(fuse_gate, first, later, self.sizes_first, self.sizes_later, outs, downs, neg_A, key)


class _Segment(torch.autograd.Function):
    """S steps of the loop as one autograd node: the forward runs without a graph (nothing kept but the
    segment's inputs: its start state, its slice of G and the loop's matrices, which live anyway); the
    backward runs the segment again with a graph and differentiates it. One node per segment, not one
    per op and step: memory O(T/S + S) in the window (torch's non-reentrant checkpoint keeps a holder
    per saved tensor of every step, O(T) however small, measured at about 50 KB per token). The backward
    forms the loop matrices' gradients itself, one product per matrix over the segment's steps (_product).
    Both bodies are functions of tensors run through kernels/captured.py: in a training step on a GPU
    under train.cuda_graphs, one CUDA graph per body serves every segment of the window (the shorter last
    segment, a truncation cut and a window with document resets get their own), replayed with the
    segment's inputs copied in."""

    @staticmethod
    def forward(ctx, model, W: Folded, n_state: int, keep, cut: bool, *inputs):
        # the bodies close over counts and W's shape only, never a step's tensors: a captured graph keeps
        # its body for the run, and with it whatever the body holds (the first step's G and matrices)
        n_inputs, has_keep, shape = len(inputs), keep is not None, W.skeleton()

        def run(*xs):  # a captured region (kernels/captured.py): tensors in, tensors out
            # detached: the step sees tensors without requires_grad, as in evaluation, so a compiled step
            # (train.compile) serves both with one graph (dynamo's guards tell the two apart otherwise)
            state, G, flat, keep_ = _split([x.detach() for x in xs], n_state, n_inputs, has_keep)
            with torch.no_grad():
                sp, state, _ = model._run(state, G, shape.with_tensors(flat), keep_, cut)
            return sp, *state

        outs = captured.region(("gpn segment forward", id(model), n_state, cut), run, _with_keep(inputs, keep))
        ctx.model, ctx.W, ctx.n_state, ctx.keep, ctx.cut = model, W, n_state, keep, cut
        ctx.autocast = captured.autocast_state(inputs[n_state].device)  # recomputed in the forward's precision
        ctx.save_for_backward(*inputs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        need, n, model, cut, keep = ctx.needs_input_grad[5:], ctx.n_state, ctx.model, ctx.cut, ctx.keep
        given = tuple(g is not None for g in grads)
        saved = ctx.saved_tensors
        n_saved, has_keep, shape = len(saved), keep is not None, ctx.W.skeleton()  # no tensors in the body

        def run(*xs):
            state, G, flat, keep_ = _split(xs, n, n_saved, has_keep)
            gs = iter(xs[n_saved:n_saved + sum(given)])
            # the products whose matrix (or bias) needs its gradient are tapped (_product), and that gradient
            # formed once for the segment, sum_t dY_t^T X_t as one product over its steps: per step it would be
            # a product of a step's batch (rows 128 at gpn-m-130m) writing all of the loop's ~100M numbers and
            # adding them to the sum, memory-bound. The steps then read the matrices cast once, as the forward.
            taken = {name: at for name, at in shape.products().items() if any(i is not None and need[n + 1 + i]
                                                                              for i in at)}
            formed = {n + 1 + i for at in taken.values() for i in at if i is not None}
            # the state differentiated whether or not its gradient is wanted (the window's first segment's
            # is not), so a compiled step (train.compile) serves every segment with one graph
            inputs = [t.detach().requires_grad_((wants and i not in formed) or i < n)
                      for i, (t, wants) in enumerate(zip([*state, G, *flat], need))]
            W = shape.with_tensors(inputs[n + 1:]).cast_for_loop(G)
            low = W.tensors()
            # one zero broadcast (nothing allocated) per product; _run hands each step its slice through one unbind,
            # whose backward stacks the steps' gradients once (a slice per step would add a whole [n, B, width]
            # of zeros per step in the backward)
            n_steps, B = G.shape[1], G.shape[0]
            taps = {name: torch.zeros((), device=G.device, dtype=low[w].dtype).expand(n_steps, B, low[w].shape[0])
                    .requires_grad_() for name, (w, _) in taken.items()}
            with torch.enable_grad():
                sp, out, kept = model._run(inputs[:n], inputs[n], W, keep_, cut, taps)
            pairs = [(o, next(gs)) for o, has in zip([sp, *out], given) if has]
            pairs = [(o, g) for o, g in pairs if o.requires_grad]
            wanted = [t for t in inputs if t.requires_grad] + list(taps.values())
            got = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if pairs and wanted else [None] * len(wanted))
            dY = dict(zip(taps, got[len(got) - len(taps):]))
            got = iter(got[:len(got) - len(taps)])
            computed = [next(got) if t.requires_grad else None for t in inputs]
            for name, (w, b) in taken.items():
                d = (dY[name] if dY[name] is not None else taps[name].detach()).flatten(0, 1)
                computed[n + 1 + w] = (d.t() @ kept[name].flatten(0, 1)).to(flat[w].dtype)
                if b is not None:
                    computed[n + 1 + b] = d.sum(0, dtype=flat[b].dtype)
            return [g if wants else None for g, wants in zip(computed, need)]  # the start state's when wanted

        with captured.autocast_as(saved[n].device, ctx.autocast):
            grads_in = captured.region(("gpn segment backward", id(model), n, cut, need, given), run,
                                       _with_keep([*saved, *(g for g in grads if g is not None)], keep))
        return (None, None, None, None, None, *grads_in)


def _with_keep(tensors, keep) -> list[Tensor]:
    return [*tensors, keep] if keep is not None else list(tensors)


def _split(xs, n_state: int, n_inputs: int, has_keep: bool):
    """A segment region's inputs [*state, G, *folded matrices, (gradients), (keep)] as (state, G, matrices,
    keep): n_inputs of them come before any gradients, and keep, when there is one, is the last (_with_keep)."""
    return list(xs[:n_state]), xs[n_state], list(xs[n_state + 1:n_inputs]), xs[-1] if has_keep else None


class GPN(Whole, nn.Module):
    def __init__(self, cfg: GPNConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        E, d = cfg.d_emb, cfg.d_state
        self.embed = VocabEmbedding(cfg.vocab_size, E, init_std=cfg.init_std)
        self.fuse_norm = RMSNorm(E, cfg.norm_eps)
        self.fuse = _lecun(E, d)
        self.fuse_gate = Gate(d, cfg.norm_eps)
        self.write = MemoryWrite(cfg) if cfg.mem_heads else None
        self.layers = nn.ModuleList(PredictLayer(cfg) for _ in range(cfg.n_layers))
        self.dec_norm = RMSNorm(d, cfg.norm_eps)
        self.dproj = _lecun(d, E)
        self.dec_bias = replicated_parameter(torch.zeros(E)) if cfg.decoder_bias else None
        self.head = LMHead(E, cfg.vocab_size, tied=self.embed, loss_chunk=cfg.loss_chunk)
        self.segment_recompute = False  # parallel.recompute=full (GPN's configs): each segment checkpointed

    def compile(self, *args, **kwargs) -> None:
        """torch.compile of the step only (train.compile): the window's loop stays in Python, since
        tracing it would unroll T steps into one graph; each step runs the compiled graph."""
        self.iterate = torch.compile(self.iterate, *args, **{"dynamic": False, **kwargs})

    # -- the loop's matrices ---------------------------------------------------------------------
    def _layer_parts(self, layer: PredictLayer) -> list[tuple[Tensor, Tensor | None, Tensor]]:
        parts = [(layer.w1.weight, None, layer.ffn_norm.weight), (layer.gate.proj.weight, layer.gate.proj.bias,
                                                                   layer.gate.norm.weight)]
        if self.write is not None:
            parts += [(layer.q.weight, layer.q.bias, layer.read_norm.weight), (layer.rg.weight, None,
                                                                               layer.read_norm.weight)]
        return parts

    def folded(self) -> Folded:
        """rms(x, w) W^T = (x / rms(x)) (W diag(w))^T: each state's projections as one matrix."""

        def stack(parts):
            W = torch.cat([w * g for w, _, g in parts], 0)
            b = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b, _ in parts])
            return W, b, [w.shape[0] for w, _, _ in parts]

        g = self.fuse_gate
        first = self._layer_parts(self.layers[0])
        w = self.write
        if w is not None:
            first += [(w.v.weight, None, w.norm.weight), (w.beta.weight, None, w.norm.weight),
                      (w.a.weight, w.dt_bias, w.norm.weight)]
        W0, b0, sizes_first = stack(first)
        later, sizes_later = [], []
        for layer in self.layers[1:]:
            W, b, sizes_later = stack(self._layer_parts(layer))
            later.append((W, b))
        mem = self.write is not None
        outs = [layer.o.weight * layer.out_norm.weight for layer in self.layers] if mem else []
        downs = [layer.w2.weight for layer in self.layers]
        return Folded((g.proj.weight * g.norm.weight, g.proj.bias), (W0, b0), later, sizes_first, sizes_later, outs,
                      downs, -torch.exp(w.A_log) if mem else None, (w.k.weight * w.norm.weight, w.k.bias) if mem else None)

    def _folded_for(self, grad: bool) -> Folded:
        """The folded matrices; without autograd, kept between calls while no parameter changed (decode
        folds once, not once per token). A forward with autograd drops them: fused optimizers update
        parameters in place without bumping their version counters, so the key alone would go stale
        across training steps."""
        if grad:
            self._folded_cache = None
            return self.folded()
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        cached = getattr(self, "_folded_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():  # plain tensors, never a Parameter (a bias passes through unfolded): as the
                folded = self.folded()  # training forward's segments see them, so a compiled step has one graph
                cached = (key, folded.with_tensors([t.detach() for t in folded.tensors()]))
            self._folded_cache = cached
        return cached[1]

    # -- one step ----------------------------------------------------------------------------------
    def new_state(self, batch_size: int) -> list[Tensor]:
        """[the last s^g / rms(s^g), M, s^p], zeros: the window start, and the whole decode cache (bare GPN,
        which writes no memory, keeps no s^g: an empty one)."""
        cfg, p = self.cfg, self.fuse.weight
        B, d, H = batch_size, cfg.d_state, cfg.mem_heads
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32  # the state stays fp32 under bf16
        z = lambda *shape: torch.zeros(*shape, device=p.device, dtype=dtype)  # noqa: E731
        return [z(B, d if H else 0), z(B, H, cfg.d_key, cfg.d_value), z(B, d)]

    def _query(self, zq: Tensor) -> Tensor:
        """A predict sub-layer's memory query [B, H, d_k] from its projection."""
        return _unit(F.relu(zq).unflatten(-1, (self.cfg.mem_heads, self.cfg.d_key)))

    def _predict(self, i: int, s: Tensor, z: list[Tensor], M: Tensor | None, W: Folded, probe: dict | None, mm,
                 o: Tensor | None = None) -> Tensor:
        """Predict sub-layer i from its projections z = [a | b, gate, (q, rg)] of s; mm: the step's products
        (_product); `o`: its memory read when already made (the first sub-layer's, fused with the write)."""
        cfg = self.cfg
        F_ = cfg.d_ffn
        ab, pg = z[0], z[1]
        ffn = mm(f"down{i}", F.silu(ab[..., :F_]) * ab[..., F_:], W.downs[i])
        out = torch.addcmul(ffn, torch.sigmoid(pg), s)  # Gate_p(s) * s + FFN(s)
        if M is not None:
            if o is None:
                with _state_precision(M):
                    o = memory_read(M, self._query(z[2]).to(M.dtype))
            o = o.flatten(-2)
            mem = mm(f"out{i}", F.silu(z[3]) * _hat(o, cfg.norm_eps).to(z[3].dtype), W.outs[i])
            if probe is not None:
                probe["mem_effect"].append((mem.norm(dim=-1) / out.norm(dim=-1).clamp(min=1e-12)).mean())
                probe["mem_cos"].append(F.cosine_similarity(out, out + mem, dim=-1).mean())
            out = out + mem
        if probe is not None:
            probe["predict_gate"].append(torch.sigmoid(pg).mean())
        return out

    def iterate(self, state: list[Tensor], g: Tensor, W: Folded, probe: dict | None = None,
                cut: bool = False, taps: dict[str, Tensor] | None = None):
        """One token: ground g (its hoisted fuse projection) into the state, write, predict; the new state.
        `cut`: a truncated BPTT boundary (spec A10) after the ground, where the carried state (s^g, the previous
        s^g, M) is detached. `taps`: the products' zero taps (_product); then (the new state, the products'
        inputs by name)."""
        cfg, eps = self.cfg, self.cfg.norm_eps
        kept: dict[str, Tensor] = {}
        mm = lambda name, x, *Wb: _product(taps, kept, name, x, *Wb)  # noqa: E731
        hg_prev, M, sp = state  # hg_prev: the previous s^g / rms (the key's source, normalised once)
        fg = torch.sigmoid(mm("fuse_gate", _hat(sp, eps), *W.fuse_gate))
        sg = torch.addcmul(g, fg, sp)  # ground: Gate_f(s^p) * s^p + G_t
        if cut:
            sg, hg_prev, M = sg.detach(), hg_prev.detach(), M.detach()
        hg = _hat(sg, eps)
        z = mm("first", hg, *W.first).split(W.sizes_first, -1)
        if self.write is not None:
            H, dk = cfg.mem_heads, cfg.d_key
            v, beta, a = z[4], z[5], z[6]  # a: W_a u + dt_bias (folded)
            k = _unit(F.relu(mm("key", hg_prev, *W.key)).unflatten(-1, (H, dk)))
            q = self._query(z[2])  # the first predict sub-layer's read follows the write at once
            with _state_precision(M):  # the memory in the state's precision (fp32) under bf16 autocast
                alpha = torch.exp(W.neg_A * F.softplus(a.to(M.dtype)))
                M, o = memory_step(M, k.to(M.dtype), v.unflatten(-1, (H, cfg.d_value)).to(M.dtype),
                                   torch.sigmoid(beta).to(M.dtype), alpha, q.to(M.dtype))
            if probe is not None:
                probe["alpha"].append(alpha.mean())
                probe["mem_norm"].append(M.flatten(1).norm(dim=-1).mean())
            hg_prev = hg  # the next write's key source
        s = self._predict(0, sg, list(z[:4]), M if self.write is not None else None, W, probe, mm,
                          o if self.write is not None else None)
        for i, Wl in enumerate(W.later, 1):
            zl = mm(f"later{i}", _hat(s, eps), *Wl).split(W.sizes_later, -1)
            s = self._predict(i, s, list(zl), M, W, probe, mm)
        if probe is not None:
            probe["fuse_gate"].append(fg.mean())
        new = [hg_prev, M, s.to(sp.dtype)]
        return new if taps is None else (new, kept)

    # -- the window ----------------------------------------------------------------------------------
    def _run(self, state: list[Tensor], G: Tensor, W: Folded, keep: Tensor | None, cut: bool = False,
             taps: dict[str, Tensor] | None = None) -> tuple[Tensor, list[Tensor], dict[str, Tensor] | None]:
        """Steps over G [B, n, d] from `state`: every s^p [B, n, d], the last state and, with `taps` (name:
        [n, B, width out], _product's for each step), the tapped products' inputs by name, [n, B, width in]. keep [B,
        n]: 0 where the state is zeroed before the step (a document start under model.reset_at_documents);
        `cut`: the first step holds a truncated BPTT boundary."""
        out, kept = [], []
        if not torch.is_grad_enabled():
            W = W.cast_for_loop(G)
        # time first, one copy: each step's g is then contiguous whatever the segment's length and whether G
        # is a slice of the window or a captured region's buffer, so a compiled step keeps one graph; one unbind,
        # whose backward stacks the steps' gradients once (indexing per step adds a zero gradient of all of them)
        Gt = G.transpose(0, 1).contiguous().unbind(0)
        steps = {k: v.unbind(0) for k, v in taps.items()} if taps is not None else None
        for t in range(G.shape[1]):
            if keep is not None:
                state = _kept(state, keep[:, t])
            if taps is None:
                state = self.iterate(state, Gt[t], W, cut=cut and t == 0)
            else:
                state, step_inputs = self.iterate(state, Gt[t], W, cut=cut and t == 0,
                                                  taps={k: v[t] for k, v in steps.items()})
                kept.append(step_inputs)
            out.append(state[2])
        inputs = {k: torch.stack([x[k] for x in kept]) for k in taps} if taps is not None else None
        return torch.stack(out, 1), state, inputs

    def states(self, tokens: Tensor, doc_ids: Tensor | None = None, state: list[Tensor] | None = None,
               probe: dict | None = None) -> tuple[Tensor, list[Tensor]]:
        """s^p after each token [B, T, d] (what predicts the next token) and the last state, from `state`
        (zeros when None): the hoisted fuse, then the loop by segments."""
        cfg = self.cfg
        B, T = tokens.shape
        state = state if state is not None else self.new_state(B)
        G = self.fuse(self.fuse_norm(self.embed(tokens))).to(state[2].dtype)
        W = self._folded_for(torch.is_grad_enabled())
        keep = None
        if cfg.reset_at_documents and doc_ids is not None:
            keep = torch.ones(B, T, dtype=G.dtype, device=G.device)
            keep[:, 1:] = (doc_ids[:, 1:] == doc_ids[:, :-1]).to(G.dtype)
        bounds, cuts = cfg.segments(T)
        # the segments' slices of G by one split, whose backward joins their gradients once (a slice each
        # would add a zero gradient of the whole window per segment)
        Gs = G.split([e - s for s, e in bounds], 1)
        out = []
        for (s, e), G_seg in zip(bounds, Gs):
            seg_keep = keep[:, s:e] if keep is not None else None
            if probe is not None:  # the diagnostics: the segment's first step once more, without gradient
                with torch.no_grad():  # the class's step: a compiled one (train.compile) keeps its one graph
                    GPN.iterate(self, state, G[:, s], W, probe)
            if self.segment_recompute and torch.is_grad_enabled():
                sp, *state = _Segment.apply(self, W, len(state), seg_keep, s in cuts, *state, G_seg, *W.tensors())
            else:
                sp, state, _ = self._run(state, G_seg, W, seg_keep, s in cuts)
            out.append(sp)
        return torch.cat(out, 1), state

    def decode(self, sp: Tensor) -> Tensor:
        """s^p -> the tied head's input (rms(s^p) W_dproj + b_dec), width E."""
        h = self.dproj(self.dec_norm(sp).to(self.dproj.weight.dtype))
        return h + self.dec_bias if self.dec_bias is not None else h

    def forward(self, batch, ctx=EVAL) -> tuple[Tensor, dict]:
        cfg = self.cfg
        probe = {k: [] for k in ("fuse_gate", "predict_gate", "alpha", "mem_norm", "mem_effect", "mem_cos")}
        if cfg.position0 == "context":
            sp, _ = self.states(batch.tokens, batch.doc_ids, probe=probe)
            targets, mask = batch.labels, batch.loss_mask
        else:  # the code's window: token t predicted from tokens < t, position 0 from the zero state
            sp, _ = self.states(batch.tokens[:, :-1], batch.doc_ids[:, :-1], probe=probe)
            sp = torch.cat([torch.zeros_like(sp[:, :1]), sp], 1)
            if cfg.reset_at_documents:  # a document's first token is predicted from the zero state
                start = torch.ones_like(batch.doc_ids, dtype=torch.bool)
                start[:, 1:] = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
                sp = sp.masked_fill(start[..., None], 0.0)
            # target t: the label of position t - 1 (the token itself in text), position 0's own token
            targets = torch.cat([batch.tokens[:, :1], batch.labels[:, :-1]], 1)
            mask = torch.cat([torch.ones_like(batch.loss_mask[:, :1]), batch.loss_mask[:, :-1]], 1)
        loss = self.head.loss(self.decode(sp), targets, mask)
        diag = {k: torch.stack(v).mean().detach() for k, v in probe.items() if v}
        diag["state_norm"] = sp.detach().norm(dim=-1).mean()
        return loss, diag

    def _documents(self, tokens: Tensor) -> Tensor | None:
        """Documents as the data path numbers them (a new one after each EOS), where the state resets at them."""
        return doc_ids_of(tokens, self.cfg.eos_id) if self.cfg.reset_at_documents else None

    def logits(self, tokens: Tensor) -> Tensor:
        """Next-token logits after each token [B, T, V] (float32; float64 in float64)."""
        return self.head.logits(self.decode(self.states(tokens, self._documents(tokens))[0]))

    def step(self, tokens: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """Streaming: the same iteration, token by token, from the carried state, which is updated in place
        (like a decoder's KV cache) and returned. Under model.reset_at_documents a row whose last token is
        EOS leaves a zero state (what training's reset gives the next document's first step)."""
        sp, new = self.states(tokens, self._documents(tokens), state=state)
        if self.cfg.reset_at_documents:
            new = _kept(new, (tokens[:, -1] != self.cfg.eos_id).to(new[2].dtype))
        state[:] = new
        return self.head.logits(self.decode(sp)), state


# -- counts, FLOPs, registration --------------------------------------------------------------------
def parameter_counts(cfg: GPNConfig) -> dict[str, int]:
    """Spec §2.9: the total, and the parameters used inside the time loop."""
    V, E, d, F_, H, dk, dv = cfg.vocab_size, cfg.d_emb, cfg.d_state, cfg.d_ffn, cfg.mem_heads, cfg.d_key, cfg.d_value
    gate = d + d * d + d
    write = (d + d * H * dk + H * dk + d * H * dv + 2 * d * H + 2 * H) if H else 0
    read = (d + d * H * dk + H * dk + d * H * dv + H * dv + H * dv * d) if H else 0
    layer = d + 2 * d * F_ + F_ * d + gate + read
    loop = gate + write + cfg.n_layers * layer
    outside = V * E + E + E * d + d + d * E + (E if cfg.decoder_bias else 0)
    return {"total": loop + outside, "loop": loop, "memory_cells": H * dk * dv,
            "state_numbers": (2 * d if H else d) + H * dk * dv}  # s^g and s^p (the previous s^g: the key's), M


def bptt_bytes(cfg: GPNConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """BPTT's activation bytes for `batch` windows of seq_len in fp32. With recompute "none", what autograd
    keeps per step (about (1 + L) memories, for the write's and each read's backward, and some tens of
    state-wide vectors, the window's own [T, d] tensors among them: a fit to the saved tensors, checked by
    tests/test_gpn.py) times T. With segment recomputation, the loop's backward: the T/S segment-start states,
    one live segment of S steps (about (1/2 + L) memories a step), two [T, d] (G, the gradient of s^p) and,
    whatever the batch, the folded matrices three times (their values, their summed gradients and one
    segment's); a fit to the peaks of 22 shapes (tests/test_plan.py checks some)."""
    n = parameter_counts(cfg)
    H, L, d = cfg.mem_heads, cfg.n_layers, cfg.d_state
    vectors = 14 * d + 4 * cfg.d_ffn * L + 3 * H * (cfg.d_key + cfg.d_value)
    if recompute == "none":
        return 4 * batch * seq_len * ((1 + L) * n["memory_cells"] + vectors)
    S = cfg.segment_for(seq_len)
    floats = _start_states(cfg, seq_len) + S * ((0.5 + L) * n["memory_cells"] + vectors) + 2 * seq_len * d
    return int(4 * (batch * floats + 3 * folded_numbers(cfg)))


def _start_states(cfg: GPNConfig, seq_len: int) -> int:
    """The numbers a window's segment-start states hold (each segment's node keeps its own) under recompute."""
    return -(-seq_len // cfg.segment_for(seq_len)) * parameter_counts(cfg)["state_numbers"]


def folded_numbers(cfg: GPNConfig) -> int:
    """How many numbers GPN.folded() holds: the fused gate's matrix and bias, layer 0's stacked projections (with
    the write's) and the later layers', each with its bias row (zeros where a projection has none), the read-outs
    W_o, the FFNs' W_2, and the write's decay rate and key projection."""
    d, F_, H, dk, dv, L = cfg.d_state, cfg.d_ffn, cfg.mem_heads, cfg.d_key, cfg.d_value, cfg.n_layers
    read = H * dk + H * dv if H else 0  # W_q, W_rg
    rows_first = 2 * F_ + d + read + (H * dv + 2 * H if H else 0)  # + W_v, W_beta, W_a
    rows_later = 2 * F_ + d + read
    mem = L * d * H * dv + H + H * dk * (d + 1) if H else 0  # W_o per layer, -exp(A_log), W_k and its bias
    return d * (d + 1) + rows_first * (d + 1) + (L - 1) * rows_later * (d + 1) + L * d * F_ + mem


def captured_bytes(cfg: GPNConfig, seq_len: int, batch: int) -> int:
    """The static buffers of GPN's captured segments (train.cuda_graphs, under parallel.recompute=full;
    kernels/captured.py), fp32, for `batch` windows of seq_len tokens: each body's inputs and outputs, shared
    by every segment of one length. The forward reads the start state, the segment's G and the folded
    matrices and writes s^p over the segment and the end state; the backward reads what the forward read
    plus the outputs' gradients and writes the gradients of the state (where some segment after the first
    starts off a truncation cut), of G (where a step of the segment follows its cut) and of every matrix.
    So: the state 5 times (4 without such a segment), the matrices 3 times, and per distinct segment length
    n 5 [B, n, d] (4 for a length only a one-step segment at a cut has; 2 [B, n] more for the document
    resets' keep). tests/test_captured.py checks it against the emulated backend's buffers; on the H200 they
    were 2,786 MiB at gpn-m-130m's 128 x 2,048."""
    T = seq_len - 1 if cfg.position0 == "uniform" else seq_len  # the code's window: position 0 from zeros
    bounds, cuts = cfg.segments(T)
    lengths = {e - s for s, e in bounds}
    with_dG = {e - s for s, e in bounds if s not in cuts or e - s > 1}  # a cut's own step: no gradient to G
    state = parameter_counts(cfg)["state_numbers"]
    state_grad = any(s > 0 and s not in cuts for s, _ in bounds)
    per_step = sum(lengths) * (4 * cfg.d_state + (2 if cfg.reset_at_documents else 0)) + sum(with_dG) * cfg.d_state
    return 4 * (batch * ((4 + state_grad) * state + per_step) + 3 * folded_numbers(cfg))


def activation_bytes(cfg: GPNConfig, seq_len: int, batch: int, recompute: str = "none") -> int:
    """The planner's peak (its registry `activation_bytes`), within 15% of tests/test_plan.py's measured peak.
    The tied head keeps the fp32 logits and adds their gradient and softmax in the backward (3 V numbers per
    position); under model.loss_chunk, one chunk's logits and the gradient of the head's input (kernels/lm_loss's
    memory_columns; the paper configs chunk: without it, 128 windows of 2,048 would need 94 GiB for the head
    alone). Without recompute they add to BPTT's bytes. Under segment recomputation the peak is the larger of
    two moments: the loss's backward (the head's columns, the segment-start states, four [T, d] and three
    [T, E] of the window around the loop: G, s^p, the decoder's and the fuse's norms; the folded matrices once)
    and the loop's backward (bptt_bytes), which begins after the head's columns are freed. At gpn-m-130m's
    128 x 2,048 (bf16) the planner said 33.7 GiB where the H200 measured 45.7, before the [T, d] terms and
    the captured buffers were counted."""
    kept, peak = memory_columns(cfg.vocab_size, cfg.d_emb, batch * seq_len, cfg.loss_chunk)
    head = 4 * batch * seq_len * (kept + peak)
    loop = bptt_bytes(cfg, seq_len, batch, recompute)
    if recompute == "none":
        return loop + int(head)
    around = seq_len * (4 * cfg.d_state + 3 * cfg.d_emb)
    return max(loop, int(head + 4 * (batch * (_start_states(cfg, seq_len) + around) + folded_numbers(cfg))))


def flops_per_token(cfg: GPNConfig, seq_len: int, ctx=None) -> float:
    n = parameter_counts(cfg)
    H, dk, dv = cfg.mem_heads, cfg.d_key, cfg.d_value
    matmul = n["total"]  # the embedding is a lookup, but the tied head multiplies by the same V x E once
    memory_ops = (4 * H * dk * dv + cfg.n_layers * 2 * H * dk * dv) if H else 0  # write (erase + update), reads
    return 6.0 * matmul + 3.0 * memory_ops


def serial_loop(cfg: GPNConfig, seq_len: int) -> tuple[int, float]:
    """GPN's state advances one token at a time: T dependent steps (all layers inside each); everything
    but the embedding, the projections around the loop and the head runs inside them."""
    n = parameter_counts(cfg)
    return seq_len, flops_per_token(cfg, seq_len) - 6.0 * (n["total"] - n["loop"])


FLOPS_FORMULA = ("6 * N + 3 * (4 + 2 L) H d_k d_v: every parameter in one multiply-add per token, forward and "
                 "backward (N the total: the tied head V x E once, the loop's matrices once per step), and the "
                 "memory's write (erase and update) and L reads per step; segment recomputation's extra forward "
                 "(about a third more of the loop) is not counted, as with activation recompute elsewhere")


def info(cfg: GPNConfig) -> list[str]:
    n = parameter_counts(cfg)
    state_bytes = 4 * n["state_numbers"]
    T = 2048
    shared = bptt_bytes(cfg, T, 0, "full")  # the folded matrices, their gradients: whatever the batch
    none, full = bptt_bytes(cfg, T, 1, "none"), bptt_bytes(cfg, T, 1, "full") - shared
    return [f"inside the time loop: {n['loop']:,} parameters ({n['loop'] / n['total']:.0%}); the rest (embedding, "
            "fuse, decode) runs once over the window",
            f"decode state: {n['state_numbers']:,} numbers per sequence, {state_bytes:,} bytes in fp32 (memory "
            f"{n['memory_cells']:,} cells), whatever the context length",
            f"BPTT activations per sequence (estimate): {none / T / 2**20:,.2f} MB per token with parallel.recompute=none "
            f"({none / 2**30:,.2f} GB at a {T:,}-token window); {full / 2**20:,.0f} MB at {T:,} with "
            f"parallel.recompute=full (segments of {cfg.segment_for(T)}), and {shared / 2**20:,.0f} MB for the loop's "
            "matrices and their gradients whatever the batch"]


def _recompute_segments(model: GPN) -> None:
    model.segment_recompute = True


SPEC = register(ArchSpec(
    name="gpn",
    config_cls=GPNConfig,
    build=GPN,
    flops_per_token=flops_per_token,
    flops_formula=FLOPS_FORMULA,
    info=info,
    activation_bytes=activation_bytes,
    captured_bytes=captured_bytes,
    # the state and memory stay fp32 and autocast keeps bf16 copies beside them (CPU autocast: 2.3-2.9x the fp32
    # peak); recomputed segments keep only their fp32 inputs (0.87-0.92x)
    bf16_kept=lambda recompute: 2.5 if recompute == "none" else 0.9,
    serial_loop=serial_loop,
    decode=DecodeRelation("exact"),
    progress=("mem_effect",),
    hf=RemoteAdapter("gpn"),  # --format hf: remote code generated from this file (pretrain/hf_remote)
    supports=Support(tp=False, sp=False, reasons={
        "tp": "each of the window's steps would need at least two all-reduces inside the sequential loop (thousands of "
              "latency-bound collectives per window), and the paper's 15 memory heads divide by no TP size "
              "(spec §5.2, A20)",
        "sp": "the recurrence is nonlinear in the state: a slice of the sequence cannot start before the previous "
              "slice's last state exists (spec §2.11)",
        "pp": "the last predict sub-layer at step t feeds the ground of step t+1: stages would run one after another "
              "for every token (spec §5.2)"}),
    recompute_units={"segments": Recompute(configure=_recompute_segments)},
    captured_regions=lambda run: ("GPN's BPTT segments (forward and backward)", None)
    if run.parallel.recompute != "none" else (None, "parallel.recompute=none differentiates the window as one graph; "
                                              "its segments are regions under parallel.recompute=full"),
    plan_shape=lambda cfg: (cfg.d_state, cfg.n_layers),  # the time loop's matmuls are d wide
))
