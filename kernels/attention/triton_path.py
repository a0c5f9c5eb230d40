"""The "triton" attention path: block-sparse flash attention (triton_kernels.py) for any mask that
declares its column runs (kernels/attention/runs.py).

Capable on a CUDA device with Triton installed, for fp32, bf16 and fp16 inputs, head dims up to 256,
without ALiBi or attention dropout (those stay with SDPA). On a CPU the same kernels run under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check them; there the path serves only when it
is forced, never picked on its own. Triton is imported on the first call, so a machine without it pays
nothing.

On a GPU the tiles (one size for the forward and both backward kernels, so they share the tile lists),
warps and stages come from kernels/triton_support.FLASH_TILES by head dim and dtype: 64 x 64 for 16-bit
inputs up to head dim 64, smaller where larger tiles would spill registers or overflow shared memory.
In the interpreter they are 16 x 16 (small shapes, many tiles of every kind).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention.masks import Mask
from kernels.attention.reference import check_heads
from kernels.attention.runs import tile_lists
from kernels.triton_support import HAVE_TRITON, flash_tiles, interpreting

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def blocks(q: Tensor) -> tuple[int, int]:
    """(query block, key block) of the kernels and the tile lists."""
    return flash_tiles(q.shape[-1], q.dtype != torch.float32)[:2] if q.is_cuda else (16, 16)


def refusal(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
            dropout_p: float = 0.0, alibi_slopes: Tensor | None = None, forced: bool = False) -> str | None:
    """Why this path cannot serve the call (None: it can). Python values only (dynamo traces it)."""
    if not HAVE_TRITON:
        return "Triton is not installed"
    if not q.is_cuda and not (q.device.type == "cpu" and interpreting()):
        return f"its kernels run on CUDA devices (on a CPU only under TRITON_INTERPRET=1), not on {q.device.type}"
    if not q.is_cuda and not forced:
        return "on a CPU it serves only when forced"
    if dropout_p:
        return "it has no attention dropout"
    if alibi_slopes is not None:
        return "it has no ALiBi"
    if mask.runs is None:
        return "the mask declares no column runs (Mask.runs)"
    if q.dtype not in DTYPES or not (k.dtype == v.dtype == q.dtype):
        return "it takes fp32, bf16 or fp16 inputs of one dtype"
    if q.shape[-1] > 256:
        return "it takes head dims up to 256"
    return None


def capable(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *args, **kwargs) -> bool:
    return refusal(q, k, v, mask, *args, **kwargs) is None


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, offset: int = 0, scale: float | None = None,
              dropout_p: float = 0.0, alibi_slopes: Tensor | None = None) -> Tensor:
    from kernels.attention.triton_kernels import block_sparse_attention

    check_heads(q, k, v)
    # the kernels index the head dimension with stride 1 (no generator here: dynamo traces this body)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    B, _, Tq, Dh = q.shape
    block_q, block_k = blocks(q)
    lists = tile_lists(mask, B, Tq, k.shape[-2], offset, block_q, block_k, q.device)
    out, _ = block_sparse_attention(q, k, v, *lists.tensors(), Dh ** -0.5 if scale is None else float(scale),
                                    block_q, block_k)
    return out
