"""The attention op's measured choice (kernels/registry.py, Measured): which calls share one, and the
synthetic inputs its paths are timed on.

The key: (mask kind, B, H, H_kv, Tq, Tk, Dh, dtype, whether a backward is needed, device), with B, Tq and
Tk rounded up to powers of two (a prompt of 3,000 tokens shares the measurement of 4,096, so
generation does not measure every prompt length). Only CUDA calls are measured, and of those only
calls without a decode offset (training, evaluation, prefill: a decode step, its cache growing each
step, keeps the static priority), without ALiBi or dropout (SDPA alone serves those), and with a mask
whose kind is known here. Everything is read from Python values (dynamo computes the key at trace
time): no tensor data, no device sync.

A mask's kind is its structure: the built-ins ("causal", ("window", w), "document", "full") and their
`&` and `|`; an architecture's own mask class registers its kind and a stand-in here (SPS's SlotMask,
pretrain/models/sps.py). A mask of unknown kind (a bare predicate, prefix()) is not measured.

The stand-in is a mask of the same kind at the key's shape, built on fresh tensors, never the caller's
(under torch.compile the caller's mask holds traced tensors, and the choice must be the same for eager
and compiled runs). Documents are packed DOC_TOKENS long: shorter documents make the block-sparse
paths faster and leave SDPA's dense-mask time unchanged (it computes every pair), longer ones slower.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

from kernels.attention.masks import And, Causal, Document, Full, Mask, Or, Window, causal, document, full, window

DOC_TOKENS = 1024  # the stand-in's document length (web text documents average about a thousand tokens)

Kind = Callable[[Mask], Hashable | None]  # a mask -> its kind (Python values only); None: unknown
StandIn = Callable[[Hashable, int, int, int, torch.device], Mask | None]  # (kind, B, Tq, Tk, device) -> mask

_KINDS: list[tuple[type, Kind, StandIn]] = []


def register(cls: type, kind: Kind, stand_in: StandIn) -> None:
    """Masks of class `cls` (exactly) are measured: kind(mask) names what decides a path's speed (its
    first element should name the class), stand_in(kind, B, Tq, Tk, device) builds one of that kind."""
    _KINDS.append((cls, kind, stand_in))


def doc_ids(B: int, T: int, device) -> Tensor:
    """[B, T] packed document ids of the stand-ins: documents of DOC_TOKENS tokens."""
    return (torch.arange(T, device=device) // DOC_TOKENS).expand(B, T).contiguous()


def kind(mask: Mask) -> Hashable | None:
    """The kind of a mask (see the module docstring), None when it has none."""
    if type(mask) is And or type(mask) is Or:
        a, b = kind(mask.a), kind(mask.b)
        return None if a is None or b is None else ("&" if type(mask) is And else "|", a, b)
    for cls, of, _ in _KINDS:
        if type(mask) is cls:
            return of(mask)
    return None


def stand_in(kind_: Hashable, B: int, Tq: int, Tk: int, device) -> Mask | None:
    """A mask of this kind at this shape on fresh tensors (None: no class builds it)."""
    if kind_[0] in ("&", "|"):
        a, b = (stand_in(part, B, Tq, Tk, device) for part in kind_[1:])
        if a is None or b is None:
            return None
        return a & b if kind_[0] == "&" else a | b
    for cls, _, build in _KINDS:
        if kind_[0] == cls.__name__:
            return build(kind_, B, Tq, Tk, device)
    return None


register(Causal, lambda m: ("Causal",), lambda k, B, Tq, Tk, dev: causal())
register(Window, lambda m: ("Window", m.size), lambda k, B, Tq, Tk, dev: window(k[1]))
register(Document, lambda m: ("Document",), lambda k, B, Tq, Tk, dev: document(doc_ids(B, max(Tq, Tk), dev)))
register(Full, lambda m: ("Full",), lambda k, B, Tq, Tk, dev: full())


def _up(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _static(n: int) -> int | None:
    """n as a Python int where its value is known without a guard, None for a symbolic size. Under
    torch.compile a size may be symbolic (dynamic shapes), and dynamo answers isinstance(n, int) and
    type(n) is int with True for those too; statically_known_true tells them apart: the smallest m with
    n <= m known, then whether n >= m is known as well (a constant's bounds always are)."""
    if not torch.compiler.is_compiling():
        return n
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    lo, hi = 0, 1
    while not known(n <= hi):
        if hi >= 1 << 40:
            return None
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # known: n <= hi
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if known(n <= mid) else (mid, hi)
    return hi if known(n >= hi) else None


def shape_key(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Hashable | None:
    """The key of a call on any device (key() adds the CUDA check; the tests use this on a CPU)."""
    if offset or dropout_p or alibi_slopes is not None:
        return None
    sizes = [_static(n) for n in (*q.shape, k.shape[1], k.shape[2])]
    if None in sizes:
        return None  # symbolic sizes (dynamic shapes under torch.compile): not measured
    B, H, Tq, Dh, H_kv, Tk = sizes
    mask_kind = kind(mask.simplify(Tq, Tk, 0))
    if mask_kind is None:
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (mask_kind, _up(B), H, H_kv, _up(Tq), _up(Tk), Dh, q.dtype, grad, str(q.device))


def key(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *args, **kwargs) -> Hashable | None:
    """The registry's key: CUDA calls only (a CPU call is never measured: it keeps the static priority)."""
    if not q.is_cuda:
        return None
    return shape_key(q, k, v, mask, *args, **kwargs)


def inputs(key_: Hashable) -> tuple[tuple, dict] | None:
    """Fresh q, k, v (random, requires_grad as the key says, in the models' layout: [B, H, T, Dh] views
    of [B, T, H, Dh]) and the stand-in mask, at the key's shape; from a private generator, so measuring
    draws nothing from the run's random streams."""
    mask_kind, B, H, H_kv, Tq, Tk, Dh, dtype, grad, device = key_
    device = torch.device(device)
    mask = stand_in(mask_kind, B, Tq, Tk, device)
    if mask is None:
        return None
    g = torch.Generator(device=device).manual_seed(0)

    def make(heads: int, T: int) -> Tensor:
        x = torch.randn(B, T, heads, Dh, device=device, dtype=dtype, generator=g).requires_grad_(grad)
        return x.transpose(1, 2)

    return (make(H, Tq), make(H_kv, Tk), make(H_kv, Tk), mask, 0), {}


def _words(kind_: Hashable) -> str:
    if kind_[0] in ("&", "|"):
        return f" {kind_[0]} ".join(_words(part) for part in kind_[1:])
    name = kind_[0].lower()
    return name + (f"({', '.join(map(str, kind_[1:]))})" if len(kind_) > 1 else "")


def describe(key_: Hashable) -> str:
    """"causal & document, B4 H12/12 4096x4096 d64 bfloat16, fwd+bwd" (B, Tq, Tk as measured: rounded up)."""
    mask_kind, B, H, H_kv, Tq, Tk, Dh, dtype, grad, _ = key_
    return (f"{_words(mask_kind)}, B{B} H{H}/{H_kv} {Tq}x{Tk} d{Dh} {str(dtype).removeprefix('torch.')}, "
            f"{'fwd+bwd' if grad else 'fwd'}")
