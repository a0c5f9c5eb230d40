"""The layers through which every model builds its linears, embeddings and loss.

A model never knows how it is split over processes (torchtitan's rule). At tensor-parallel size 1
these facades are plain torch modules; the parallelism issue makes them megatron-core's column,
row and vocab-parallel layers when TP > 1, behind the same constructors. Keeping every model on
these four names is what lets one model file run at TP=1 on a laptop and at TP=8 on a node.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ColumnLinear(nn.Linear):
    """y = x W^T with W split by output features under TP (q/k/v, FFN gate and up projections)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02):
        super().__init__(in_features, out_features, bias=bias)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not hasattr(self, "init_std"):  # nn.Linear.__init__ calls this before init_std exists
            return
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class RowLinear(ColumnLinear):
    """y = x W^T with W split by input features under TP (attention output, FFN down projection)."""


class VocabEmbedding(nn.Embedding):
    """Token embedding, split over the vocabulary under TP."""

    def __init__(self, vocab_size: int, dim: int, init_std: float = 0.02):
        super().__init__(vocab_size, dim)
        nn.init.normal_(self.weight, mean=0.0, std=init_std)


class LMHead(nn.Module):
    """Output projection and cross-entropy, fused so that TP can keep the logits vocab-parallel.

    `tied` shares the weight of a VocabEmbedding (the parameter is then counted once).
    """

    def __init__(self, dim: int, vocab_size: int, tied: VocabEmbedding | None = None, init_std: float = 0.02):
        super().__init__()
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def logits(self, h: Tensor) -> Tensor:
        """[..., dim] -> [..., vocab] in float32 (softmax statistics need it under bf16)."""
        return F.linear(h, self.weight).float()

    def loss(self, h: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> Tensor:
        """Mean cross-entropy over the positions where loss_mask is True (all when None)."""
        logits = self.logits(h).flatten(0, -2)
        per_token = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
        if loss_mask is None:
            return per_token.mean()
        mask = loss_mask.reshape(-1).to(per_token.dtype)
        # clamp: a micro batch whose targets are all masked contributes 0, not NaN.
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
