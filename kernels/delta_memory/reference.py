"""GPN+M's matrix memory (spec-002 §2.5-2.6), one step at a time: the definition.

Per head, M in R^{d_k x d_v}; a step writes with key k (unit or zero), value v, strength beta in
(0, 1) and decay alpha in (0, 1):

    M_t = alpha_t M_{t-1} + beta_t k_t (v_t - M_{t-1}^T k_t)^T      (the erase term reads the UNdecayed M)

which is (alpha I - beta k k^T) M + beta k v^T, a diagonal-plus-rank-1 transition; a read is M_t^T q.
Shapes: M [B, H, d_k, d_v]; k, q [B, H, d_k]; v [B, H, d_v]; beta, alpha [B, H]."""
from __future__ import annotations

import torch
from torch import Tensor


def write(M: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor) -> Tensor:
    """One write: the new memory (out of place, for autograd), as batched matrix products over B x H."""
    B, H, dk, dv = M.shape
    M3, k3 = M.reshape(B * H, dk, dv), k.reshape(B * H, 1, dk)
    u = beta.reshape(B * H, 1, 1) * (v.reshape(B * H, 1, dv) - torch.bmm(k3, M3))  # beta (v - M^T k)
    return torch.baddbmm(M3 * alpha.reshape(B * H, 1, 1), k3.transpose(1, 2), u).view(B, H, dk, dv)


def read(M: Tensor, q: Tensor) -> Tensor:
    """M^T q per head: [B, H, d_v]."""
    B, H, dk, dv = M.shape
    return torch.bmm(q.reshape(B * H, 1, dk), M.reshape(B * H, dk, dv)).view(B, H, dv)


def step(M: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """One step of the model's loop: write, then read the new memory with q [B, H, d_k]."""
    M = write(M, k, v, beta, alpha)
    return M, read(M, q)


def recurrence(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, M0: Tensor | None = None,
               chunk: int = 0) -> tuple[Tensor, Tensor]:
    """For inputs fixed over time ([B, T, H, ...]; beta, alpha [B, T, H]): every read o_t = M_t^T q_t
    ([B, T, H, d_v], M_t written before it is read, as in the model) and the last memory. `chunk` is
    the chunked path's; unused here."""
    B, T, H, dk = k.shape
    M = M0 if M0 is not None else k.new_zeros(B, H, dk, v.shape[-1])
    out = []
    for t in range(T):
        M = write(M, k[:, t], v[:, t], beta[:, t], alpha[:, t])
        out.append(read(M, q[:, t]))
    return torch.stack(out, 1), M
