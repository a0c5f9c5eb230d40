"""A mask value as per-column runs and tile lists: what the block-sparse kernels read.

Column runs (FlashMask's idea, generalised to R runs): for each key column k, the query rows allowed
to see it as at most R disjoint [start, end) intervals, an int32 tensor [B or 1, Tk, R, 2] of row
indices relative to the first query (0 .. Tq; an unused run is (0, 0)). A kernel evaluates the mask
inside a tile from these alone: allowed(i, k) = any_r start_r(k) <= i < end_r(k). Measured on the SPS
masks at 2T = 8,192 (benchmarks/mask_representations.py, docs/kernels.md): R = 2 reproduces every
variant exactly in 128 KiB, where a block mask needs 65 KiB of tile lists *and* the predicate's own
tables inside each partial tile; the runs also give exact tile classes (below), so one structure serves
both the skipping and the in-tile masking, whatever the predicate was.

How many runs a mask needs is a property of its value, `Mask.runs` (None: unknown, which the kernels
refuse): 1 for causal, window, document (packed documents, each a contiguous stretch of positions) and
full; `a & b` needs at most a + b - 1, `a | b` at most a + b; an architecture's own predicate declares
its own (SPS's SlotMask: 2). Built-ins whose runs are known in closed form (`Mask.closed_runs`) never
build the dense mask: O(Tk) memory. Any other mask is evaluated densely once and its runs read off;
a column with more runs than declared fails a device-side assertion (torch._assert_async, no sync)
instead of silently dropping rows.

Tile classes: for query block [q0, q1) and key block [k0, k1), the count of allowed pairs is
sum_k sum_r |[start_r, end_r) & [q0, q1)|: 0 is an empty tile (skipped), all of them a full tile (no
mask evaluated), anything else a partial tile. `tile_lists` turns the classes into the index lists a
kernel loops over (per query block its partial and its full key blocks; per key block, for the
backward, its partial and full query blocks), as FlexAttention's BlockMask does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.attention.masks import Mask

EMPTY, PARTIAL, FULL = 0, 1, 2


def dense_runs(allowed: Tensor, R: int) -> Tensor:
    """allowed bool [B', Tq, Tk] -> runs int32 [B', Tk, R, 2]: the first R runs of each column."""
    Bm, Tq, Tk = allowed.shape
    a = allowed.to(torch.int8)
    pad = a.new_zeros(Bm, 1, Tk)
    step = torch.cat([pad, a, pad], 1).diff(dim=1)  # [B', Tq + 1, Tk]: +1 at a run's start row, -1 at its end
    starts, ends = step == 1, step == -1
    start_no = starts.cumsum(1, dtype=torch.int32)  # run number (1-based) at each start
    end_no = ends.cumsum(1, dtype=torch.int32)
    torch._assert_async(start_no[:, -1].max() <= R,
                        f"attention mask has a key column with more than {R} runs of visible queries (its declared "
                        "Mask.runs); declare more runs for it")
    out = torch.zeros(Bm, Tk, R, 2, dtype=torch.int32, device=allowed.device)
    for r in range(R):  # argmax of a bool picks the first True: the r-th start, the r-th end
        has = start_no[:, -1] > r
        s = (starts & (start_no == r + 1)).to(torch.int8).argmax(1)
        e = (ends & (end_no == r + 1)).to(torch.int8).argmax(1)
        out[:, :, r, 0] = torch.where(has, s, 0)
        out[:, :, r, 1] = torch.where(has, e, 0)
    return out


def column_runs(mask: Mask, B: int, Tq: int, Tk: int, offset: int = 0, device=None) -> Tensor:
    """The mask's runs, [B or 1, Tk, R, 2] int32 with R = mask.runs: in closed form where the mask knows
    it, else read off its dense view."""
    R = mask.runs
    if R is None:
        raise ValueError(f"attention mask {mask.name!r} does not declare how many runs of visible queries a key "
                         "column holds (Mask.runs), which the block-sparse kernels need")
    runs = mask.closed_runs(B, Tq, Tk, offset, device)
    if runs is None:
        allowed = mask.dense(B, 1, Tq, Tk, offset, device)[:, 0]
        runs = dense_runs(torch.broadcast_to(allowed, (allowed.shape[0], Tq, Tk)), R)
    return runs.to(torch.int32).contiguous()


def tile_classes(runs: Tensor, Tq: int, Tk: int, block_q: int, block_k: int) -> Tensor:
    """int8 [B', ceil(Tq / block_q), ceil(Tk / block_k)]: EMPTY, PARTIAL or FULL per tile."""
    Bm = runs.shape[0]
    nq, nk = -(-Tq // block_q), -(-Tk // block_k)
    q0 = torch.arange(nq, device=runs.device) * block_q
    q1 = (q0 + block_q).clamp_max(Tq)
    start, end = runs[..., 0].long(), runs[..., 1].long()  # [B', Tk, R]
    lo = torch.maximum(start[:, None], q0[None, :, None, None])  # [B', nq, Tk, R]
    hi = torch.minimum(end[:, None], q1[None, :, None, None])
    per_col = (hi - lo).clamp_min(0).sum(-1)  # allowed rows of each column inside each query block
    per_col = torch.nn.functional.pad(per_col, (0, nk * block_k - Tk))
    count = per_col.view(Bm, nq, nk, block_k).sum(-1)
    cols = (torch.arange(nk, device=runs.device) * block_k).neg().add(Tk).clamp_max(block_k)  # keys per block
    size = (q1 - q0)[:, None] * cols[None, :]
    classes = torch.full_like(count, PARTIAL, dtype=torch.int8)
    classes[count == 0] = EMPTY
    classes[count == size] = FULL
    return classes


def _lists(classes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of `classes` [B', n, m]: (partial count [B', n], partial indices [B', n, m], full count,
    full indices), the indices of each kind first, in increasing order."""
    out = []
    for kind in (PARTIAL, FULL):
        hit = classes == kind
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
        out += [hit.sum(-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()]
    return tuple(out)


@dataclass
class TileLists:
    """What a kernel reads: the runs and, per query block (forward, dq) and per key block (dk, dv), the
    partial and full tiles to visit. Every tensor has a leading batch dimension of B or 1."""
    runs: Tensor
    q_partial_num: Tensor
    q_partial: Tensor
    q_full_num: Tensor
    q_full: Tensor
    k_partial_num: Tensor
    k_partial: Tensor
    k_full_num: Tensor
    k_full: Tensor
    classes: Tensor

    def tensors(self) -> list[Tensor]:
        return [self.runs, self.q_partial_num, self.q_partial, self.q_full_num, self.q_full,
                self.k_partial_num, self.k_partial, self.k_full_num, self.k_full]


def tile_lists(mask: Mask, B: int, Tq: int, Tk: int, offset: int, block_q: int, block_k: int, device) -> TileLists:
    """The runs and tile lists of `mask` at this shape. Cached on the mask value (every layer of one
    forward shares it) outside compiled regions."""
    def build() -> TileLists:
        runs = column_runs(mask, B, Tq, Tk, offset, device)
        classes = tile_classes(runs, Tq, Tk, block_q, block_k)
        return TileLists(runs, *_lists(classes), *_lists(classes.transpose(1, 2)), classes)

    return mask.cached(("tiles", B, Tq, Tk, offset, block_q, block_k, str(device)), build)
