"""The Recurrent Transformer layer's definition: the naive token-by-token loop (spec-003 §2.4).

Position i attends to the persistent pairs of every earlier position (computed from their outputs)
and to its own temporary pair (computed from its input); its output z_i then reveals its persistent
pair. Autograd through this loop is the gradient oracle the tiled path is tested against; it keeps
every step's concatenated keys, so its memory grows as N^2.

`layer` is the model's layer (pretrain/models/rt.py), seen through four members:
    pre(x, offset)  x [B, n, d] at positions offset.. -> q, k_temp, v_temp [B, H, n, Dh] (RoPE applied)
    post(x, a)      x [B, n, d], a [B, H, n, Dh] -> z [B, n, d] (output projection, residual, MLP)
    kv(z, offset)   z [B, n, d] -> persistent k, v [B, H, n, Dh]
    scale, slopes   the score scale and ALiBi slopes [H] (None without ALiBi)
"""
from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(x: Tensor) -> torch.dtype:
    """Softmax statistics and accumulators: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def alibi(slopes: Tensor | None, q_pos: Tensor, k_pos: Tensor, dtype) -> Tensor | float:
    """[H, nq, nk] bias -slope_h (i - j) for queries at q_pos, keys at k_pos (0.0 without ALiBi)."""
    if slopes is None:
        return 0.0
    return -slopes.to(dtype)[:, None, None] * (q_pos[:, None] - k_pos[None, :]).to(dtype)


def prefill(x: Tensor, layer, offset: int = 0) -> Tensor:
    """z [B, N, d] of layer input x [B, N, d] at positions offset .. offset + N - 1, from scratch."""
    N = x.shape[1]
    q, kt, vt = layer.pre(x, offset)
    dtype = acc_dtype(x)
    pos = torch.arange(offset, offset + N, device=x.device)
    keys, values, outs = [], [], []
    for i in range(N):
        k = torch.cat(keys + [kt[:, :, i:i + 1]], 2)
        v = torch.cat(values + [vt[:, :, i:i + 1]], 2)
        s = layer.scale * (q[:, :, i:i + 1].to(dtype) @ k.to(dtype).transpose(-1, -2))
        s = s + alibi(layer.slopes, pos[i:i + 1], pos[:i + 1], dtype)
        a = (s.softmax(-1) @ v.to(dtype)).to(x.dtype)
        z = layer.post(x[:, i:i + 1], a)
        k_i, v_i = layer.kv(z, offset + i)
        keys.append(k_i)
        values.append(v_i)
        outs.append(z)
    return torch.cat(outs, 1)
