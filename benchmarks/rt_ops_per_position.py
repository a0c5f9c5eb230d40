"""Operations per position of one RT layer's tiled forward and backward, counted on the CPU.

With each layer's position loop captured as a CUDA graph, the H200's per-layer time followed the number of
kernels a position runs (about 2.5 us each at batch 32 to 256, docs/gpu-results.md, 2026-11-29), not the
arithmetic. This counts the aten operations that launch work (views and allocations left out) under
bf16 autocast, the GPU run's precision, so the count can be read, and lowered, without a GPU:

    python benchmarks/rt_ops_per_position.py            # N 64, d 64, 2 heads
    python benchmarks/rt_ops_per_position.py --seq 128 --top 12

The count does not depend on the width, so a small layer gives the paper configs' count; it grows with
N only through ops run per position (what is hoisted out of the loop is counted once per layer).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.rt_prefill import tiled  # noqa: E402
from pretrain.models.rt import RT, LayerView, RTConfig  # noqa: E402

# no kernel of their own: views, reshapes, allocations
FREE = {"view", "_unsafe_view", "slice", "select", "transpose", "t", "unsqueeze", "squeeze", "expand", "permute",
        "as_strided", "alias", "detach", "unflatten", "flatten", "reshape", "split", "unbind", "_reshape_alias",
        "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(seq: int, d_model: int = 64, heads: int = 2, autocast: bool = True, qk_norm: str = "full",
              positions: str = "alibi") -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) operation counts of one RT layer over `seq` positions, batch 2."""
    cfg = RTConfig(vocab_size=256, d_model=d_model, n_heads=heads, n_layers=1, max_seq_len=seq, positions=positions,
                   qk_norm=qk_norm)
    torch.manual_seed(0)
    view = LayerView(RT(cfg).blocks[0], None, 0)
    x = torch.randn(2, seq, d_model, requires_grad=True)
    amp = torch.autocast("cpu", torch.bfloat16, enabled=autocast)
    with _Count() as fwd, amp:
        z = tiled.prefill(x, view, 1)
    with _Count() as bwd, amp:
        z.float().sum().backward()
    return fwd.ops, bwd.ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=64, help="positions N (default 64)")
    p.add_argument("--top", type=int, default=8, help="the most frequent operations to list")
    p.add_argument("--fp32", action="store_true", help="without bf16 autocast (its casts left out)")
    args = p.parse_args(argv)
    fwd, bwd = count_ops(args.seq, autocast=not args.fp32)
    for name, ops in (("forward", fwd), ("backward", bwd)):
        top = ", ".join(f"{op} {n / args.seq:.1f}" for op, n in ops.most_common(args.top))
        print(f"{name}: {sum(ops.values()) / args.seq:.1f} ops per position ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
