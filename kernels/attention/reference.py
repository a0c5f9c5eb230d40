"""Reference attention: the definition every fast path is tested against.

Deliberately naive and independent of torch's SDPA: explicit scores, the mask's predicate evaluated
densely (kernels/attention/masks.py), an explicit softmax. It computes in the input dtype, so float64
inputs give a float64 answer that the fast paths are compared with.

Shapes follow SDPA: q [B, H, Tq, Dh], k and v [B, H_kv, Tk, Dh], where grouped-query attention (GQA)
has fewer key/value heads than query heads (H_kv dividing H): query head h reads key/value head
h // (H / H_kv), the Llama / Hugging Face convention (k and v repeat_interleave'd over heads).

Queries sit at absolute positions offset .. offset+Tq-1 (offset > 0 in streaming decode, after that
many cached tokens), keys at 0 .. Tk-1; query i attends to key j where mask.mask_mod(b, h, offset+i, j)
holds. A query that sees no key gets a zero output (FlexAttention's convention) instead of NaN.

ALiBi (`alibi_slopes` [H], per query head) adds -slope_h * |q_idx - kv_idx| to the scores.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.masks import Mask, decoder_mask


def check_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """The number of query heads sharing each key/value head (1 without GQA)."""
    H, H_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != H_kv or H_kv < 1 or H % H_kv:
        raise ValueError(f"attention: key and value heads ({H_kv}, {v.shape[-3]}) must be equal and divide the "
                         f"{H} query heads")
    return H // H_kv


def alibi_bias(slopes: Tensor, Tq: int, Tk: int, offset: int = 0) -> Tensor:
    """[1, H, Tq, Tk] score bias -slope_h * |q_idx - kv_idx| (queries at offset .. offset+Tq-1)."""
    q = torch.arange(offset, offset + Tq, device=slopes.device)
    kv = torch.arange(Tk, device=slopes.device)
    distance = (q[:, None] - kv[None, :]).abs().to(slopes.dtype)
    return -slopes.view(1, -1, 1, 1) * distance


def allowed_mask(Tq: int, Tk: int, offset: int = 0, doc_ids: Tensor | None = None,
                 device: torch.device | str | None = None, window: int | None = None) -> Tensor:
    """Boolean [B or 1, 1, Tq, Tk], True where query i may attend to key j, of a causal decoder
    (masks.decoder_mask's predicate evaluated densely)."""
    B = 1 if doc_ids is None else doc_ids.shape[0]
    return decoder_mask(doc_ids, window).evaluate(B, 1, Tq, Tk, offset, device)


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """Boolean [B, 1, T, T] mask, True where attention is allowed (causal and same document)."""
    T = doc_ids.shape[-1]
    return allowed_mask(T, T, 0, doc_ids)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Tensor:
    """softmax(q k^T * scale + bias, masked) v, [B, H, Tq, Dh] -> [B, H, Tq, Dh]; scale defaults to
    1/sqrt(Dh); dropout_p drops probabilities (inverted dropout, as SDPA's)."""
    group = check_heads(q, k, v)
    if group > 1:  # GQA by definition: each key/value head serves `group` consecutive query heads
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, H, Tq, _ = q.shape
    Tk = k.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * scale
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), Tq, Tk, offset)
    scores = scores.masked_fill(~mask.evaluate(B, H, Tq, Tk, offset, q.device), float("-inf"))
    # Subtracting the row max keeps exp from overflowing; the softmax does not depend on it, so it is
    # detached (its true gradient is zero, and amax's backward would only add rounding noise). A row
    # that sees no key has max -inf: it subtracts 0 instead, its weights are all 0, and so is its output.
    top = scores.amax(-1, keepdim=True).detach()
    weights = (scores - top.masked_fill(top == float("-inf"), 0.0)).exp()
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    if dropout_p:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return weights @ v
