"""Attention with causal and document masks: one entry point that every model calls.

`attention(q, k, v, doc_ids=None)` dispatches to the fastest path the device supports; today that
is the reference (PyTorch SDPA). Fast kernels (Triton, FlexAttention) plug in here later and are
tested against `reference.py`.
"""
from kernels.attention.reference import attention, document_causal_mask

__all__ = ["attention", "document_causal_mask"]
