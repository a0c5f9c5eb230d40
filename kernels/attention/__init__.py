"""Attention with causal and document masks: the entry points every model calls.

    attention(q, k, v, doc_ids=None, scale=None, window=None)      training and prefill, [B, H, T, Dh]
    cached_attention(q, k, v, offset, scale=None, window=None)     decode: Tq queries after `offset` cached tokens

k and v may have fewer heads than q (grouped-query attention, [B, H_kv, T, Dh] with H_kv dividing H):
query head h reads key/value head h // (H / H_kv), as in Llama and Hugging Face; a head count that does
not divide is a ValueError.

`window` (None = unlimited) is a sliding window: the query at position t sees keys at positions s
with t - window < s <= t, so it counts the keys a query sees, itself included. It combines with the
causal and the document masks.

Each call runs one path: "sdpa" (torch's scaled_dot_product_attention, every device today) or
"reference" (the naive definition in reference.py). Fast kernels (Triton, FlexAttention) plug in
here, are picked when the device supports them, and are tested against the reference.

The path is forced with the environment variable PRETRAIN_ATTENTION=<name> (read once, at import) or
with use_path(name) (tests). paths_used() names every path that has run since reset_paths_used(), so
a trainer or generator can report which one served it.
"""
from __future__ import annotations

import os

from torch import Tensor

from kernels.attention import reference, sdpa
from kernels.attention.reference import document_causal_mask

PATHS = ("sdpa", "reference")


def _checked(name: str | None, source: str) -> str | None:
    if name is not None and name not in PATHS:
        raise ValueError(f"{source}={name!r} is not an attention path; choose one of {', '.join(PATHS)}")
    return name


_forced: str | None = _checked(os.environ.get("PRETRAIN_ATTENTION") or None, "PRETRAIN_ATTENTION")
_used: set[str] = set()


def use_path(name: str | None) -> None:
    """Force every later call onto path `name`; None returns to picking by device."""
    global _forced
    _forced = _checked(name, "use_path")


def paths_used() -> frozenset[str]:
    """Names of the paths that have run since the last reset_paths_used()."""
    return frozenset(_used)


def reset_paths_used() -> None:
    _used.clear()


def _pick(q: Tensor) -> str:
    # Only Python values are read (no tensor data, so no device sync). Under torch.compile these
    # reads happen at trace time and dynamo guards on them: use_path() after compiling recompiles.
    if _forced is not None:
        return _forced
    return "sdpa"  # SDPA runs on every device; a faster kernel goes first here once one exists


def _record(name: str) -> None:
    # A set.add, cheap enough for every call. Inside a compiled region dynamo keeps this mutation of a
    # module-level set as a side effect and replays it after each run of the graph (no graph break,
    # fullgraph=True works), so compiled and eager runs report alike.
    _used.add(name)


def attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, scale: float | None = None,
              window: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention [B, H, T, Dh] -> [B, H, T, Dh]; tokens attend within their document when
    doc_ids [B, T] is given, and to at most `window` keys (themselves included) when window is given;
    scale defaults to 1/sqrt(Dh); dropout_p drops attention probabilities (pass 0 outside training).
    k and v may be [B, H_kv, T, Dh] with H_kv dividing H (grouped-query attention)."""
    name = _pick(q)
    _record(name)
    if name == "reference":
        return reference.attention(q, k, v, doc_ids, scale, window=window, dropout_p=dropout_p)
    return sdpa.attention(q, k, v, doc_ids, scale, window, dropout_p)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float | None = None,
                     window: int | None = None) -> Tensor:
    """Streaming decode: queries [B, H, Tq, Dh] at positions offset .. offset+Tq-1 attend causally to
    keys and values [B, H or H_kv, offset+Tq, Dh] (the cache followed by the new tokens), within the
    last `window` positions when window is given. A caller may keep only the last window-1 cached keys:
    then it passes the offset into that trimmed cache (the mask depends only on relative positions)."""
    name = _pick(q)
    _record(name)
    if name == "reference":
        return reference.attention(q, k, v, None, scale, offset, window)
    return sdpa.cached_attention(q, k, v, offset, scale, window)


__all__ = ["PATHS", "attention", "cached_attention", "document_causal_mask", "paths_used", "reset_paths_used",
           "use_path"]
