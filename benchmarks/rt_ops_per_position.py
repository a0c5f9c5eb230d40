"""Operations per position of one RT layer's tiled forward and backward, counted on the CPU.

With each layer's position loop captured as a CUDA graph, the H200's per-layer time followed the number of
kernels a position runs (about 2.5 us each at batch 32 to 256, docs/gpu-results.md, 2026-11-29), not the
arithmetic. This counts the aten operations that launch work (views and allocations left out) under
bf16 autocast, the GPU run's precision, so the count can be read, and lowered, without a GPU:

    python benchmarks/rt_ops_per_position.py            # N 64, d 64, 2 heads
    python benchmarks/rt_ops_per_position.py --seq 128 --top 12

The count does not depend on the width, so a small layer gives the paper configs' count; it grows with
N only through ops run per position (what is hoisted out of the loop is counted once per layer).

`--compiled` counts what train.compile runs instead: the per-position pieces (RT.compile's Steps) compiled
by inductor, each call counted as the kernels of its generated code (its fused kernels and the matrix
products it hands to the BLAS), plus the operations the loops run outside the pieces (the PyTorch tile's
among them; the Triton tile, which a GPU may choose per tile shape, is one kernel). Inductor's CPU code
stands in for its GPU code: both fuse the same pointwise and reduction work around extern products.

    python benchmarks/rt_ops_per_position.py --compiled                 # ~1 min on 2 cores: the pieces compile
    python benchmarks/rt_ops_per_position.py --compiled --triton-tile   # each tile one kernel
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.rt_prefill import tiled  # noqa: E402
from pretrain.models.rt import RT, LayerView, RTConfig, Steps  # noqa: E402

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


# a call in inductor's generated wrapper that launches work: a fused kernel, or an extern one (the products)
_LAUNCH = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+[.\w]*)\(", re.M)


class _Opaque:
    """Calls that run outside the operation count, each counted instead as a number of launches, by name:
    a fixed number (the Triton tile: one kernel), or a compiled function's, read from its generated code on
    its first call."""

    def __init__(self):
        self.launches = collections.Counter()

    def wrap(self, name: str, fn, per_call: int | None = None):
        from torch._inductor.utils import run_and_get_code

        def call(*args):
            nonlocal per_call
            with torch.utils._python_dispatch._pop_mode_temporarily():  # the op counter sees none of it
                if per_call is None:
                    out, code = run_and_get_code(fn, *args)
                    per_call = len(_LAUNCH.findall("\n".join(code)))
                else:
                    out = fn(*args)
            self.launches[name] += per_call
            return out
        return call

    def take(self) -> collections.Counter:
        """The launches counted since the last take."""
        out, self.launches = self.launches, collections.Counter()
        return out


def count_ops(seq: int, d_model: int = 64, heads: int = 2, autocast: bool = True, qk_norm: str = "full",
              positions: str = "alibi", compiled: bool = False,
              one_kernel_tile: bool = False) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) operation counts of one RT layer over `seq` positions, batch 2; `compiled`: the
    per-position pieces compiled, each call counted as its generated code's launches; `one_kernel_tile`:
    each tile update and tile gradient counted as one kernel (the Triton tile's; the PyTorch tile computes)."""
    cfg = RTConfig(vocab_size=256, d_model=d_model, n_heads=heads, n_layers=1, max_seq_len=seq, positions=positions,
                   qk_norm=qk_norm)
    torch.manual_seed(0)
    block = RT(cfg).blocks[0]
    opaque = _Opaque()
    if compiled:
        block.steps = Steps(compile=True)
        for name in ("post", "kv", "vjp_kv", "vjp_post", "position", "position_grad"):
            if hasattr(block.steps, name):  # (commits before 2026-11-30 had no one-piece positions)
                setattr(block.steps, name, opaque.wrap(f"{name} (compiled)", getattr(block.steps, name)))
    ops = tiled.TORCH_OPS
    if one_kernel_tile:
        ops = tiled.TileOps(opaque.wrap("tile (one kernel)", ops.update, 1), opaque.wrap("tile (one kernel)", ops.grads, 1))
    view = LayerView(block, None, 0)
    x = torch.randn(2, seq, d_model, requires_grad=True)
    amp = torch.autocast("cpu", torch.bfloat16, enabled=autocast)
    with _Count() as fwd, amp:
        z = tiled.prefill(x, view, 1, ops=ops)
    fwd.ops += opaque.take()
    with _Count() as bwd, amp:
        z.float().sum().backward()
    bwd.ops += opaque.take()
    return fwd.ops, bwd.ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=64, help="positions N (default 64)")
    p.add_argument("--top", type=int, default=8, help="the most frequent operations to list")
    p.add_argument("--fp32", action="store_true", help="without bf16 autocast (its casts left out)")
    p.add_argument("--compiled", action="store_true",
                   help="the per-position pieces compiled as train.compile runs them (kernels of their generated code)")
    p.add_argument("--triton-tile", action="store_true",
                   help="each tile call counted as one kernel: the Triton tile, where a GPU's measurement chooses it")
    args = p.parse_args(argv)
    fwd, bwd = count_ops(args.seq, autocast=not args.fp32, compiled=args.compiled, one_kernel_tile=args.triton_tile)
    what = "kernels" if args.compiled else "ops"
    for name, ops in (("forward", fwd), ("backward", bwd)):
        top = ", ".join(f"{op} {n / args.seq:.1f}" for op, n in ops.most_common(args.top))
        print(f"{name}: {sum(ops.values()) / args.seq:.1f} {what} per position ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
