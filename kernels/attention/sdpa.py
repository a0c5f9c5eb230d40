"""Attention through torch's scaled_dot_product_attention, the fast path on CPU and GPU.

When the mask is plain causal attention at this shape (masks.is_causal: a window wider than the
sequence counts as none), SDPA's own causal flag is used, which lets it pick the flash /
memory-efficient kernels. Otherwise the mask's dense view is passed as an explicit boolean mask
(tril, triu and an outer comparison of document ids for the built-ins, the predicate evaluated densely
for any other), with ALiBi as a float bias. A sample that holds a single document needs no mask
either, but checking that would cost a device sync per call, so a document mask is always built.

For the causal and document masks these are exactly the calls the models made before masks became
values, so training losses and decoded tokens are bit-identical to that code. Grouped-query attention
(k and v with fewer heads than q) passes enable_gqa=True, which SDPA defines as the reference's
repeat_interleave over heads (checked on CPU with masks, dropout and backward,
tests/test_attention.py); with equal head counts the flag is False, SDPA's default.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kernels.attention.masks import Mask, is_causal
from kernels.attention.reference import alibi_bias, check_heads


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Tensor:
    """Masked attention [B, H, Tq, Dh] -> [B, H, Tq, Dh], queries at offset .. offset+Tq-1 over keys
    [B, H or H_kv, Tk, Dh]; dropout_p drops attention probabilities (training)."""
    gqa = check_heads(q, k, v) > 1  # checked here too: SDPA's own error does not name the shapes
    B, H, Tq, _ = q.shape
    Tk = k.shape[-2]
    if alibi_slopes is None and is_causal(mask, Tq, Tk, offset):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    allowed = mask.simplify(Tq, Tk, offset).dense(B, H, Tq, Tk, offset, q.device)
    if alibi_slopes is not None:
        allowed = alibi_bias(alibi_slopes.to(q.dtype), Tq, Tk, offset).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, dropout_p=dropout_p,
                                          enable_gqa=gqa)
