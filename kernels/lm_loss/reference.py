"""The language-model loss as written: logits for every position, then cross-entropy, masked mean.

Keeps what autograd needs for the whole [N, V] logits (their log-softmax, then its gradient and the
logits' in the backward): for a 32k vocabulary the largest activation of a small model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def fp32_logits(h: Tensor, weight: Tensor) -> Tensor:
    """h [..., d] @ weight [V, d]^T in float32 (kept in float64 when computed in it)."""
    logits = F.linear(h, weight)
    return logits if logits.dtype == torch.float64 else logits.float()


def lm_loss(h: Tensor, weight: Tensor, labels: Tensor, loss_mask: Tensor | None = None, chunk: int = 0) -> Tensor:
    """Mean next-token cross-entropy of h [..., d] against labels [...] over loss_mask (all when None);
    a label of -100 counts 0, as in F.cross_entropy. `chunk` is the chunked path's; unused here."""
    per_token = F.cross_entropy(fp32_logits(h, weight).flatten(0, -2), labels.reshape(-1), reduction="none")
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.reshape(-1).to(per_token.dtype)
    # clamp: a micro batch whose targets are all masked contributes 0, not NaN.
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
