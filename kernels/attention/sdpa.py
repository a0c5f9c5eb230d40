"""Attention through torch's scaled_dot_product_attention, the fast path on CPU and GPU.

Without doc_ids SDPA's own causal flag is used, which lets it pick the flash / memory-efficient
kernels. With doc_ids (or a query offset in decode) an explicit boolean mask is passed instead.
A sample that holds a single document needs no mask either, but checking that would cost a device
sync per call, so the mask is used whenever doc_ids is passed.

These calls are exactly the ones the models made before this module existed, so training losses and
decoded tokens are bit-identical to that code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Causal attention [B, H, T, Dh] -> [B, H, T, Dh]; documents isolated when doc_ids [B, T] is given."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same_doc & causal)[:, None], scale=scale)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float | None = None) -> Tensor:
    """Queries [B, H, Tq, Dh] after `offset` cached tokens, keys and values [B, H, offset+Tq, Dh].

    SDPA's is_causal aligns the mask to the top-left corner, which is wrong once Tq < Tk, so the
    mask is explicit: query i sees keys 0 .. offset+i (tril shifted right by offset).
    """
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_(offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
