"""Reference causal attention: the definition every fast path is tested against.

Deliberately naive and independent of torch's SDPA: explicit scores, an explicit boolean mask, an
explicit softmax. It computes in the input dtype, so float64 inputs give a float64 answer that the
fast paths are compared with.

Shapes follow SDPA: q [B, H, Tq, Dh], k and v [B, H_kv, Tk, Dh], where grouped-query attention (GQA)
has fewer key/value heads than query heads (H_kv dividing H): query head h reads key/value head
h // (H / H_kv), the Llama / Hugging Face convention (k and v repeat_interleave'd over heads).

Queries sit at absolute positions offset .. offset+Tq-1 (offset > 0 in streaming decode, after that
many cached tokens), keys at 0 .. Tk-1. Query i attends to key j when j <= offset + i, when
j > offset + i - window if a sliding `window` is given (it counts the keys a query sees, itself
included), and, if `doc_ids` [B, Tk] is given, when both tokens belong to the same document of the
packed sample.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"attention window={window} must be at least 1 (it counts the query's own key)")


def check_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """The number of query heads sharing each key/value head (1 without GQA)."""
    H, H_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != H_kv or H_kv < 1 or H % H_kv:
        raise ValueError(f"attention: key and value heads ({H_kv}, {v.shape[-3]}) must be equal and divide the "
                         f"{H} query heads")
    return H // H_kv


def allowed_mask(Tq: int, Tk: int, offset: int = 0, doc_ids: Tensor | None = None,
                 device: torch.device | str | None = None, window: int | None = None) -> Tensor:
    """Boolean [B or 1, 1, Tq, Tk] mask, True where query i may attend to key j."""
    check_window(window)
    if doc_ids is not None:
        device = doc_ids.device
    q_pos = torch.arange(offset, offset + Tq, device=device)
    k_pos = torch.arange(Tk, device=device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, Tq, Tk]
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)[None]
    if doc_ids is not None:
        q_doc = doc_ids[:, offset : offset + Tq]
        allowed = allowed & (q_doc[:, :, None] == doc_ids[:, None, :])  # [B, Tq, Tk]
    return allowed[:, None]


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """Boolean [B, 1, T, T] mask, True where attention is allowed (causal and same document)."""
    T = doc_ids.shape[-1]
    return allowed_mask(T, T, 0, doc_ids)


def attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, scale: float | None = None,
              offset: int = 0, window: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T * scale, masked) v, [B, H, Tq, Dh] -> [B, H, Tq, Dh]; scale defaults to 1/sqrt(Dh);
    dropout_p drops probabilities (inverted dropout, as SDPA's). k and v may have fewer heads (GQA)."""
    group = check_heads(q, k, v)
    if group > 1:  # GQA by definition: each key/value head serves `group` consecutive query heads
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-2, -1)) * scale
    mask = allowed_mask(q.shape[-2], k.shape[-2], offset, doc_ids, q.device, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    # Subtracting the row max keeps exp from overflowing; the softmax does not depend on it, so it is
    # detached (its true gradient is zero, and amax's backward would only add rounding noise).
    # Every row keeps at least its diagonal key (window >= 1), so no row is all -inf.
    weights = (scores - scores.amax(-1, keepdim=True).detach()).exp()
    weights = weights / weights.sum(-1, keepdim=True)
    if dropout_p:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return weights @ v
