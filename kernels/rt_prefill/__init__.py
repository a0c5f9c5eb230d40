"""The Recurrent Transformer layer over a whole sequence (training and prefill): one op, several paths.

    rt_prefill(x, layer, leaf=1, offset=0) -> z [B, N, d]

`layer` exposes pre / post / kv / scale / slopes (reference.py's docstring), `leaf` is the leaf block
of the tile schedule (schedule.py: 1 is the paper's Algorithm 1; any power of two gives the same
values), `offset` the position of x's first token. Paths (kernels/registry.py):
    "tiled"   the dyadic tile schedule with its tiled custom backward (tiled.py), picked by default
    "naive"   the token-by-token definition with autograd through the loop (reference.py), only when
              forced (PRETRAIN_KERNELS=rt_prefill=naive): the oracle, and N^2 memory
    "triton"  the same schedule and backward with every tile update and tile gradient as Triton
              kernels (triton_tile.py): CUDA, or a CPU under TRITON_INTERPRET=1 (the tests); only when
              forced (PRETRAIN_KERNELS=rt_prefill=triton). Unforced on CUDA, "tiled" picks the tile per
              tile shape by measuring both (ops rt_tile_update and rt_tile_grads, below)
`rt_decode` (op "rt_decode") is the same schedule after a prefix of cached keys (streaming decode):
paths "tiled" and, forced only, "triton".
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import captured, registry
from kernels.rt_prefill import reference, schedule, tiled
from kernels.triton_support import triton_can_run

# The tile's two functions as ops of their own: on CUDA each tile shape measures the PyTorch tile (a few
# dozen small kernels) against the Triton tile (one kernel), both with their products in bf16 under autocast
# (else fp32), on its first call and keeps the faster; elsewhere the PyTorch tile, so no CPU test or golden
# curve moves. Small tiles are launch-bound and large ones arithmetic-bound: which wins is measured per shape,
# and per context: inside a captured region (a CUDA graph replays the loop, and launches cost the host nothing)
# each path is timed as a replayed graph (captured.replay_time), elsewhere as launched (registry.wall_time).
UPDATE = registry.op("rt_tile_update")
GRADS = registry.op("rt_tile_grads")


def _tile_refusal(qs: Tensor, k: Tensor, *rest) -> str | None:
    """Why the Triton tile cannot serve this automatic call (None: it can). Python values only."""
    if not triton_can_run(qs):
        return f"the Triton RT tile runs on CUDA with Triton installed; the queries are on {qs.device.type}"
    if qs.device.type == "cpu":
        return "on a CPU the Triton RT tile (Triton's interpreter) runs only when forced (rt_prefill=triton)"
    if qs.dtype != torch.float32:
        return f"the Triton RT tile accumulates in float32; the scaled queries are {qs.dtype}"
    if k.stride(-1) != 1 or qs.stride(-1) != 1:
        return "the Triton RT tile needs tensors contiguous in their last dimension"
    return None


def _triton_update(*args):
    from kernels.rt_prefill import triton_tile  # Triton is imported on the first call only

    return triton_tile.update_tile(*args)


def _triton_grads(*args):
    from kernels.rt_prefill import triton_tile

    return triton_tile.tile_grads(*args)


def _tile_key(qs: Tensor, k: Tensor, *rest):
    """Calls that share a measured choice: CUDA only; the tile's shape, the keys' dtype, the products' (the
    running tiled call's autocast dtype, or None), ALiBi or not, and whether a CUDA graph will replay the call
    (a captured region's warm-up and capture: the choice is timed as replayed there, _tile_timer)."""
    return tile_fields(qs, k, *rest) if qs.device.type == "cuda" else None


def tile_fields(qs: Tensor, k: Tensor, *rest) -> tuple:
    """_tile_key's fields on any device (the CPU tests open the choice to the CPU with them)."""
    slopes = rest[4]  # the seventh argument of both
    return (*qs.shape[:3], k.shape[2], qs.shape[3], k.dtype, tiled._low(), slopes is not None, str(qs.device),
            captured.graphing())


def _tile_timer(run) -> float:
    """A tile path's seconds: as a replayed CUDA graph inside a captured region, as launched elsewhere (the key
    tells the two apart, so each context keeps its own choice)."""
    return captured.replay_time(run) if captured.graphing() else registry.wall_time(run)


def _tile_tensors(key):
    """(qs, k, v, slopes, q0, k0, make): a key's tile on fresh tensors from a private generator (a
    measurement must not move the process's random stream), make(*shape) drawing more."""
    B, H, nq, nk, D, dtype, _, alibi, device, _ = key  # (the products' dtype is the running call's)
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda *shape, dt=torch.float32: torch.randn(*shape, generator=g, device=device, dtype=dt)  # noqa: E731
    slopes = torch.linspace(0.5, 0.01, H, device=device) if alibi else None
    return make(B, H, nq, D), make(B, H, nk, D, dt=dtype), make(B, H, nk, D, dt=dtype), slopes, nk, 0, make


def _update_inputs(key):
    """Fresh synthetic inputs of a key's tile (never the caller's): queries after their keys, a softmax state."""
    qs, k, v, slopes, q0, k0, _ = _tile_tensors(key)
    B, H, nq, D = qs.shape
    m = torch.zeros(B, H, nq, device=qs.device)
    return (qs, k, v, m, torch.ones_like(m), torch.zeros_like(qs), slopes, q0, k0), {}


def _grads_inputs(key):
    qs, k, v, slopes, q0, k0, make = _tile_tensors(key)
    lse = torch.full(qs.shape[:3], float(k.shape[2]), device=qs.device)
    B, H, nk, D = k.shape  # the accumulators the tile adds into, position-major as the backward's dK, dV
    dk = torch.zeros(B, nk, H, D, device=k.device).transpose(1, 2)
    return (qs, k, v, make(*qs.shape), make(*lse.shape), lse, slopes, q0, k0, dk, torch.zeros_like(dk)), {}


def _describe(key) -> str:
    B, H, nq, nk, D, dtype, low, alibi, _, graphed = key
    products = f" products {str(low)[6:]}" if low is not None else ""
    return (f"B {B} H {H} queries {nq} keys {nk} d {D} {str(dtype)[6:]}{products}{' alibi' if alibi else ''}"
            + (", timed as replayed in a CUDA graph" if graphed else ""))


for _op, _torch, _triton_fn, _inputs in ((UPDATE, tiled.update_tile, _triton_update, _update_inputs),
                                         (GRADS, tiled.tile_grads, _triton_grads, _grads_inputs)):
    _op.register("torch", _torch, priority=20)
    _op.register("triton", _triton_fn, priority=10, refusal=_tile_refusal)
    _op.measure_with(registry.Measured(_tile_key, _inputs, timer=_tile_timer, describe=_describe))
MEASURED_OPS = tiled.TileOps(UPDATE, GRADS)  # the "tiled" path's tile: per shape, the faster of the two


def _tiled(x: Tensor, layer, leaf: int = 1, offset: int = 0) -> Tensor:
    return tiled.prefill(x, layer, leaf, offset, ops=MEASURED_OPS if x.is_cuda else None)


OP = registry.op("rt_prefill")
OP.register("tiled", _tiled, priority=10)
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


__all__ = ["DECODE", "GRADS", "MEASURED_OPS", "OP", "UPDATE", "reference", "rt_decode", "rt_prefill", "schedule",
           "tiled"]
