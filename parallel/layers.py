"""The layers through which every model builds its linears, embeddings, norms and loss.

A model never knows how it is split over processes (torchtitan's rule). With no megatron layout
(parallel.mesh) these facades are plain torch modules. When the layout uses megatron-core (TP > 1, or
its layers forced at TP = 1) the same constructors return megatron-core's ColumnParallelLinear,
RowParallelLinear and VocabParallelEmbedding, and the head uses its vocab-parallel cross-entropy.

Models work in [batch, time, features]; megatron's sequence parallelism splits the first dimension,
so under SP the facades transpose to [time, batch, ...] around megatron's calls (views; megatron
makes the copies its collectives need). Between a RowLinear and the next ColumnLinear the activations
are then [B, T / tp, d]: a model must take T from a linear's output, not from its input.

Weights are initialised as the full matrix from the default torch generator and then sliced
(megatron's CPU initialisation), so a model built from one seed is the same model at every TP size.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.norms import at_least_fp32, layer_norm, rms_norm
from parallel.mesh import layout


def trunc_normal_(w: Tensor, std: float, trunc: float) -> Tensor:
    """Fill w from N(0, std^2), drawing every value outside +-trunc * std again until none is (trunc >= 1:
    at most a third is redrawn). Written here rather than nn.init.trunc_normal_, whose method changes between
    releases (an inverse CDF in torch 2.11, this rejection in 2.13): the same seed gives the same weights on
    any torch, as RT's and GPN's golden curves require. Equal to 2.13's values draw for draw."""
    if w.is_meta:  # no storage, nothing to draw
        return w
    with torch.no_grad():
        lo, hi = (w.new_tensor(bound, device="cpu").item() for bound in (-trunc * std, trunc * std))
        w.normal_(0.0, std)
        while True:
            outside = (w < lo) | (w > hi)
            if not outside.any():
                return w
            w.copy_(torch.where(outside, torch.empty_like(w).normal_(0.0, std), w))


def _normal(std: float, trunc: float = 0.0):
    """Initialiser N(0, std^2), truncated at +-trunc * std when trunc > 0 (OLMo's "mitchell" init)."""
    if trunc:
        return lambda w: trunc_normal_(w, std, trunc)
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class ColumnLinear(nn.Linear):
    """y = x W^T with W split by output features under TP (q/k/v, FFN gate and up projections).

    `stacked` > 1 says the output is that many projections side by side (a fused q|k|v): TP then
    splits each of them, so every rank holds whole heads of q, k and v.
    """

    counts_as_embedding = False

    def __new__(cls, *args, **kwargs):
        if layout().megatron_layers:
            return _megatron_linear(cls is RowLinear, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02,
                 stacked: int = 1, trunc: float = 0.0):
        super().__init__(in_features, out_features, bias=bias)
        self.init_std, self.trunc = init_std, trunc
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not hasattr(self, "init_std"):  # nn.Linear.__init__ calls this before init_std exists
            return
        _normal(self.init_std, self.trunc)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class RowLinear(ColumnLinear):
    """y = x W^T with W split by input features under TP (attention output, FFN down projection)."""


class VocabEmbedding(nn.Embedding):
    """Token embedding, split over the vocabulary under TP."""

    counts_as_embedding = True

    def __new__(cls, *args, **kwargs):
        if layout().megatron_layers:
            return _megatron_embedding(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, vocab_size: int, dim: int, init_std: float = 0.02):
        self.init_std = init_std
        super().__init__(vocab_size, dim)

    def reset_parameters(self) -> None:  # one draw from the generator, as under TP
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class NormStats(NamedTuple):
    """A norm's input as its input gradient reads it: xhat, the normalised input (float32, or float64
    kept), and rho = 1 / its scale, [..., 1]; dtype, the input's (that of the gradient returned)."""
    xhat: Tensor
    rho: Tensor
    dtype: torch.dtype

    def at(self, t: int) -> "NormStats":
        """Position t of [B, N, ...] statistics (views)."""
        return NormStats(self.xhat[:, t:t + 1], self.rho[:, t:t + 1], self.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (bf16 statistics are too coarse).

    Under sequence parallelism a norm sees only this rank's slice of the sequence, so its weight's
    gradient is partial: the norm marks its weight `sequence_parallel` (as megatron-core's norms do)
    and the engines sum exactly the marked gradients over the TP group. A parameter acting on
    gathered, replicated activations (a gate after a ColumnLinear, say) must stay unmarked."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        lay = layout()
        if lay.sp and lay.tp > 1:
            self.weight.sequence_parallel = True

    def forward(self, x: Tensor) -> Tensor:  # the formula in kernels/norms (or apex's fused kernel on CUDA)
        return rms_norm(x, self.weight, self.eps)

    def grad_stats(self, x: Tensor) -> "NormStats":
        """What input_grad needs of x: its normalised values and 1 / rms (a custom backward that walks
        positions one at a time computes them for all positions at once, outside its loop)."""
        x32 = at_least_fp32(x)
        rho = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return NormStats(x32 * rho, rho, x.dtype)

    def input_grad(self, x: Tensor | None, dy: Tensor, stats: "NormStats | None" = None) -> Tensor:
        """dL/dx given dL/dy, written out (for a custom backward that differentiates the norm itself), from
        x or its grad_stats: rho (w dy - xhat mean(xhat w dy))."""
        s = stats if stats is not None else self.grad_stats(x)
        gdy = self.weight.to(s.xhat.dtype) * dy.to(s.xhat.dtype)
        return (s.rho * (gdy - s.xhat * (s.xhat * gdy).mean(-1, keepdim=True))).to(s.dtype)


class LayerNorm(nn.Module):
    """(x - mean) / std * weight + bias in float32 (GPT-2's norm; the CRT paper's "LN"); bias=False
    keeps the gain only (OLMo's default). Marks its parameters `sequence_parallel` under SP, like RMSNorm."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        lay = layout()
        if lay.sp and lay.tp > 1:
            for p in self.parameters():
                p.sequence_parallel = True

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def grad_stats(self, x: Tensor) -> "NormStats":
        """What input_grad needs of x (RMSNorm.grad_stats says why it is apart)."""
        x32 = at_least_fp32(x)
        centred = x32 - x32.mean(-1, keepdim=True)
        rho = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return NormStats(centred * rho, rho, x.dtype)

    def input_grad(self, x: Tensor | None, dy: Tensor, stats: "NormStats | None" = None) -> Tensor:
        """dL/dx given dL/dy, written out (for a custom backward that differentiates the norm itself), from
        x or its grad_stats."""
        s = stats if stats is not None else self.grad_stats(x)
        gdy = self.weight.to(s.xhat.dtype) * dy.to(s.xhat.dtype)
        xhat = s.xhat
        return (s.rho * (gdy - gdy.mean(-1, keepdim=True) - xhat * (gdy * xhat).mean(-1, keepdim=True))).to(s.dtype)


def _sequence_split():
    lay = layout()
    return lay if lay.megatron_layers and lay.sp and lay.tp > 1 else None


def gather_sequence(x: Tensor) -> Tensor:
    """The whole sequence [B, T, ...] of activations that sequence parallelism holds as this rank's
    slice [B, T / tp, ...] (identity otherwise). Differentiable: the backward reduce-scatters, so a
    caller that uses only part of the result gets each rank's share of the gradient summed."""
    lay = _sequence_split()
    if lay is None:
        return x
    from megatron.core.tensor_parallel import mappings

    return mappings.gather_from_sequence_parallel_region(x.transpose(0, 1), group=lay.tp_group).transpose(0, 1)


def local_sequence(x: Tensor) -> Tensor:
    """This rank's slice [B, T / tp, ...] of a whole-sequence tensor under sequence parallelism
    (identity otherwise): a plain slice, no communication."""
    lay = _sequence_split()
    if lay is None:
        return x
    n = x.shape[1] // lay.tp
    return x[:, lay.tp_rank * n:(lay.tp_rank + 1) * n]


def shift_right(x: Tensor, reset: Tensor | None = None) -> Tensor:
    """y[:, t] = x[:, t - 1] along the sequence, zero at t = 0 and where `reset` [B, T] (the whole
    sequence) is True: a recurrence's "previous position" (CRT's z_{t-1}).

    Under sequence parallelism x is this rank's slice [B, T / tp, d] and the first position of each
    slice needs the last of the previous rank's: the slices are gathered, shifted, and this rank's
    part taken back. (A one-token halo exchange would move less; the gather reuses megatron's
    differentiable collective.)
    """
    y = F.pad(gather_sequence(x), (0, 0, 1, 0))[:, :-1]
    if reset is not None:
        y = y.masked_fill(reset[..., None], 0.0)
    return local_sequence(y)


def local_heads(n: int) -> slice:
    """The heads (of n, split evenly by TP like a ColumnLinear's output) this rank holds: for per-head
    constants a model builds itself, such as ALiBi slopes."""
    lay = layout()
    per = n // lay.tp
    return slice(lay.tp_rank * per, (lay.tp_rank + 1) * per)


def refuse_under_tp(what: str, why: str) -> None:
    """ValueError in one sentence when a layer that cannot be split is built under tensor parallelism."""
    if layout().tp > 1:
        raise ValueError(f"{what} is not supported under tensor parallelism ({why})")


def replicated_parameter(data: Tensor) -> nn.Parameter:
    """A parameter every tensor-parallel rank holds whole (a gate, blend weights) acting on activations that
    sequence parallelism slices: marked like the norms' weights, so its gradient, partial per slice, is
    summed over the TP group under SP (replicated activations give every rank the whole gradient otherwise)."""
    p = nn.Parameter(data)
    lay = layout()
    if lay.sp and lay.tp > 1:
        p.sequence_parallel = True
    return p


class ReplicatedLinear(nn.Linear):
    """y = x W^T with W whole on every tensor-parallel rank (a low-rank bottleneck every head reads, a
    small projection added to the residual stream); its weight is marked like replicated_parameter's.
    Initialised from the generator as the full matrix, the same on every rank."""

    counts_as_embedding = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02,
                 trunc: float = 0.0):
        super().__init__(in_features, out_features, bias=bias)
        self.init_std, self.trunc = init_std, trunc
        self.reset_parameters()
        lay = layout()
        if lay.sp and lay.tp > 1:
            for p in self.parameters():
                p.sequence_parallel = True

    reset_parameters = ColumnLinear.reset_parameters  # one draw from the generator, none before init_std is set


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients are partial under sequence parallelism, to be summed over the TP
    group: those their layer marked (which a layer does only when built under SP with tp > 1)."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]




class LMHead(nn.Module):
    """Output projection and cross-entropy, fused so that TP can keep the logits vocab-parallel.

    `tied` shares the weight of a VocabEmbedding (the parameter is then counted once).
    """

    counts_as_embedding = True

    def __init__(self, dim: int, vocab_size: int, tied: nn.Module | None = None, init_std: float = 0.02,
                 loss_chunk: int = 0):
        super().__init__()
        self.vocab_size = vocab_size
        self.loss_chunk = loss_chunk  # > 0: the loss chunk positions at a time, no [N, V] logits kept
        lay = layout()
        if tied is not None:
            self.weight = tied.weight
        elif not lay.megatron_layers:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.weight, mean=0.0, std=init_std)
        else:  # the full matrix from the generator, then this rank's rows (as megatron's embedding does)
            full = nn.init.normal_(torch.empty(vocab_size, dim), mean=0.0, std=init_std)
            rows = vocab_size // lay.tp
            self.weight = nn.Parameter(full[lay.tp_rank * rows:(lay.tp_rank + 1) * rows].clone())
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def _local_logits(self, h: Tensor) -> Tensor:
        lay = layout()
        if not lay.megatron_layers:
            return at_least_fp32(F.linear(h, self.weight))
        from megatron.core.tensor_parallel import mappings

        if lay.sp:  # [B, T/tp, d] -> [B, T, d]; the backward reduce-scatters the vocab-partial grads
            h = mappings.gather_from_sequence_parallel_region(h.transpose(0, 1), group=lay.tp_group).transpose(0, 1)
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=lay.tp_group)
        return F.linear(h, self.weight).float()

    def logits(self, h: Tensor) -> Tensor:
        """[..., dim] -> [..., vocab] in float32 (softmax statistics need it under bf16)."""
        logits = self._local_logits(h)
        lay = layout()
        if lay.megatron_layers and lay.tp > 1:
            from megatron.core.tensor_parallel import mappings

            logits = mappings.gather_from_tensor_model_parallel_region(logits, group=lay.tp_group)
        return logits

    def loss(self, h: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> Tensor:
        """Mean cross-entropy over the positions where loss_mask is True (all when None): the kernel op
        lm_loss (kernels/lm_loss: whole logits, or chunked with model.loss_chunk), vocab-parallel
        under megatron's layers."""
        if not layout().megatron_layers:
            from kernels.lm_loss import lm_loss

            return lm_loss(h, self.weight, labels, loss_mask, chunk=self.loss_chunk)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        per_token = vocab_parallel_cross_entropy(self._local_logits(h).contiguous(), labels).reshape(-1)
        if loss_mask is None:
            return per_token.mean()
        mask = loss_mask.reshape(-1).to(per_token.dtype)
        # clamp: a micro batch whose targets are all masked contributes 0, not NaN.
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


# -- megatron-core layers (imported only when a layout uses them) -----------------------------------

def _model_parallel_config():
    from megatron.core import ModelParallelConfig

    lay = layout()
    return ModelParallelConfig(tensor_model_parallel_size=lay.tp, sequence_parallel=lay.sp and lay.tp > 1,
                               use_cpu_initialization=True, perform_initialization=True,
                               gradient_accumulation_fusion=False, params_dtype=torch.float32)


_CLASSES: dict[str, type] = {}


def _megatron_classes() -> dict[str, type]:
    """Subclasses of megatron's layers with our forward signatures (output only; [B, T, ...] layout)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.tensor_parallel import layers as mp

    class TimeMajorUnderSP:
        """megatron's SP gathers/scatters the first dimension: give it [T, B, ...] and take it back."""

        counts_as_embedding = False

        def forward(self, x: Tensor) -> Tensor:
            if not self.sequence_parallel:
                return super().forward(x)[0]
            return super().forward(x.transpose(0, 1))[0].transpose(0, 1)

    class MegatronColumn(TimeMajorUnderSP, mp.ColumnParallelLinear):
        pass

    class MegatronRow(TimeMajorUnderSP, mp.RowParallelLinear):
        pass

    class MegatronEmbedding(mp.VocabParallelEmbedding):
        counts_as_embedding = True

        def forward(self, tokens: Tensor) -> Tensor:
            out = super().forward(tokens)  # under SP: reduce-scattered over time, [T/tp, B, d]
            return out.transpose(0, 1) if self.reduce_scatter_embeddings else out

    _CLASSES.update(column=MegatronColumn, row=MegatronRow, embedding=MegatronEmbedding)
    return _CLASSES


def _megatron_linear(row: bool, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02,
                     stacked: int = 1, trunc: float = 0.0) -> nn.Module:
    lay, classes = layout(), _megatron_classes()
    kw = dict(config=_model_parallel_config(), init_method=_normal(init_std, trunc), bias=bias, tp_group=lay.tp_group)
    if row:
        if stacked != 1:
            raise ValueError("RowLinear does not take `stacked`: its input, not its output, is split")
        return classes["row"](in_features, out_features, input_is_parallel=True, skip_bias_add=False, **kw)
    for name, size in (("output features", out_features), ("stacked blocks", out_features // stacked)):
        if size % lay.tp:
            raise ValueError(f"ColumnLinear: {name} {size} are not divisible by parallel.tp={lay.tp}")
    return classes["column"](in_features, out_features, gather_output=False, stride=stacked, **kw)


def _megatron_embedding(vocab_size: int, dim: int, init_std: float = 0.02) -> nn.Module:
    lay = layout()
    if vocab_size % lay.tp:
        raise ValueError(f"model.vocab_size {vocab_size} is not divisible by parallel.tp={lay.tp}")
    return _megatron_classes()["embedding"](vocab_size, dim, init_method=_normal(init_std),
                                            reduce_scatter_embeddings=lay.sp and lay.tp > 1,
                                            config=_model_parallel_config(), tp_group=lay.tp_group)


def is_tensor_parallel(p: Tensor) -> bool:
    """Whether parameter `p` is split over the TP group (each rank holds a different slice)."""
    return bool(getattr(p, "tensor_model_parallel", False)) and layout().tp > 1
