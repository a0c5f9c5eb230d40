"""Where a Triton kernel can run: on a CUDA device with Triton installed, or on a CPU under Triton's
interpreter (TRITON_INTERPRET=1, how the tests run the kernels). Whether Triton is installed is looked
up once, at import; Triton itself is imported only by the kernel modules, on their first call."""
from __future__ import annotations

import importlib.util
import os

from torch import Tensor

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_can_run(t: Tensor) -> bool:
    """Whether Triton kernels can take tensor t where it lives."""
    return HAVE_TRITON and (t.is_cuda or (t.device.type == "cpu" and interpreting()))


# The CUDA launch configuration of the FlashAttention-style kernels (block-sparse attention, the RT tile):
# (query block, key block, warps, pipeline stages) by head-dim block and operand width. Chosen from what
# Triton (3.6 and 3.8) compiles for sm_80 and sm_90 (kernels/cuda_build.py, on a CPU): every entry needs
# at most 67 KiB of shared memory (under the 99 KiB of sm_86/sm_89, 163 of sm_80, 227 of sm_90), and where
# a config uses it spills at most 8 bytes a thread (the RT tile's forward at head dim 256, unused: 192).
# 64 x 64 everywhere had spilled up to 13 KB a thread with fp32 (IEEE) products and needed 273 KiB at head
# dim 256. Only the 16-bit head-dim-64 entry has been timed on a GPU (docs/kernels.md).
FLASH_TILES = {  # (16-bit operands?, head-dim block) -> (BM, BN, warps, stages)
    (True, 64): (64, 64, 4, 2), (True, 128): (64, 32, 8, 2), (True, 256): (32, 32, 8, 2),
    (False, 64): (32, 32, 8, 2), (False, 128): (16, 16, 8, 2), (False, 256): (16, 16, 8, 1),
}


def pow2_block(n: int) -> int:
    """A block covering n (a head dim, a tile's rows): the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def flash_tiles(head_dim: int, sixteen_bit: bool) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) for a head dim up to 256; `sixteen_bit`: bf16/fp16 products (else fp32)."""
    if head_dim > 256:
        raise ValueError(f"the Triton flash kernels take head dims up to 256, got {head_dim}")
    return FLASH_TILES[sixteen_bit, max(64, pow2_block(head_dim))]
