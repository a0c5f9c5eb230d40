"""Every Triton kernel compiled for a CUDA GPU on a machine without one.

    python -m kernels.cuda_build                        # sm_90 (H100, H200): every launch configuration
    python -m kernels.cuda_build --arch 80 --op attention --json out.json

Each launch configuration the project's kernels choose (dtype, head-dim block, tiles, warps, pipeline
stages) is compiled by Triton for a GPU architecture, and its resources are read from the compiled
binary: the shared memory it needs against the device's limit (over it, the launch fails on the GPU with
"out of resource: shared memory"); the registers and the per-thread stack, where ptxas puts the
registers it spills (slow: every spilled value goes through local memory); and the blocks an SM holds
at once (occupancy, by CUDA's occupancy rules). The Triton interpreter the tests run on a CPU checks
none of this.

How: Triton's compiler needs a target, not a GPU. A stand-in driver names the target; the real launch
code (the custom ops' bodies, the RT tile functions) runs on fake CUDA tensors (FakeTensorMode allocates
nothing) with the JIT's launch replaced by a recorder, so the kernels, constexprs, warps and stages are
those a GPU run launches; each launch is then compiled through the JIT's own `warmup` (Triton's
specialisation of the arguments), and cuobjdump, shipped with Triton, reads the binary's resources.
Run it without TRITON_INTERPRET=1 (the interpreter replaces the compiler). Exit code 1 when a
configuration does not compile or does not fit; `--max-stack` also fails on spills above that many bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

# the largest dynamic shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448}
ARCH_NAMES = {80: "A100", 86: "A40, A6000", 89: "L40S, L4", 90: "H100, H200", 100: "B200"}
# per SM: (shared memory bytes, resident threads, resident blocks); 64K registers on each of these
SM_LIMITS = {80: (167_936, 2048, 32), 86: (102_400, 1536, 16), 89: (102_400, 1536, 24), 90: (233_472, 2048, 32),
             100: (233_472, 2048, 32)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (16, 32, 64, 128, 256)  # one per head-dim block the kernels compile (a head dim of 90 runs BD 128)
ATTENTION_RUNS = 2  # R: the most column runs any of the project's masks declares (SPS's SlotMask)


@dataclass(frozen=True)
class Variant:
    """One call of a kernel op, whose launch code picks the configurations to compile."""
    op: str  # attention | rt_tile | delta_memory
    dtype: str  # the inputs' (the RT tile's keys and values: its queries and state are fp32 always)
    dims: tuple[int, ...]  # (head dim,) or the memory's (d_k, d_v)
    alibi: bool = False  # the RT tile's ALiBi bias

    @property
    def name(self) -> str:
        return f"{self.op} {self.dtype} {'x'.join(map(str, self.dims))}{' alibi' if self.alibi else ''}"


def variants(ops: tuple[str, ...] = ("attention", "rt_tile", "delta_memory")) -> list[Variant]:
    """Every configuration class the launch code can pick: each dtype the op takes at each head-dim block."""
    out = []
    if "attention" in ops:
        out += [Variant("attention", dt, (d,)) for dt in DTYPES for d in HEAD_DIMS]
    if "rt_tile" in ops:
        out += [Variant("rt_tile", dt, (d,), alibi) for dt in ("fp32", "bf16") for d in HEAD_DIMS
                for alibi in (False, True)]
    if "delta_memory" in ops:  # GPN+M's memory heads are 128 x 256; d_k 256 is where the blocks narrow most
        out += [Variant("delta_memory", dt, dims) for dt in ("fp32", "bf16")
                for dims in ((16, 16), (64, 64), (128, 256), (256, 256))]
    return out


class _Target:
    """The stand-in for Triton's CUDA driver: the compile target, a device index per architecture (the
    JIT caches its binder per device), no stream. Nothing is launched."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch, self.target = arch, GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _recording(launches: list):
    """kernel[grid](...) appends (kernel, args, kwargs) instead of compiling and launching."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw))
    try:
        yield
    finally:
        JITFunction.run = run


def _body(op):
    """A torch.library custom op's own Python function (what runs on a real device), bypassing the dispatch
    that would send fake tensors to its fake implementation."""
    fn = getattr(op, "_init_fn", None)  # torch 2.11 to 2.13 keep it there
    if fn is None:
        raise RuntimeError(f"this torch ({torch.__version__}) keeps custom op {op}'s function elsewhere: "
                           "kernels/cuda_build.py's _body needs updating")
    return fn


def launches(v: Variant) -> list[tuple]:
    """The (kernel, args, kwargs) the launch code issues for one forward and backward of variant v."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    got: list = []
    dt = DTYPES[v.dtype]
    with _recording(got), FakeTensorMode(allow_non_fake_inputs=True):
        def t(*shape, dtype=dt):
            return torch.empty(*shape, device="cuda", dtype=dtype)

        if v.op == "attention":
            from kernels.attention import triton_kernels as tk
            from kernels.attention.triton_path import blocks

            (D,), (B, H, T) = v.dims, (2, 12, 1024)
            q, k, val = (t(B, T, H, D).transpose(1, 2) for _ in range(3))  # the models' [B, T, H, D] views
            n = T // 16  # tile lists: their sizes are not compiled in, only their dtype
            lists = [t(1, n, dtype=torch.int32), t(1, n, n, dtype=torch.int32)] * 2
            runs = t(1, T, ATTENTION_RUNS, 2, dtype=torch.int32)
            bq, bk = blocks(q)  # the tiles a GPU picks for this dtype and head dim
            out, lse = _body(tk.block_sparse_attention)(q, k, val, runs, *lists, *lists, D ** -0.5, bq, bk)
            _body(tk.block_sparse_attention_backward)(t(B, H, T, D), q, k, val, out, lse, runs, *lists, *lists,
                                                      D ** -0.5, bq, bk)
        elif v.op == "rt_tile":
            from kernels.rt_prefill import tiled, triton_tile

            (D,), (B, H, n) = v.dims, (2, 16, 256)  # n: the largest tile at N = 512 (blocks cap below it)
            f32 = torch.float32
            qs, k, val, slopes = t(B, H, n, D, dtype=f32), t(B, H, n, D), t(B, H, n, D), t(H, dtype=f32)
            slopes = slopes if v.alibi else None
            # 16-bit keys are a training step's, under autocast: the products in their dtype (fp32: IEEE)
            with tiled.products_in(dt if dt != f32 else None):
                triton_tile.update_tile(qs, k, val, t(B, H, n, dtype=f32), t(B, H, n, dtype=f32),
                                        t(B, H, n, D, dtype=f32), slopes, n, 0)
                triton_tile.tile_grads(qs, k, val, t(B, H, n, D, dtype=f32), t(B, H, n, dtype=f32),
                                       t(B, H, n, dtype=f32), slopes, n, 0, t(B, H, n, D, dtype=f32),
                                       t(B, H, n, D, dtype=f32))
        elif v.op == "delta_memory":
            from kernels.delta_memory import triton_step as ts

            (dk, dv), (B, H) = v.dims, (2, 15)
            ins = (t(B, H, dk, dv), t(B, H, dk), t(B, H, dv), t(B, H), t(B, H), t(B, H, dk))
            from kernels import delta_memory

            for tile in delta_memory.TILES:  # every block size a GPU may measure and pick
                for blocks in delta_memory.BLOCKS.values():
                    blocks.force(str(tile))
                try:
                    _body(ts.delta_memory_step)(*ins)
                    _body(ts.delta_memory_step_backward)(t(B, H, dk, dv), t(B, H, dv), *ins)
                finally:
                    for blocks in delta_memory.BLOCKS.values():
                        blocks.force(None)
        else:
            raise ValueError(f"unknown kernel op {v.op!r}")
    return got


@dataclass
class Built:
    """One compiled launch configuration and its resources (-1: not read)."""
    variant: str
    kernel: str
    config: str  # constexprs, warps, stages
    shared: int = -1  # dynamic shared memory, bytes
    registers: int = -1  # per thread
    stack: int = -1  # per-thread stack bytes: spilled registers
    warps: int = 4
    seconds: float = 0.0
    error: str = ""

    def verdict(self, arch: int, max_stack: int | None) -> str:
        if self.error:
            return f"does not compile: {self.error}"
        if self.shared > SHARED_LIMIT[arch]:
            return (f"does not fit: {self.shared / 1024:.0f} KiB of shared memory, sm_{arch} has "
                    f"{SHARED_LIMIT[arch] / 1024:.0f} KiB")
        if self.blocks_per_sm(arch) == 0:
            return f"does not fit: {self.registers} registers x {32 * self.warps} threads, over an SM's 65,536"
        if max_stack is not None and self.stack > max_stack:
            return f"spills: {self.stack} bytes a thread, over --max-stack {max_stack}"
        return "ok"

    def blocks_per_sm(self, arch: int) -> int:
        """Resident blocks per SM, as CUDA's occupancy calculator counts them: registers (allocated per warp in
        units of 256), shared memory (plus the 1 KiB the runtime reserves per block), threads, the block cap."""
        if self.registers < 0 or self.shared < 0:
            return -1
        smem, threads, cap = SM_LIMITS[arch]
        per_warp = -(-self.registers * 32 // 256) * 256
        return min(65_536 // per_warp // self.warps, smem // (self.shared + 1024), threads // (32 * self.warps), cap)


def _cuobjdump() -> str | None:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def _resources(cubin: bytes, tool: str | None) -> tuple[int, int]:
    """(registers, stack bytes) of the binary's one function, from `cuobjdump -res-usage`."""
    if tool is None:
        return -1, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":", 1) for line in text.splitlines() if "REG:" in line for item in line.split())
    return int(fields["REG"]), int(fields["STACK"])


def build(v: Variant, arch: int) -> list[Built]:
    """Compile every launch of variant v for sm_<arch>."""
    from triton.runtime import driver

    tool, out = _cuobjdump(), []
    before = driver._active  # (reset_active would look for a real driver, which a machine without a GPU lacks)
    driver.set_active(_Target(arch))
    try:
        for kernel, args, kw in launches(v):
            consts = {k: val for k, val in kw.items() if k not in ("num_warps", "num_stages")}
            warps = kw.get("num_warps", 4)  # Triton's defaults where the launch names none
            config = (" ".join(f"{k}={val}" for k, val in consts.items())
                      + f" warps={warps} stages={kw.get('num_stages', 3)}")
            b = Built(v.name, kernel.fn.__name__, config, warps=warps)
            t0 = time.perf_counter()
            try:  # dtypes in place of tensors: warmup wraps them as Triton's MockTensor, 16-byte aligned
                compiled = kernel.warmup(*[a.dtype if isinstance(a, torch.Tensor) else a for a in args],
                                         grid=(1,), **kw)
                b.shared = compiled.metadata.shared
                b.registers, b.stack = _resources(compiled.asm["cubin"], tool)
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile is the finding, said in a line
                b.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
            b.seconds = time.perf_counter() - t0
            out.append(b)
    finally:
        driver._active = before
    return out


def table(rows: list[Built], arch: int, max_stack: int | None) -> str:
    import triton

    lines = [f"Triton {triton.__version__} for sm_{arch} ({ARCH_NAMES.get(arch, 'CUDA')}; shared memory limit "
             f"{SHARED_LIMIT[arch] / 1024:.0f} KiB a block)", "",
             "| variant | kernel | configuration | shared KiB | registers | stack bytes | blocks/SM | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for b in rows:
        lines.append(f"| {b.variant} | {b.kernel} | {b.config} | {b.shared / 1024:.1f} | {b.registers} | {b.stack} "
                     f"| {b.blocks_per_sm(arch)} | {b.verdict(arch, max_stack)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.cuda_build", description=__doc__.split("\n\n")[0],
                                epilog="Run it before a GPU window, and after changing a kernel or its launch code.")
    p.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_LIMIT),
                   help="compute capability without the dot (90: H100/H200, 80: A100, 100: B200); repeatable; "
                        "default 90")
    p.add_argument("--op", action="append", choices=("attention", "rt_tile", "delta_memory"),
                   help="only this kernel op (repeatable); default all")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="only this input dtype (repeatable)")
    p.add_argument("--head-dim", type=int, action="append", help="only this head dim (attention, rt_tile)")
    p.add_argument("--max-stack", type=int, default=None, help="fail on a kernel spilling more bytes a thread")
    p.add_argument("--json", help="also write every row, with its verdict, to this file")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: under the interpreter Triton does not compile")
    chosen = [v for v in variants(tuple(args.op or ("attention", "rt_tile", "delta_memory")))
              if (not args.dtype or v.dtype in args.dtype)
              and (not args.head_dim or v.op == "delta_memory" or v.dims[0] in args.head_dim)]
    failed, dump = 0, []
    for arch in args.arch or [90]:
        rows = []
        for i, v in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] sm_{arch} {v.name}", file=sys.stderr, flush=True)
            rows += build(v, arch)
        print(table(rows, arch, args.max_stack) + "\n", flush=True)
        failed += sum(b.verdict(arch, args.max_stack) != "ok" for b in rows)
        dump += [{**asdict(b), "arch": arch, "verdict": b.verdict(arch, args.max_stack),
                  "blocks_per_sm": b.blocks_per_sm(arch)} for b in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1)
    if failed:
        print(f"{failed} launch configuration(s) would fail or spill past the limit on the GPU", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
