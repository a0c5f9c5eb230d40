"""The language-model loss (output projection + cross-entropy, masked mean): one op, two paths.

    lm_loss(h, weight, labels, loss_mask=None, chunk=0) -> scalar

Paths (kernels/registry.py):
    "chunked"    chunk positions at a time with the gradients computed in the forward (chunked.py): no
                 [N, V] logits kept; picked when the model asks for it (model.loss_chunk > 0) and
                 autograd is on
    "reference"  the whole logits at once (reference.py): the default, what the golden curves record
"""
from __future__ import annotations

import torch

from kernels import registry
from kernels.lm_loss import chunked, reference

OP = registry.op("lm_loss")
OP.register("chunked", chunked.lm_loss, priority=10,
            capable=lambda h, weight, labels, loss_mask=None, chunk=0: chunk > 0 and torch.is_grad_enabled())
OP.register("reference", reference.lm_loss)


def lm_loss(h, weight, labels, loss_mask=None, chunk: int = 0):
    return OP(h, weight, labels, loss_mask, chunk=chunk)


__all__ = ["OP", "chunked", "lm_loss", "reference"]
