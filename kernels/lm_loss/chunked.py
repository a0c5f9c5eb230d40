"""The language-model loss in chunks of tokens, its gradient computed in the forward.

For each chunk of `chunk` positions: logits [chunk, V] in float32, log-sum-exp, the loss terms, and
right away their gradient, softmax - onehot (scaled by the position's weight), multiplied out into
the gradients of h and of the output weight. Only those two are kept (h's size and the weight's);
no [N, V] tensor is alive at any time, so the loss's activation memory falls from a few times
N x V floats to one chunk's. The FLOPs are the reference's (the logits once, the two gradient
products once). The backward only scales the kept gradients by the incoming one, so the loss must
be differentiated once per forward (as training does); under no_grad nothing is kept.

The same values as the reference (reference.py) up to float rounding: the sums run in another
order, so it is a path to choose (model.loss_chunk), not a silent replacement: the golden curves
stay the reference's."""
from __future__ import annotations

import torch
from torch import Tensor

IGNORE = -100  # F.cross_entropy's ignore_index: such a label adds 0 and takes no gradient


def _weights(labels: Tensor, loss_mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Each position's weight in the mean: the reference's mask / count (1 / N without a mask)."""
    n = labels.numel()
    if loss_mask is None:
        w = torch.full((n,), 1.0 / n, dtype=dtype, device=labels.device)
    else:
        mask = loss_mask.reshape(-1).to(dtype)
        w = mask / mask.sum().clamp(min=1.0)
    return w.masked_fill(labels.reshape(-1) == IGNORE, 0.0)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, w: Tensor, chunk: int) -> Tensor:
        # the products in h's dtype (bf16 under autocast: the caller's h already is), the softmax and the
        # sums in float32; autocast off so that nothing below changes dtype behind these choices
        with torch.autocast(h.device.type, enabled=False):
            return _ChunkedLoss._forward(ctx, h, weight.to(h.dtype), weight.dtype, labels, w, chunk)

    @staticmethod
    def _forward(ctx, h: Tensor, weight: Tensor, weight_dtype, labels: Tensor, w: Tensor, chunk: int) -> Tensor:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc, yc, wc = h[s:s + chunk], labels[s:s + chunk], w[s:s + chunk]
            logits = (hc @ weight.t()).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, -1)
            target = logits.gather(1, yc.clamp(min=0)[:, None])[:, 0]
            # out of place: torch 2.11's dynamo, given this Function's output mutated in place, traced a backward
            # of zeros (every gradient of a compiled model with model.loss_chunk was 0 on the H200, 2026-11-30)
            total = total + ((lse - target) * wc).sum()
            if grad_h is None and grad_w is None:
                continue
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g.scatter_add_(1, yc.clamp(min=0)[:, None], -torch.ones_like(wc)[:, None])
            g.mul_(wc[:, None]).nan_to_num_(0.0)  # an ignored row has weight 0
            g = g.to(h.dtype)
            if grad_h is not None:
                torch.matmul(g, weight, out=grad_h[s:s + chunk])
            if grad_w is not None:
                grad_w.addmm_(g.t().to(acc), hc.to(acc))
        ctx.save_for_backward(grad_h, grad_w.to(weight_dtype) if grad_w is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
                grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None, None, None, None)


def lm_loss(h: Tensor, weight: Tensor, labels: Tensor, loss_mask: Tensor | None = None, chunk: int = 1024) -> Tensor:
    """reference.lm_loss's value, chunk positions at a time, with its gradients computed here."""
    if chunk < 1:
        raise ValueError(f"the chunked loss needs chunk >= 1 positions, got {chunk}")
    flat = h.reshape(-1, h.shape[-1])
    y = labels.reshape(-1)
    w = _weights(y, loss_mask, torch.float64 if h.dtype == torch.float64 else torch.float32)
    return _ChunkedLoss.apply(flat, weight, y, w, chunk)
