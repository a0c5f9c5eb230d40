"""Attention masks as values: a mask is a predicate in FlexAttention's `mask_mod` form,

    mask_mod(b, h, q_idx, kv_idx) -> bool      True where query q_idx may attend to key kv_idx

closing over whatever index tensors it needs (document ids, prefix lengths), and masks compose with
`&` and `|`. The predicate is written with tensor operations only, so it evaluates both on scalars
(FlexAttention vmaps it) and densely on broadcast index tensors b [B,1,1,1], h [1,H,1,1],
q [1,1,Tq,1], kv [1,1,1,Tk] (what `evaluate` does and the reference path uses).

Indices are absolute: a query at q_idx = offset + i after `offset` cached tokens (decode uses the same
mask value with an offset), keys at 0 .. Tk-1. The built-ins:

    causal()              kv <= q
    document(doc_ids)     same document of the packed sample (doc_ids [B, T] over every position)
    window(w)             q - kv < w: at most w keys back, the query's own included
    prefix(lengths)       kv < lengths[b]: a bidirectional prefix (prefix LM: causal() | prefix(n))
    full()                every pair (cross-attention to keys that are all visible)

An architecture defines its own in its own file: `Mask(lambda b, h, q, kv: ..., "name")`.

Two more views serve the fast paths: `dense(...)`, the same boolean mask built the fast way where a
built-in knows one (SDPA's explicit mask: tril for causal, an outer comparison for documents), and
`empty_tiles(...)`, which (query block, key block) tiles hold no visible pair, for block-sparse kernels.
The block-sparse kernels read a third view, per key column the runs of queries that see it
(kernels/attention/runs.py): `runs` bounds how many a column holds (None: unknown), and
`closed_runs(...)` builds them without the dense mask where a built-in knows how.
`simplify(Tq, Tk, offset)` drops parts that are true everywhere at this shape (a window wider than the
sequence), so `is_causal(...)` can tell the SDPA path to use its unmasked causal kernels.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _indices(B: int, H: int, Tq: int, Tk: int, offset: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(offset, offset + Tq, device=device).view(1, 1, Tq, 1)
    kv = torch.arange(Tk, device=device).view(1, 1, 1, Tk)
    return b, h, q, kv


class Mask:
    """A mask value: its predicate, a name for messages, and the fast views (overridden by built-ins)."""

    def __init__(self, mask_mod: Predicate, name: str = "custom", device=None, runs: int | None = None):
        self.mask_mod = mask_mod
        self.name = name
        self._views: dict = {}  # cached(): view name -> (key, value)
        self._traced = torch.compiler.is_compiling()  # made inside a compiled graph: its views cached there too
        self.device = device  # of the tensors it closes over (None: none, or CPU-independent)
        if runs is not None:
            self.runs = runs

    # at most this many runs of visible queries per key column (kernels/attention/runs.py); None: unknown
    runs: int | None = None

    def __and__(self, other: "Mask") -> "Mask":
        return And(self, other)

    def __or__(self, other: "Mask") -> "Mask":
        return Or(self, other)

    def __repr__(self) -> str:
        return self.name

    # -- views --------------------------------------------------------------------------------------
    def evaluate(self, B: int, H: int, Tq: int, Tk: int, offset: int = 0, device=None) -> Tensor:
        """The predicate evaluated densely: bool, broadcastable to [B, H, Tq, Tk] (a mask that does
        not read b or h has size 1 there)."""
        allowed = self.mask_mod(*_indices(B, H, Tq, Tk, offset, self.device or device))
        return torch.broadcast_to(allowed, torch.broadcast_shapes(allowed.shape, (1, 1, Tq, Tk)))

    def dense(self, B: int, H: int, Tq: int, Tk: int, offset: int = 0, device=None) -> Tensor:
        """The same values as evaluate(), built the fastest way this mask knows."""
        return self.evaluate(B, H, Tq, Tk, offset, device)

    def always(self, Tq: int, Tk: int, offset: int = 0) -> bool:
        """True when this mask allows every pair at this shape (known without evaluating it)."""
        return False

    def simplify(self, Tq: int, Tk: int, offset: int = 0) -> "Mask":
        return self

    def cached(self, key: tuple, build: Callable[[], object]):
        """build(), kept on this mask value for the next call with the same key (the same view at the same
        shape: every layer of one forward shares it), one entry per view name key[0]. Under torch.compile a
        mask made inside the compiled graph (a whole-model compile) caches there as well, so the graph builds
        each view once, not once per layer (baseline/s: 12 copies of the tile lists' sorts and scans for
        inductor to compile); a mask made outside one (train.compile_scope=blocks) is neither read nor written
        by compiled code, which would otherwise return the views as outputs and compile a second variant of
        the block that reads them. The dict is made in __init__: dynamo in torch 2.11 cannot trace
        `__dict__.setdefault` (fullgraph failed on an H200)."""
        if torch.compiler.is_compiling() and not self._traced:
            return build()
        views = self._views
        hit = views.get(key[0])
        if hit is not None and hit[0] == key:
            return hit[1]
        value = build()
        views[key[0]] = (key, value)
        return value

    def closed_runs(self, B: int, Tq: int, Tk: int, offset: int = 0, device=None) -> Tensor | None:
        """int [B or 1, Tk, 1, 2]: each key column's one run [start, end) of visible query rows (0 .. Tq,
        relative to the first query), where this mask knows it in closed form; None otherwise."""
        return None

    def parts(self) -> tuple["Mask", ...]:
        """The conjuncts of an `&` chain (itself otherwise)."""
        return (self,)

    def empty_tiles(self, Tq: int, Tk: int, block_q: int, block_k: int, offset: int = 0, B: int = 1, H: int = 1,
                    device=None) -> Tensor:
        """bool [B or 1, H or 1, ceil(Tq / block_q), ceil(Tk / block_k)]: True where the tile holds no
        visible pair, so a block-sparse kernel may skip it (padding past Tq, Tk counts as masked)."""
        allowed = self.dense(B, H, Tq, Tk, offset, device)
        pad_q, pad_k = -Tq % block_q, -Tk % block_k
        allowed = F.pad(allowed, (0, pad_k, 0, pad_q), value=False)
        tiles = allowed.unflatten(-1, (-1, block_k)).unflatten(-3, (-1, block_q))  # [.., nq, bq, nk, bk]
        return ~tiles.any(dim=-1).any(dim=-2)


class And(Mask):
    def __init__(self, a: Mask, b: Mask):
        super().__init__(lambda *i: a.mask_mod(*i) & b.mask_mod(*i), f"{a.name} & {b.name}", a.device or b.device)
        self.a, self.b = a, b
        self.runs = None if a.runs is None or b.runs is None else a.runs + b.runs - 1

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        if self.runs != 1:
            return None
        ra, rb = self.a.closed_runs(B, Tq, Tk, offset, device), self.b.closed_runs(B, Tq, Tk, offset, device)
        if ra is None or rb is None:
            return None
        return torch.stack([torch.maximum(ra[..., 0], rb[..., 0]), torch.minimum(ra[..., 1], rb[..., 1])], -1)

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        return self.a.dense(B, H, Tq, Tk, offset, device) & self.b.dense(B, H, Tq, Tk, offset, device)

    def always(self, Tq, Tk, offset=0):
        return self.a.always(Tq, Tk, offset) and self.b.always(Tq, Tk, offset)

    def simplify(self, Tq, Tk, offset=0):
        a, b = self.a.simplify(Tq, Tk, offset), self.b.simplify(Tq, Tk, offset)
        return b if a.always(Tq, Tk, offset) else a if b.always(Tq, Tk, offset) else And(a, b)

    def parts(self):
        return self.a.parts() + self.b.parts()


class Or(Mask):
    def __init__(self, a: Mask, b: Mask):
        super().__init__(lambda *i: a.mask_mod(*i) | b.mask_mod(*i), f"({a.name} | {b.name})", a.device or b.device)
        self.a, self.b = a, b
        self.runs = None if a.runs is None or b.runs is None else a.runs + b.runs

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        return self.a.dense(B, H, Tq, Tk, offset, device) | self.b.dense(B, H, Tq, Tk, offset, device)

    def always(self, Tq, Tk, offset=0):
        return self.a.always(Tq, Tk, offset) or self.b.always(Tq, Tk, offset)


def _band(Tq: int, Tk: int, offset: int, device, back: int | None = None) -> Tensor:
    """[1, 1, Tq, Tk]: query i (at offset + i) sees keys offset+i-back < j <= offset+i (tril/triu,
    the calls the SDPA path has always made)."""
    band = torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril_(offset)
    if back is not None:
        band.triu_(offset - back + 1)
    return band[None, None]


def _run(start: Tensor, end: Tensor, Tq: int) -> Tensor:
    """[B', Tk] bounds -> [B', Tk, 1, 2] runs clamped to the rows 0 .. Tq."""
    return torch.stack([start.clamp(0, Tq), end.clamp(0, Tq)], -1)[:, :, None]


class Causal(Mask):
    runs = 1

    def __init__(self):
        super().__init__(lambda b, h, q, kv: kv <= q, "causal")

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        k = torch.arange(Tk, device=device)[None]
        return _run(k - offset, torch.full_like(k, Tq), Tq)

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        return _band(Tq, Tk, offset, device)


class Window(Mask):
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"attention window={size} must be at least 1 (it counts the query's own key)")
        super().__init__(lambda b, h, q, kv: q - kv < size, f"window({size})")
        self.size = size

    runs = 1

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        k = torch.arange(Tk, device=device)[None]
        return _run(torch.zeros_like(k), k + self.size - offset, Tq)

    def always(self, Tq, Tk, offset=0):
        return offset + Tq - 1 < self.size  # the farthest key, 0, from the last query is within reach

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        band = torch.ones(Tq, Tk, dtype=torch.bool, device=device).triu_(offset - self.size + 1)
        return band[None, None]


class Document(Mask):
    """Packed documents: each document is one contiguous stretch of positions (how packing lays them
    out), so a key column's visible queries are one run, its document's."""
    runs = 1

    def __init__(self, doc_ids: Tensor):
        super().__init__(lambda b, h, q, kv: doc_ids[b, q] == doc_ids[b, kv], "document", doc_ids.device)
        self.doc_ids = doc_ids

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        first, end = document_bounds(self.doc_ids)
        return _run(first[:, :Tk] - offset, end[:, :Tk] - offset, Tq)

    def dense(self, B, H, Tq, Tk, offset=0, device=None):
        d = self.doc_ids
        return (d[:, offset:offset + Tq, None] == d[:, None, :Tk])[:, None]


def document_bounds(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Packed document ids [B, T] -> (first, end) [B, T]: the stretch [first, end) of each position's
    document (documents contiguous)."""
    d = doc_ids
    T = d.shape[-1]
    pos = torch.arange(T, device=d.device).expand_as(d)
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    first = torch.where(new, pos, 0).cummax(-1).values
    last = torch.where(new.roll(-1, -1) | (pos == T - 1), pos, T).flip(-1).cummin(-1).values.flip(-1)
    return first, last + 1


class Full(Mask):
    runs = 1

    def __init__(self):
        super().__init__(lambda b, h, q, kv: torch.ones_like(q - kv, dtype=torch.bool), "full")

    def closed_runs(self, B, Tq, Tk, offset=0, device=None):
        return _run(torch.zeros(1, Tk, dtype=torch.long, device=device), torch.full((1, Tk), Tq, device=device), Tq)

    def always(self, Tq, Tk, offset=0):
        return True


def causal() -> Mask:
    return Causal()


def window(size: int) -> Mask:
    return Window(size)


def document(doc_ids: Tensor) -> Mask:
    return Document(doc_ids)


def prefix(lengths: Tensor) -> Mask:
    """kv < lengths[b] ([B] integer tensor): keys in the sample's first lengths[b] positions."""
    return Mask(lambda b, h, q, kv: kv < lengths[b], "prefix", lengths.device, runs=1)


def full() -> Mask:
    return Full()


def decoder_mask(doc_ids: Tensor | None = None, window_size: int | None = None) -> Mask:
    """The mask of a causal decoder: causal, within documents when doc_ids is given, within a sliding
    window when window_size is given (0 or None: unlimited)."""
    mask = causal()
    if doc_ids is not None:
        mask = mask & document(doc_ids)
    if window_size:
        mask = mask & window(window_size)
    return mask


def is_causal(mask: Mask, Tq: int, Tk: int, offset: int = 0) -> bool:
    """Whether `mask` at this shape is plain causal attention with queries and keys aligned (what
    SDPA's is_causal=True computes): the fast kernels need no mask tensor then."""
    return offset == 0 and Tq == Tk and isinstance(mask.simplify(Tq, Tk, offset), Causal)
