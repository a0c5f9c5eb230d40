"""The "flash_attn" attention path: the flash-attn package's variable-length kernel for decoder masks.

A causal decoder mask with packed documents and an optional sliding window (masks.decoder_mask) is
what flash_attn_varlen_func computes natively: every document becomes its own sequence, cut out by
cu_seqlens (the cumulative document lengths over the whole batch, read off the document ids), and the
window is its window_size=(w - 1, 0) (w keys back, the query's own included). Grouped-query attention
uses flash-attn's own convention, which is ours (query head h reads key/value head h // (H / H_kv)).

Capable when `flash_attn` imports (looked up once, at import: a machine without it pays nothing per
call and hears nothing), on CUDA, in bf16 or fp16, for training and prefill (queries and keys aligned,
no decode offset), with the mask an `&` of causal, at most one document mask and at most one window, no
ALiBi. Attention dropout is passed through. The mask's cut points cost one host sync per mask value
(max_seqlen is a Python int), shared by every layer of the forward.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from kernels.attention.masks import Causal, Document, Mask, Window

HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def decoder_parts(mask: Mask) -> tuple[Tensor | None, int | None] | None:
    """(doc_ids or None, window or None) when `mask` is causal & [document] & [window]; None otherwise."""
    docs, window, causal = [], [], False
    for part in mask.parts():
        if isinstance(part, Causal):
            causal = True
        elif isinstance(part, Document):
            docs.append(part.doc_ids)
        elif isinstance(part, Window):
            window.append(part.size)
        else:
            return None
    if not causal or len(docs) > 1 or len(window) > 1:
        return None
    return (docs[0] if docs else None), (window[0] if window else None)


def cu_seqlens(doc_ids: Tensor | None, B: int, T: int, device) -> tuple[Tensor, int]:
    """(cu_seqlens int32 [n_docs + 1], longest document) of a [B, T] batch: each row's documents, in order,
    as separate sequences of the flattened [B * T] tokens."""
    if doc_ids is None:
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device), T
    d = doc_ids[:, :T]
    starts = torch.ones_like(d, dtype=torch.bool)
    starts[:, 1:] = d[:, 1:] != d[:, :-1]  # a new document begins (every row begins one)
    where = starts.flatten().nonzero().flatten()
    cu = torch.cat([where, torch.tensor([B * T], device=where.device)]).to(device=device, dtype=torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def refusal(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
            dropout_p: float = 0.0, alibi_slopes: Tensor | None = None, forced: bool = False) -> str | None:
    """Why this path cannot serve the call (None: it can). Python values only (dynamo traces it)."""
    if not HAVE_FLASH_ATTN:
        return "the flash_attn package is not installed"
    if not q.is_cuda:
        return f"it runs on CUDA devices, not on {q.device.type}"
    if q.dtype not in (torch.bfloat16, torch.float16) or not (k.dtype == v.dtype == q.dtype):
        return "it takes bf16 or fp16 inputs of one dtype (train.precision=bf16)"
    if offset != 0 or q.shape[-2] != k.shape[-2]:
        return "it has no decode steps (queries after cached keys)"
    if alibi_slopes is not None:
        return "it has no ALiBi"
    if q.shape[-1] > 256:
        return "it takes head dims up to 256"
    if decoder_parts(mask) is None:
        return "the mask is not causal with at most one document mask and one window"
    return None


def capable(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *args, **kwargs) -> bool:
    return refusal(q, k, v, mask, *args, **kwargs) is None


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None, varlen=None) -> Tensor:
    """`varlen` replaces flash_attn_varlen_func (the tests' stand-in on a CPU)."""
    if varlen is None:
        from flash_attn import flash_attn_varlen_func as varlen
    doc_ids, window = decoder_parts(mask)
    B, H, T, D = q.shape
    cu, longest = mask.cached(("varlen", B, T, str(q.device)), lambda: cu_seqlens(doc_ids, B, T, q.device))
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]  # [B*T, heads, D]
    out = varlen(*flat, cu, cu, longest, longest, dropout_p=dropout_p, softmax_scale=scale, causal=True,
                 window_size=(window - 1, 0) if window else (-1, -1))
    return out.view(B, T, H, D).transpose(1, 2)
