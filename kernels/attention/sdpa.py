"""Attention through torch's scaled_dot_product_attention, the fast path on CPU and GPU.

Without doc_ids or a window, SDPA's own causal flag is used, which lets it pick the flash /
memory-efficient kernels. With doc_ids, a sliding window (or a query offset in decode) an explicit
boolean mask is passed instead. A sample that holds a single document needs no mask either, but
checking that would cost a device sync per call, so the mask is used whenever doc_ids is passed.

These calls are exactly the ones the models made before this module existed, so training losses and
decoded tokens are bit-identical to that code. Grouped-query attention (k and v with fewer heads than
q) passes enable_gqa=True, which SDPA defines as the reference's repeat_interleave over heads (checked
on CPU with masks, dropout and backward, tests/test_attention.py); with equal head counts the flag is
False, SDPA's default, so multi-head attention makes the same calls as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention.reference import check_heads, check_window


def _band(Tq: int, Tk: int, offset: int, window: int | None, device: torch.device) -> Tensor:
    """[Tq, Tk] bool: query i (at position offset+i) sees keys offset+i-window < j <= offset+i."""
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril_(offset)
    if window is not None:
        mask.triu_(offset - window + 1)
    return mask


def attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, scale: float | None = None,
              window: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention [B, H, T, Dh] -> [B, H, T, Dh]; documents isolated when doc_ids [B, T] is given;
    each query sees at most `window` keys (itself included) when window is given; dropout_p drops
    attention probabilities (training)."""
    check_window(window)
    gqa = check_heads(q, k, v) > 1  # checked here too: SDPA's own error does not name the shapes
    T = q.shape[-2]
    if window is not None and window >= T:
        window = None  # the band covers the whole triangle: keep the unmasked fast kernels
    if doc_ids is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    mask = _band(T, T, 0, window, q.device)
    if doc_ids is not None:
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & mask
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p,
                                          enable_gqa=gqa)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float | None = None,
                     window: int | None = None) -> Tensor:
    """Queries [B, H, Tq, Dh] after `offset` cached tokens, keys and values [B, H, offset+Tq, Dh].

    SDPA's is_causal aligns the mask to the top-left corner, which is wrong once Tq < Tk, so the
    mask is explicit: query i sees keys 0 .. offset+i (tril shifted right by offset), and with a
    window only the last `window` of them.
    """
    check_window(window)
    gqa = check_heads(q, k, v) > 1
    mask = _band(q.shape[-2], k.shape[-2], offset, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
