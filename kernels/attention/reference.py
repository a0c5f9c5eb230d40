"""Reference causal attention, optionally restricted to tokens of the same document.

This is the definition the fast kernels are tested against. Shapes follow SDPA: q, k, v are
[B, H, T, Dh]. `doc_ids` [B, T] numbers the documents packed into each sample; with it, token t
attends to token s only when s <= t and doc_ids[s] == doc_ids[t].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """Boolean [B, 1, T, T] mask, True where attention is allowed (causal and same document)."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Causal softmax attention [B, H, T, Dh] -> [B, H, T, Dh]; documents isolated when doc_ids is given.

    Without doc_ids this is SDPA's own causal path (flash / memory-efficient kernels when available).
    A sample that holds a single document needs no mask either, but checking that would cost a
    device sync per call, so an explicit mask is used whenever doc_ids is passed.
    """
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids), scale=scale)
