"""GPN+M's memory step (reference.step: write, then the first read) as Triton kernels, forward and backward.

Per (sample, head), with M [d_k, d_v], k, q [d_k], v [d_v] and scalars beta, alpha:

    e = M^T k,  r = v - e,  u = beta r          the erase reads the UNdecayed M
    N = alpha M + k u^T                         the new memory M_t
    o = N^T q                                   the first read

Every column j of M is independent in the forward (e_j, u_j, N[:, j], o_j read column j and the
vectors only), so the forward gives each program one block of columns of one (sample, head) and holds
the whole key dimension. The backward, from G = dL/dN and g = dL/do:

    G' = G + q g^T                              the read's share of N's gradient
    dq = N g                 du = G'^T k        dbeta = <r, du>      dv = beta du   (= dr)
    dalpha = <M, G'>         dk = G' u - M dr   dM = alpha G' - k dr^T

dM and dv are column-local again, but dq, dk, dalpha and dbeta sum over every column: each program
(one block of columns of one (sample, head), as in the forward) writes its block's partial sums, and
one reduction over the blocks follows (deterministic: no atomics). It recomputes e, u and N from the
inputs, so autograd saves only the step's inputs.

All products are matrix-vector: elementwise products and tl.sum reductions in fp32 (no tl.dot, so no
minimum block size and no TF32), so the kernels agree with reference.step to fp32 rounding. Inputs of
any float dtype are widened to fp32 on load; M_t and o come out in M's dtype, each gradient in its
input's dtype. M must not be float64 (the arithmetic is fp32). Inputs may have any strides; outputs are
allocated contiguous, by the real functions and the fake ones alike (torch.compile compares them).

`delta_memory_step` is a torch custom op with its backward (`delta_memory_step_backward`, also a custom
op) registered, so torch.compile treats the step as one opaque call. On a CPU the kernels run only
under TRITON_INTERPRET=1 (the tests); kernels/delta_memory/__init__.py imports this module on the
first call of its "triton" path, so Triton is never imported otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import registry


@triton.jit
def _vec(X, base, idx, stride, ok):
    return tl.load(X + base + idx * stride, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _mat(X, base, rows, cols, s_r, s_c, ok):
    return tl.load(X + base + rows[:, None] * s_r + cols[None, :] * s_c, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _step_fwd(M, K, V, BETA, ALPHA, Q, MT, O,
              smb, smh, smk, smv, skb, skh, skk, svb, svh, svv, sbb, sbh, sab, sah, sqb, sqh, sqk,
              H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements (a large batch of d_k x d_v states)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    r_ok = rows < DK
    c_ok = cols < DV
    ok = r_ok[:, None] & c_ok[None, :]
    m = _mat(M, b * smb + h * smh, rows, cols, smk, smv, ok)
    k = _vec(K, b * skb + h * skh, rows, skk, r_ok)
    q = _vec(Q, b * sqb + h * sqh, rows, sqk, r_ok)
    v = _vec(V, b * svb + h * svh, cols, svv, c_ok)
    beta = tl.load(BETA + b * sbb + h * sbh).to(tl.float32)
    alpha = tl.load(ALPHA + b * sab + h * sah).to(tl.float32)
    u = beta * (v - tl.sum(m * k[:, None], 0))  # masked rows and columns are zero: they add nothing
    n = alpha * m + k[:, None] * u[None, :]
    o = tl.sum(n * q[:, None], 0)
    tl.store(MT + bh * DK * DV + rows[:, None] * DV + cols[None, :], n.to(MT.dtype.element_ty), mask=ok)
    tl.store(O + bh * DV + cols, o.to(O.dtype.element_ty), mask=c_ok)


@triton.jit
def _step_bwd(M, K, V, BETA, ALPHA, Q, GM, GO, DM, DV_, PART,
              smb, smh, smk, smv, skb, skh, skk, svb, svh, svv, sbb, sbh, sab, sah, sqb, sqh, sqk,
              sgb, sgh, sgk, sgv, sob, soh, sov,
              H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements (a large batch of d_k x d_v states)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    r_ok = rows < DK
    c_ok = cols < DV
    ok = r_ok[:, None] & c_ok[None, :]
    k = _vec(K, b * skb + h * skh, rows, skk, r_ok)
    q = _vec(Q, b * sqb + h * sqh, rows, sqk, r_ok)
    beta = tl.load(BETA + b * sbb + h * sbh).to(tl.float32)
    alpha = tl.load(ALPHA + b * sab + h * sah).to(tl.float32)
    m = _mat(M, b * smb + h * smh, rows, cols, smk, smv, ok)
    g = _mat(GM, b * sgb + h * sgh, rows, cols, sgk, sgv, ok)
    go = _vec(GO, b * sob + h * soh, cols, sov, c_ok)
    v = _vec(V, b * svb + h * svh, cols, svv, c_ok)
    r = v - tl.sum(m * k[:, None], 0)  # recomputed forward: r = v - M^T k, u = beta r, N
    u = beta * r
    n = alpha * m + k[:, None] * u[None, :]
    g = g + q[:, None] * go[None, :]  # G' = dN + q do^T
    du = tl.sum(g * k[:, None], 0)
    dr = beta * du
    tl.store(DM + bh * DK * DV + rows[:, None] * DV + cols[None, :],
             (alpha * g - k[:, None] * dr[None, :]).to(DM.dtype.element_ty), mask=ok)
    tl.store(DV_ + bh * DV + cols, dr.to(DV_.dtype.element_ty), mask=c_ok)
    # this block's shares of the sums over columns: [dq (BK), dk (BK), dalpha, dbeta], fp32 (_sum_blocks)
    part = PART + (bh * tl.num_programs(1) + tl.program_id(1)) * (2 * BK + 2)
    tl.store(part + rows, tl.sum(n * go[None, :], 1))
    tl.store(part + BK + rows, tl.sum(g * u[None, :] - m * dr[None, :], 1))
    tl.store(part + 2 * BK, tl.sum(tl.sum(m * g, 0), 0))
    tl.store(part + 2 * BK + 1, tl.sum(r * du, 0))


@triton.jit
def _sum_blocks(PART, DQ, DK_, DALPHA, DBETA, NB, DK, BK: tl.constexpr):
    """The backward's sums over columns from its blocks' shares, in block order, one program per (sample, head)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BK)
    two = tl.arange(0, 2)
    dq = tl.zeros((BK,), tl.float32)
    dk = tl.zeros((BK,), tl.float32)
    scalars = tl.zeros((2,), tl.float32)  # dalpha, dbeta
    for i in range(0, NB):
        part = PART + (bh * NB + i) * (2 * BK + 2)
        dq += tl.load(part + rows)
        dk += tl.load(part + BK + rows)
        scalars += tl.load(part + 2 * BK + two)
    r_ok = rows < DK
    tl.store(DQ + bh * DK + rows, dq.to(DQ.dtype.element_ty), mask=r_ok)
    tl.store(DK_ + bh * DK + rows, dk.to(DK_.dtype.element_ty), mask=r_ok)
    tl.store(DALPHA + bh, tl.sum(tl.where(two == 0, scalars, 0.0), 0).to(DALPHA.dtype.element_ty))
    tl.store(DBETA + bh, tl.sum(tl.where(two == 1, scalars, 0.0), 0).to(DBETA.dtype.element_ty))


def launch_forward(tile: int, M, k, v, beta, alpha, q, Mt, o) -> None:
    """The forward kernel into Mt, o at blocks of `tile` elements (a path of delta_memory_blocks_forward)."""
    B, H, dk, dv = M.shape
    BK, BV, warps = _blocks(dk, dv, tile)
    _step_fwd[(B * H, triton.cdiv(dv, BV))](M, k, v, beta, alpha, q, Mt, o, *_strides(M, k, v, beta, alpha, q),
                                             H, dk, dv, BK=BK, BV=BV, num_warps=warps)


def launch_backward(tile: int, M, k, v, beta, alpha, q, dMt, do, dM, dk_, dv_, dbeta, dalpha, dq) -> None:
    """The backward kernels into dM .. dq at blocks of `tile` elements (a path of delta_memory_blocks_backward):
    each block's shares of the sums over columns, then _sum_blocks."""
    B, H, dk, dv = M.shape
    BK, BV, warps = _blocks(dk, dv, tile)
    blocks = triton.cdiv(dv, BV)
    part = torch.empty(B * H, blocks, 2 * BK + 2, device=M.device, dtype=torch.float32)
    _step_bwd[(B * H, blocks)](M, k, v, beta, alpha, q, dMt, do, dM, dv_, part,
                               *_strides(M, k, v, beta, alpha, q, dMt, do), H, dk, dv, BK=BK, BV=BV, num_warps=warps)
    _sum_blocks[(B * H,)](part, dq, dk_, dalpha, dbeta, blocks, dk, BK=BK, num_warps=4)


def _blocks(dk: int, dv: int, tile: int) -> tuple[int, int, int]:
    """(BK, BV, warps): a whole key column by BV columns, at most `tile` elements unless one column is more;
    8 warps for blocks of 4,096 elements or more. Compiled for sm_90 (python -m kernels.cuda_build --op
    delta_memory), GPN+M's d_k 128 x d_v 256 in fp32, registers and blocks an SM at tiles 2,048 / 4,096 /
    8,192: forward 48 and 10 / 48 and 5 / 80 and 3; backward 90 and 5 / 80 and 3 (8 bytes spilled) / 146
    and 1. (The backward had run one program per (sample, head) over all its column blocks in turn,
    128 x 64 at a time: 223 registers, one block of 8 warps an SM, 1,920 programs at micro batch 128.)
    Which is fastest is measured on the GPU (delta_memory/__init__'s block ops)."""
    BK = triton.next_power_of_2(max(dk, 1))
    BV = max(1, min(triton.next_power_of_2(max(dv, 1)), tile // BK))
    return BK, BV, 8 if BK * BV >= 4096 else 4


def _check(M: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, q: Tensor) -> None:
    if M.dim() != 4:
        raise ValueError(f"the memory step needs M [B, H, d_k, d_v], got shape {tuple(M.shape)}")
    B, H, dk, dv = M.shape
    want = {"k": (B, H, dk), "v": (B, H, dv), "beta": (B, H), "alpha": (B, H), "q": (B, H, dk)}
    for name, t in zip(want, (k, v, beta, alpha, q)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"the memory step needs {name} of shape {want[name]}, got {tuple(t.shape)}")
    for t in (M, k, v, beta, alpha, q):
        if not t.is_floating_point() or t.dtype == torch.float64:
            raise ValueError(f"the Triton memory step computes in fp32: inputs must be float32, bfloat16 or "
                             f"float16, got {t.dtype}")


def _strides(*ts: Tensor) -> list[int]:
    return [s for t in ts for s in t.stride()]


# The outputs of both ops are allocated here alone, by the real functions and the fakes alike.
def _forward_outputs(M: Tensor) -> tuple[Tensor, Tensor]:
    """(M_t [B, H, d_k, d_v], o [B, H, d_v]), contiguous, in M's dtype."""
    B, H, dk, dv = M.shape
    return (torch.empty(B, H, dk, dv, device=M.device, dtype=M.dtype),
            torch.empty(B, H, dv, device=M.device, dtype=M.dtype))


def _backward_outputs(*inputs: Tensor) -> tuple[Tensor, ...]:
    """(dM, dk, dv, dbeta, dalpha, dq), contiguous, each in its input's shape and dtype."""
    return tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in inputs)


@torch.library.custom_op("pretrain::delta_memory_step", mutates_args=())
def delta_memory_step(M: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor,
                      q: Tensor) -> tuple[Tensor, Tensor]:
    """(M_t = alpha M + beta k (v - M^T k)^T, o = M_t^T q) per (sample, head)."""
    _check(M, k, v, beta, alpha, q)
    B, H, dk, dv = M.shape
    Mt, o = _forward_outputs(M)
    if Mt.numel() == 0:
        return Mt, o.zero_()
    # the block size: a measured choice (delta_memory/__init__ registers the op's paths; by name, not imported,
    # since the package imports this module)
    registry.op("delta_memory_blocks_forward")(M, k, v, beta, alpha, q, Mt, o)
    return Mt, o


@delta_memory_step.register_fake
def _(M, k, v, beta, alpha, q):
    return _forward_outputs(M)


@torch.library.custom_op("pretrain::delta_memory_step_backward", mutates_args=())
def delta_memory_step_backward(dMt: Tensor, do: Tensor, M: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                               alpha: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dM, dk, dv, dbeta, dalpha, dq) of delta_memory_step from dL/dM_t and dL/do."""
    _check(M, k, v, beta, alpha, q)
    B, H, dk, dv = M.shape
    if tuple(dMt.shape) != (B, H, dk, dv) or tuple(do.shape) != (B, H, dv):
        raise ValueError(f"the memory step's backward needs dM_t {(B, H, dk, dv)} and do {(B, H, dv)}, got "
                         f"{tuple(dMt.shape)} and {tuple(do.shape)}")
    grads = _backward_outputs(M, k, v, beta, alpha, q)
    if M.numel() == 0:
        return tuple(g.zero_() for g in grads)
    registry.op("delta_memory_blocks_backward")(M, k, v, beta, alpha, q, dMt, do, *grads)
    return grads


@delta_memory_step_backward.register_fake
def _(dMt, do, M, k, v, beta, alpha, q):
    return _backward_outputs(M, k, v, beta, alpha, q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # the inputs only: the backward recomputes e, u and M_t per column block


def _backward(ctx, dMt, do):
    return delta_memory_step_backward(dMt, do, *ctx.saved_tensors)


delta_memory_step.register_autograd(_backward, setup_context=_setup)


def step(M: Tensor, k: Tensor, v: Tensor, beta: Tensor, alpha: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """reference.step's signature and values: (M_t, M_t^T q)."""
    return delta_memory_step(M, k, v, beta, alpha, q)
