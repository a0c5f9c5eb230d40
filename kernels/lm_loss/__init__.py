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


def memory_columns(vocab: int, width: int, positions: int, chunk: int = 0) -> tuple[float, float]:
    """The loss's activation memory in the planner's units, float32 numbers per position of a micro batch
    of `positions` (the registry's activation_bytes): (kept from the forward into the backward, added
    at the loss's own peak). The reference keeps the logits (V) and adds their softmax and gradient (2 V);
    the chunked path (chunk > 0) keeps the gradients of h (d) and of the weight (V x d, spread over the
    positions) and holds one chunk's logits and their gradient at a time (2 V per chunk position, spread
    likewise). A chunk is refused under megatron-core's vocab-parallel layers (pretrain/run_config.py),
    whose loss is the reference's, split by tp."""
    if chunk <= 0:
        return float(vocab), 2.0 * vocab
    return width + vocab * width / positions, 2.0 * vocab * min(chunk, positions) / positions


__all__ = ["OP", "chunked", "lm_loss", "memory_columns", "reference"]
