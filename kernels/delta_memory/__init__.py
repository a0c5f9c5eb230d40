"""GPN+M's matrix memory over a sequence of fixed inputs: one op, two paths (spec-002 §2.5, §6 T6).

    delta_memory(q, k, v, beta, alpha, M0=None, chunk=0) -> (reads [B, T, H, d_v], last M)

Paths (kernels/registry.py):
    "chunked"    chunk steps per triangular solve (chunked.py), picked when chunk > 0
    "reference"  step by step (reference.py): the definition
The model's time loop cannot use either (its q, k, v, beta, alpha depend on the state): it calls the ops
"delta_memory_step" (one write and the first read) and "delta_memory_read" (a later read), whose
"reference" paths are reference.step / reference.read; the chunked form stays a tested identity for
fixed inputs. "delta_memory_step" has a second path:
    "triton"     the write and the first read fused, one kernel forward and one backward (triton_step.py,
                 custom ops pretrain::delta_memory_step{,_backward}): automatic on CUDA for a float32 state
                 (above "reference"); on a CPU only forced (PRETRAIN_KERNELS=delta_memory_step=triton) under
                 TRITON_INTERPRET=1 (the tests), so CPU runs and their golden curves stay on "reference";
                 float64 is refused (its arithmetic is fp32)
"""
from __future__ import annotations

import torch

from kernels import registry
from kernels.delta_memory import chunked, reference
from kernels.triton_support import triton_can_run

OP = registry.op("delta_memory")
OP.register("chunked", chunked.recurrence, priority=10,
            capable=lambda q, k, v, beta, alpha, M0=None, chunk=0: chunk > 0)
OP.register("reference", reference.recurrence)


def delta_memory(q, k, v, beta, alpha, M0=None, chunk: int = 0):
    return OP(q, k, v, beta, alpha, M0, chunk=chunk)


# The model's time loop, whose inputs depend on the state, one step at a time:
#     memory_step(M, k, v, beta, alpha, q) -> (M_t, M_t^T q)   the write, then the first read
#     memory_read(M, q) -> M^T q                                 a later predict sub-layer's read
STEP = registry.op("delta_memory_step")
MAX_D_KEY = 1024  # the Triton step holds a whole key column per program


def _triton_step(M, k, v, beta, alpha, q):
    # Triton is imported on the first call only
    from kernels.delta_memory import triton_step

    return triton_step.step(M, k, v, beta, alpha, q)


def _triton_refusal(M, k, v, beta, alpha, q):
    """Why the Triton step cannot serve this call (None: it can). Python values only: devices, dtypes, shapes."""
    if not triton_can_run(M):
        return (f"the Triton memory step runs on CUDA with Triton installed, or on a CPU under TRITON_INTERPRET=1; "
                f"the state is on {M.device.type}")
    if M.device.type == "cpu" and STEP.forced != "triton":
        return "on a CPU the Triton memory step (Triton's interpreter) runs only when forced"
    if M.dtype != torch.float32:
        return f"the Triton memory step keeps a float32 state (its arithmetic is fp32); the state is {M.dtype}"
    for t in (k, v, beta, alpha, q):
        if t.device != M.device:
            return f"the memory step's inputs must share the state's device ({M.device}), got {t.device}"
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the Triton memory step takes float32, bfloat16 or float16 inputs, got {t.dtype}"
    if M.shape[-2] > MAX_D_KEY:
        return f"the Triton memory step holds a whole key column per program: d_k <= {MAX_D_KEY}, got {M.shape[-2]}"
    return None


STEP.register("triton", _triton_step, priority=10, refusal=_triton_refusal)
STEP.register("reference", reference.step)


def _step_key(M, k, v, beta, alpha, q):
    """Calls that share a measured choice: CUDA only (a CPU keeps the static priority, so no CPU test or
    golden curve moves); the shape, the dtypes and whether a backward follows. Python values only."""
    if M.device.type != "cuda":
        return None
    grad = any(t.requires_grad for t in (M, k, v, beta, alpha, q))
    return (*M.shape, M.dtype, k.dtype, grad, str(M.device))


def _step_inputs(key):
    """Fresh synthetic inputs of a key's shape (never the caller's): a unit key, beta and alpha in (0, 1)."""
    B, H, dk, dv, state, dtype, grad, device = key
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda *shape, dt=dtype: torch.randn(*shape, generator=g, device=device, dtype=dt)  # noqa: E731
    k = torch.nn.functional.normalize(make(B, H, dk, dt=torch.float32), dim=-1).to(dtype)
    args = [make(B, H, dk, dv, dt=state), k, make(B, H, dv), torch.rand(B, H, generator=g, device=device, dtype=dtype),
            torch.rand(B, H, generator=g, device=device, dtype=dtype), make(B, H, dk)]
    return [t.requires_grad_(grad) for t in args], {}


# on CUDA the first call of each shape times both paths' forward + backward and keeps the faster (the
# Triton step's gain depends on B x H against the GPU's SMs and on d_v's blocks: measured, not assumed)
def _describe(key) -> str:
    """A step's or a block op's key in the report: the shape and the inputs' dtype (key[5])."""
    return "B {} H {} d_k {} d_v {} {}".format(*key[:4], str(key[5])[6:])


STEP.measure_with(registry.Measured(_step_key, _step_inputs, describe=_describe))

# The Triton step's block size, elements of one [d_k, BV] block per program (BV shrinks as d_k grows), its
# forward's and its backward's: the paths of two ops, measured per shape on CUDA on their first call like the
# step's own path, and so kept across a resume (the backward's sums over columns, and Triton's reductions,
# group differently at another block size: a near tie measured again could change the low bits). Elsewhere,
# and when not measured, the default: the forward's as the second window measured it, the backward's (which
# holds several blocks live: M, dN, N and their products) the one with no spills and the most warps an SM.
TILES = (2048, 4096, 8192)
DEFAULT_TILE = {"forward": 8192, "backward": 2048}
BLOCKS = {kind: registry.op(f"delta_memory_blocks_{kind}") for kind in DEFAULT_TILE}


def _launcher(kind: str, tile: int):
    def launch(*args):
        from kernels.delta_memory import triton_step

        return getattr(triton_step, f"launch_{kind}")(tile, *args)
    return launch


def _blocks_key(M, k, *_):
    """Calls that share a block size: CUDA only; the shape and the dtypes. Python values only."""
    return (*M.shape, M.dtype, k.dtype, str(M.device)) if M.device.type == "cuda" else None


def _blocks_inputs(kind: str, key):
    """Fresh synthetic arguments of a key's shape for one kind's launch: the step's inputs, (the backward's
    incoming gradients,) and the outputs it writes."""
    B, H, dk, dv, state, dtype, device = key
    ins = [t.detach() for t in _step_inputs((B, H, dk, dv, state, dtype, False, device))[0]]
    if kind == "forward":
        return (*ins, torch.empty_like(ins[0]), ins[0].new_empty(B, H, dv)), {}
    grads_in = (torch.randn_like(ins[0]), ins[0].new_empty(B, H, dv).normal_())
    return (*ins, *grads_in, *(torch.empty_like(t) for t in ins)), {}


for _kind, _op in BLOCKS.items():
    for _tile in TILES:
        _op.register(str(_tile), _launcher(_kind, _tile), priority=1 if _tile == DEFAULT_TILE[_kind] else 0)
    _op.measure_with(registry.Measured(_blocks_key, lambda key, kind=_kind: _blocks_inputs(kind, key),
                                       describe=_describe))

READ = registry.op("delta_memory_read")
READ.register("reference", reference.read)


def memory_step(M, k, v, beta, alpha, q):
    return STEP(M, k, v, beta, alpha, q)


def memory_read(M, q):
    return READ(M, q)


__all__ = ["BLOCKS", "OP", "READ", "STEP", "chunked", "delta_memory", "memory_read", "memory_step", "reference"]
