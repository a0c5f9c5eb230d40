"""The memory recurrence of reference.py for inputs fixed over time, chunk steps at a time (a UT /
WY form written for this rule's undecayed erase term, without dividing by alpha).

Within a chunk starting from M_0, with u_t = beta_t (v_t - M_{t-1}^T k_t) and L_t the running sum
of log alpha (L_0 = 0), unrolling gives M_t = e^{L_t} M_0 + sum_{s<=t} e^{L_t - L_s} k_s u_s^T, so

    u_t + beta_t sum_{s<t} e^{L_{t-1} - L_s} (k_t . k_s) u_s = beta_t (v_t - e^{L_{t-1}} M_0^T k_t)

a unit lower-triangular system (I + A) U = R solved for the chunk's U at once; then the reads
o_t = e^{L_t} M_0^T q_t + sum_{s<=t} e^{L_t - L_s} (q_t . k_s) u_s and the next chunk's start
M_C = e^{L_C} M_0 + sum_s e^{L_C - L_s} k_s u_s^T. Every exponent is a sum of log alpha over later
steps, so <= 0: no overflow however small alpha is (fast heads reach 1e-8).

It holds only for inputs known in advance (teacher-forced analysis, kernel validation): in GPN+M
they depend on the state the memory feeds (spec §2.11), so the training loop runs reference.write.
"""
from __future__ import annotations

import torch
from torch import Tensor


def recurrence(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, M0: Tensor | None = None,
               chunk: int = 16) -> tuple[Tensor, Tensor]:
    """reference.recurrence's reads and last memory, `chunk` steps per triangular solve."""
    if chunk < 1:
        raise ValueError(f"the chunked memory needs chunk >= 1 steps, got {chunk}")
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    M = M0 if M0 is not None else k.new_zeros(B, H, dk, dv)
    # [B, H, T, ...]: heads outside, time inside the chunk
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    beta, log_alpha = beta.transpose(1, 2), torch.log(alpha).transpose(1, 2)
    out = []
    for s in range(0, T, chunk):
        qc, kc, vc, bc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], beta[:, :, s:s + chunk]
        C = kc.shape[2]
        L = torch.cumsum(log_alpha[:, :, s:s + chunk], -1)  # L_t, t = 1..C
        L_prev = torch.cat([torch.zeros_like(L[..., :1]), L[..., :-1]], -1)  # L_{t-1}
        strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
        # e^{L_{t-1} - L_s} for s < t (0 elsewhere; the masked entries' exponents may be positive)
        decay_prev = torch.exp((L_prev[..., :, None] - L[..., None, :]).masked_fill(~strict, float("-inf")))
        A = bc[..., None] * decay_prev * (kc @ kc.transpose(-1, -2))
        rhs = bc[..., None] * (vc - torch.exp(L_prev)[..., None] * (kc @ M))
        eye = torch.eye(C, dtype=k.dtype, device=k.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        decay = torch.exp((L[..., :, None] - L[..., None, :]).masked_fill(~incl, float("-inf")))
        out.append(torch.exp(L)[..., None] * (qc @ M) + (decay * (qc @ kc.transpose(-1, -2))) @ U)
        tail = torch.exp(L[..., -1:] - L)  # e^{L_C - L_s}
        M = torch.exp(L[..., -1])[..., None, None] * M + kc.transpose(-1, -2) @ (tail[..., None] * U)
    return torch.cat(out, 2).transpose(1, 2), M
