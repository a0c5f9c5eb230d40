"""Two ways to hand an SPS mask to a tiled attention kernel, measured at 2T = 8,192 slots (issue 28, point 5).

    PYTHONPATH=. python benchmarks/mask_representations.py [--T 4096] [--tile 128] [--docs 4]

* Block mask (FlexAttention's BlockMask): per (query tile, key tile) whether it is empty, full or partial,
  as index lists; a partial tile evaluates the mask's predicate per element, which needs the predicate's
  own tables (SPS: each slot's token index, kind and document).
* Column intervals (FlashMask's idea, generalised): for each key column, the rows allowed to see it as
  sorted [start, end) runs; a partial tile compares row indices against the runs, whatever the mask.
  FlashMask itself keeps at most one masked run below and one above the diagonal (four integers per
  column); the script reports how many runs the SPS masks need, so whether that form suffices.

For each SPS variant (in the model's de-interleaved slot layout, windowed keys at w = 64, packed documents)
it prints the tiles skipped, the bytes of each representation, and checks that both rebuild the mask
exactly. Nothing here runs a kernel: it decides which representation the Triton kernel should read.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sps_dense(variant: str, T: int, docs: int, w: int = 64, seed: int = 0) -> torch.Tensor:
    """The [2T, 2T] bool training mask of one T-token sample of `docs` packed documents."""
    from pretrain.models.sps import VARIANTS, SlotMask, slot_tables

    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[:docs - 1] + 1).values
    doc = torch.zeros(T, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0)[None].repeat(1, 2)  # slots [x_1..x_T | rho_1..rho_T] share their token's document
    tok, kind = slot_tables(T, "cpu")
    persistent = VARIANTS[variant][0]
    mask = SlotMask(tok, kind, tok, kind, persistent, None if variant == "2x_memory" else w, doc, doc)
    return mask.evaluate(1, 1, 2 * T, 2 * T)[0, 0]


def tiles(dense: torch.Tensor, tile: int) -> tuple[int, int, int]:
    """(empty, partial, full) (query tile, key tile) counts."""
    n = dense.shape[0] // tile
    per = dense.reshape(n, tile, n, tile).sum((1, 3))
    return int((per == 0).sum()), int(((per > 0) & (per < tile * tile)).sum()), int((per == tile * tile).sum())


def column_runs(dense: torch.Tensor) -> list[torch.Tensor]:
    """Per key column, the allowed rows as [start, end) runs: a [runs, 2] int32 tensor each."""
    pad = torch.zeros(1, dense.shape[1], dtype=torch.int8)
    d = torch.cat([pad, dense.to(torch.int8), pad]).diff(dim=0)  # +1 where a run starts, -1 after it ends
    out = []
    for c in range(dense.shape[1]):
        starts, ends = (d[:, c] == 1).nonzero()[:, 0], (d[:, c] == -1).nonzero()[:, 0]
        out.append(torch.stack([starts, ends], 1).int())
    return out


def from_runs(runs: list[torch.Tensor], rows: int) -> torch.Tensor:
    dense = torch.zeros(rows, len(runs), dtype=torch.bool)
    for c, r in enumerate(runs):
        for s, e in r.tolist():
            dense[s:e, c] = True
    return dense


def block_mask_bytes(dense: torch.Tensor, tile: int) -> tuple[int, bool]:
    """Bytes of torch's BlockMask for this mask (forward and backward index lists), and whether its
    tiles agree with the dense count."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = dense.shape[0]
    bm = create_block_mask(lambda b, h, q, kv: dense[q, kv], 1, 1, n, n, device="cpu", BLOCK_SIZE=tile,
                           _compile=False)
    tensors = [t for t in bm.as_tuple() if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    empty, partial, full = tiles(dense, tile)
    listed = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
    return nbytes, listed == partial + full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096, help="tokens per sample; the mask has 2T slots (default 4096)")
    ap.add_argument("--tile", type=int, default=128, help="the kernel's tile edge, dividing 2T (default 128)")
    ap.add_argument("--docs", type=int, default=4, help="documents packed in the sample (default 4)")
    args = ap.parse_args()
    n = 2 * args.T
    print(f"SPS masks at 2T = {n:,} slots, {args.docs} packed documents, w = 64, tiles {args.tile} x {args.tile} "
          f"({(n // args.tile) ** 2:,} tiles); dense bool mask: {n * n / 2**20:.0f} MiB")
    print(f"{'variant':>14} {'empty':>6} {'partial':>7} {'full':>6} {'skipped':>8} {'runs/col':>8} "
          f"{'interval KiB':>12} {'block-mask KiB':>14} {'exact':>5}")
    for variant in ("sps", "delayed_state", "reverse_sps", "2x_memory"):
        dense = sps_dense(variant, args.T, args.docs)
        empty, partial, full = tiles(dense, args.tile)
        runs = column_runs(dense)
        most = max(len(r) for r in runs)
        interval_bytes = n * most * 2 * 4  # a fixed number of (start, end) int32 pairs per column
        exact = bool(torch.equal(from_runs(runs, n), dense))
        bm_bytes, agrees = block_mask_bytes(dense, args.tile)
        print(f"{variant:>14} {empty:>6} {partial:>7} {full:>6} {empty / (empty + partial + full):>8.1%} {most:>8} "
              f"{interval_bytes / 1024:>12.0f} {bm_bytes / 1024:>14.0f} {str(exact and agrees):>5}")


if __name__ == "__main__":
    main()
