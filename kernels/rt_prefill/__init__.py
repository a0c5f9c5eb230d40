"""The Recurrent Transformer layer over a whole sequence (training and prefill): one op, several paths.

    rt_prefill(x, layer, leaf=1, offset=0) -> z [B, N, d]

`layer` exposes pre / post / kv / scale / slopes (reference.py's docstring), `leaf` is the leaf block
of the tile schedule (schedule.py: 1 is the paper's Algorithm 1; any power of two gives the same
values), `offset` the position of x's first token. Paths (kernels/registry.py):
    "tiled"   the dyadic tile schedule with its tiled custom backward (tiled.py), picked by default
    "naive"   the token-by-token definition with autograd through the loop (reference.py), only when
              forced (PRETRAIN_KERNELS=rt_prefill=naive): the oracle, and N^2 memory
    "triton"  the same schedule and backward with the tile update and the tile gradients as Triton
              kernels (triton_tile.py): CUDA, or a CPU under TRITON_INTERPRET=1 (the tests); only when
              forced (PRETRAIN_KERNELS=rt_prefill=triton) until it has been measured on a GPU
              (benchmarks/bench_attention.py --rt)
`rt_decode` (op "rt_decode") is the same schedule after a prefix of cached keys (streaming decode):
paths "tiled" and, forced only, "triton".
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import registry
from kernels.rt_prefill import reference, schedule, tiled
from kernels.triton_support import triton_can_run

OP = registry.op("rt_prefill")
OP.register("tiled", tiled.prefill, priority=10)
OP.register("naive", lambda x, layer, leaf=1, offset=0: reference.prefill(x, layer, offset), auto=False)


def _triton(x: Tensor, layer, leaf: int = 1, offset: int = 0) -> Tensor:
    from kernels.rt_prefill import triton_tile  # Triton is imported on the first call only

    return tiled.prefill(x, layer, leaf, offset, ops=triton_tile.OPS)


def _triton_capable(x: Tensor, layer, leaf: int = 1, offset: int = 0) -> bool:
    return triton_can_run(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


OP.register("triton", _triton, _triton_capable, priority=20, auto=False)


def rt_prefill(x: Tensor, layer, leaf: int = 1, offset: int = 0) -> Tensor:
    return OP(x, layer, leaf, offset)


# Decode: the same schedule after a prefix of cached persistent pairs, returning the new pairs to cache.
#     rt_decode(x, layer, leaf, offset, prefix=(K0, V0)) -> (z, K, V) for x at positions offset..
DECODE = registry.op("rt_decode")
DECODE.register("tiled", lambda x, layer, leaf, offset, prefix: tiled.forward(x, layer, leaf, offset, prefix)[:3],
                priority=10)


def _triton_decode(x: Tensor, layer, leaf: int, offset: int, prefix) -> tuple[Tensor, Tensor, Tensor]:
    from kernels.rt_prefill import triton_tile

    return tiled.forward(x, layer, leaf, offset, prefix, ops=triton_tile.OPS)[:3]


DECODE.register("triton", _triton_decode, lambda x, layer, *rest: _triton_capable(x, layer), priority=20, auto=False)


def rt_decode(x: Tensor, layer, leaf: int, offset: int, prefix: tuple[Tensor, Tensor]):
    return DECODE(x, layer, leaf, offset, prefix)


__all__ = ["DECODE", "OP", "reference", "rt_decode", "rt_prefill", "schedule", "tiled"]
