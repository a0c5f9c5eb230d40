"""Block-sparse flash attention in Triton, forward and backward, driven by a mask's column runs.

The mask reaches the kernels as kernels/attention/runs.py builds it: per key column at most R runs
[start, end) of visible query rows, and per query block (forward, dq) or key block (dk, dv) the lists of
partial and full tiles to visit. Empty tiles are never visited; a full tile is computed without a mask;
a partial tile evaluates the runs of its columns against its rows. Everything else is FlashAttention-2:
an online softmax in base 2 with fp32 accumulators (inputs fp32, bf16 or fp16), the log-sum-exp kept for
the backward, which recomputes the probabilities per tile: one kernel per key block accumulates dk and
dv over the query heads that share it (grouped-query attention, no atomics), another per query block
accumulates dq. A query that sees no key gets a zero output and log-sum-exp +inf (its probabilities are
then zero in the backward), as the reference defines it.

The kernels assume the last dimension of q, k, v is contiguous and that the mask does not depend on the
head. fp32 inputs use IEEE products (tl.dot's "ieee"), so they match the reference to ~1e-6; bf16 and fp16
multiply in their own precision and accumulate in fp32.

`block_sparse_attention` is a torch custom op with its backward registered, so torch.compile treats it as
one opaque call. On a CPU the kernels run only under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_support import flash_tiles, pow2_block

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation. PREC "up": bf16/fp16 operands are widened to fp32 first (exact, and
    the same products): Triton's CPU interpreter gets bf16 tl.dot wrong (3.8), so the tests run this."""
    if PREC == "up":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _load2(X, base, idx, stride, offs_d, ok):
    """Rows idx of one [n, D] slice (X + base), zero where masked."""
    return tl.load(X + base + idx[:, None] * stride + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def _query_block(H, GROUP, Tq, D, BM: tl.constexpr, BD: tl.constexpr):
    """This program's (query block, sample * heads + head, sample, head, key/value head, rows, head-dim
    offsets, load mask) in the grid (query blocks, B * H)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    h = bh % H
    rows = qb * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    return qb, bh, bh // H, h, h // GROUP, rows, offs_d, (rows[:, None] < Tq) & (offs_d[None, :] < D)


@triton.jit
def _visible(RUNS, rb, rows, cols, Tk, R: tl.constexpr):
    """[BM, BN] bool: row i sees column k, from the runs of column k (RUNS + rb: this sample's runs)."""
    col_ok = cols < Tk
    at = RUNS + rb + cols * (2 * R)
    s = tl.load(at, mask=col_ok, other=0)
    e = tl.load(at + 1, mask=col_ok, other=0)
    ok = (rows[:, None] >= s[None, :]) & (rows[:, None] < e[None, :])
    for r in tl.static_range(1, R):
        s = tl.load(at + 2 * r, mask=col_ok, other=0)
        e = tl.load(at + 2 * r + 1, mask=col_ok, other=0)
        ok = ok | ((rows[:, None] >= s[None, :]) & (rows[:, None] < e[None, :]))
    return ok


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, K, V, kb, kbase, vbase, skt, svt, rows, offs_d, D, Tk, RUNS, rb, qk_scale,
              MASKED: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    cols = kb * BN + tl.arange(0, BN)
    kv_ok = (cols[:, None] < Tk) & (offs_d[None, :] < D)
    k = _load2(K, kbase, cols, skt, offs_d, kv_ok)
    v = _load2(V, vbase, cols, svt, offs_d, kv_ok)
    s = _dot(q, tl.trans(k), PREC) * qk_scale
    if MASKED:
        ok = _visible(RUNS, rb, rows, cols, Tk, R)
    else:
        ok = (rows[:, None] >= 0) & (cols[None, :] < Tk)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
    return acc, m_new, l_i


@triton.jit
def _fwd(Q, K, V, O, LSE, RUNS, PN, PI, FN, FI,
         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, s_runs, s_num, s_list,
         H, GROUP, Tq, Tk, D, NKB, qk_scale,
         R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    qb, bh, b, h, kvh, rows, offs_d, q_ok = _query_block(H, GROUP, Tq, D, BM, BD)
    q = _load2(Q, b * sqb + h * sqh, rows, sqt, offs_d, q_ok)
    kbase = b * skb + kvh * skh
    vbase = b * svb + kvh * svh
    rb = b * s_runs
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    at = b * s_list + qb * NKB
    for j in range(tl.load(PN + b * s_num + qb)):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, tl.load(PI + at + j), kbase, vbase, skt, svt, rows, offs_d,
                                  D, Tk, RUNS, rb, qk_scale, True, R, BN, PREC)
    for j in range(tl.load(FN + b * s_num + qb)):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, tl.load(FI + at + j), kbase, vbase, skt, svt, rows, offs_d,
                                  D, Tk, RUNS, rb, qk_scale, False, R, BN, PREC)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty), mask=q_ok)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + bh * Tq + rows, lse, mask=rows < Tq)


@triton.jit
def _probs(q, k, lse, rows, cols, Tk, RUNS, rb, qk_scale, MASKED: tl.constexpr, R: tl.constexpr,
           PREC: tl.constexpr):
    """The tile's attention probabilities, recomputed from the log-sum-exp (zero where masked)."""
    p = tl.exp2(_dot(q, tl.trans(k), PREC) * qk_scale - lse[:, None])
    if MASKED:
        ok = _visible(RUNS, rb, rows, cols, Tk, R)
    else:
        ok = (rows[:, None] >= 0) & (cols[None, :] < Tk)
    return tl.where(ok, p, 0.0)


@triton.jit
def _bwd_kv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, qb, qbase, dobase, lbase, sqt, sdot, cols, offs_d, D, Tq, Tk,
                 RUNS, rb, qk_scale, MASKED: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr):
    rows = qb * BM + tl.arange(0, BM)
    q_ok = (rows[:, None] < Tq) & (offs_d[None, :] < D)
    q = _load2(Q, qbase, rows, sqt, offs_d, q_ok)
    do = _load2(DO, dobase, rows, sdot, offs_d, q_ok)
    lse = tl.load(LSE + lbase + rows, mask=rows < Tq, other=float("inf"))
    delta = tl.load(DELTA + lbase + rows, mask=rows < Tq, other=0.0)
    p = _probs(q, k, lse, rows, cols, Tk, RUNS, rb, qk_scale, MASKED, R, PREC)
    dv += _dot(tl.trans(p.to(do.dtype)), do, PREC)
    ds = p * (_dot(do, tl.trans(v), PREC) - delta[:, None])
    dk += _dot(tl.trans(ds.to(q.dtype)), q, PREC)
    return dk, dv


@triton.jit
def _bwd_kv(Q, K, V, DO, LSE, DELTA, DK, DV, RUNS, PN, PI, FN, FI,
            sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
            s_runs, s_num, s_list,
            H, H_KV, GROUP, Tq, Tk, D, NQB, qk_scale, sm_scale,
            R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    kb = tl.program_id(0)
    bkv = tl.program_id(1)
    b = bkv // H_KV
    kvh = bkv % H_KV
    cols = kb * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kv_ok = (cols[:, None] < Tk) & (offs_d[None, :] < D)
    k = _load2(K, b * skb + kvh * skh, cols, skt, offs_d, kv_ok)
    v = _load2(V, b * svb + kvh * svh, cols, svt, offs_d, kv_ok)
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BD), tl.float32)
    rb = b * s_runs
    at = b * s_list + kb * NQB
    n_partial = tl.load(PN + b * s_num + kb)
    n_full = tl.load(FN + b * s_num + kb)
    for g in range(GROUP):  # the query heads that read this key/value head
        h = kvh * GROUP + g
        qbase = b * sqb + h * sqh
        dobase = b * sdob + h * sdoh
        lbase = (b * H + h) * Tq
        for j in range(n_partial):
            dk, dv = _bwd_kv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, tl.load(PI + at + j), qbase, dobase, lbase, sqt,
                                  sdot, cols, offs_d, D, Tq, Tk, RUNS, rb, qk_scale, True, R, BM, PREC)
        for j in range(n_full):
            dk, dv = _bwd_kv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, tl.load(FI + at + j), qbase, dobase, lbase, sqt,
                                  sdot, cols, offs_d, D, Tq, Tk, RUNS, rb, qk_scale, False, R, BM, PREC)
    dk_at = b * sdkb + kvh * sdkh + cols[:, None] * sdkt + offs_d[None, :]
    dv_at = b * sdvb + kvh * sdvh + cols[:, None] * sdvt + offs_d[None, :]
    tl.store(DK + dk_at, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + dv_at, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_q_tile(dq, q, do, lse, delta, K, V, kb, kbase, vbase, skt, svt, rows, offs_d, D, Tk, RUNS, rb, qk_scale,
                MASKED: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    cols = kb * BN + tl.arange(0, BN)
    kv_ok = (cols[:, None] < Tk) & (offs_d[None, :] < D)
    k = _load2(K, kbase, cols, skt, offs_d, kv_ok)
    v = _load2(V, vbase, cols, svt, offs_d, kv_ok)
    p = _probs(q, k, lse, rows, cols, Tk, RUNS, rb, qk_scale, MASKED, R, PREC)
    ds = p * (_dot(do, tl.trans(v), PREC) - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, PREC)


@triton.jit
def _bwd_q(Q, K, V, DO, LSE, DELTA, DQ, RUNS, PN, PI, FN, FI,
           sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt, s_runs, s_num, s_list,
           H, GROUP, Tq, Tk, D, NKB, qk_scale, sm_scale,
           R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    qb, bh, b, h, kvh, rows, offs_d, q_ok = _query_block(H, GROUP, Tq, D, BM, BD)
    q = _load2(Q, b * sqb + h * sqh, rows, sqt, offs_d, q_ok)
    do = _load2(DO, b * sdob + h * sdoh, rows, sdot, offs_d, q_ok)
    lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=float("inf"))
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    kbase = b * skb + kvh * skh
    vbase = b * svb + kvh * svh
    rb = b * s_runs
    at = b * s_list + qb * NKB
    dq = tl.zeros((BM, BD), tl.float32)
    for j in range(tl.load(PN + b * s_num + qb)):
        dq = _bwd_q_tile(dq, q, do, lse, delta, K, V, tl.load(PI + at + j), kbase, vbase, skt, svt, rows, offs_d, D,
                         Tk, RUNS, rb, qk_scale, True, R, BN, PREC)
    for j in range(tl.load(FN + b * s_num + qb)):
        dq = _bwd_q_tile(dq, q, do, lse, delta, K, V, tl.load(FI + at + j), kbase, vbase, skt, svt, rows, offs_d, D,
                         Tk, RUNS, rb, qk_scale, False, R, BN, PREC)
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_ok)


def _bstride(t: Tensor) -> int:
    """The batch stride of a list or runs tensor, 0 when one is shared by every sample."""
    return 0 if t.shape[0] == 1 else t.stride(0)


def _launch_shape(q: Tensor) -> tuple[int, int, str, int, int]:
    """(D, BD, products, warps, stages); warps and stages by FLASH_TILES on a GPU (the interpreter ignores them)."""
    D = q.shape[-1]
    prec = "ieee" if q.dtype == torch.float32 else "up" if q.device.type == "cpu" else "tf32"  # (tf32: unread)
    _, _, warps, stages = flash_tiles(D, q.dtype != torch.float32)
    return D, pow2_block(D), prec, warps, stages


def _dense_like(t: Tensor) -> Tensor:
    """An uninitialised tensor of t's shape and dtype, dense, its dimensions laid out in the order of t's
    strides (the head dimension innermost): a gradient or output in its input's layout ([B, H, T, D] views
    of [B, T, H, D] stay so, no copy later) even when t itself has gaps (a slice of a fused projection)."""
    outer = sorted(range(t.dim() - 1), key=lambda i: -t.stride(i))  # stable: ties keep their order
    strides, step = [0] * t.dim(), 1
    for i in [*outer, t.dim() - 1][::-1]:
        strides[i] = step
        step *= t.shape[i]
    if all(t.shape[i] == 1 or t.stride(i) == strides[i] for i in range(t.dim())):
        strides = t.stride()  # t is dense already: its own strides, size-1 dimensions' included
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)


# The outputs of both ops are allocated here alone, by the real functions and their fake (meta) ones
# alike: under torch.compile the compiled graph checks the real outputs' sizes and strides against
# the fake ones, and two allocations that drift apart fail there (issue 34).
def _forward_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """(out in q's layout, log2-sum-exp [B, H, Tq] fp32 contiguous)."""
    return _dense_like(q), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)


def _backward_outputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each in its input's layout."""
    return _dense_like(q), _dense_like(k), _dense_like(v)


@torch.library.custom_op("pretrain::block_sparse_attention", mutates_args=())
def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, runs: Tensor, q_pn: Tensor, q_pi: Tensor, q_fn: Tensor,
                           q_fi: Tensor, k_pn: Tensor, k_pi: Tensor, k_fn: Tensor, k_fi: Tensor, scale: float,
                           block_q: int, block_k: int) -> tuple[Tensor, Tensor]:
    """(out [B, H, Tq, D], log2-sum-exp [B, H, Tq] fp32). q, k, v contiguous in their last dimension."""
    B, H, Tq, _ = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    D, BD, prec, warps, stages = _launch_shape(q)
    out, lse = _forward_outputs(q)
    grid = (triton.cdiv(Tq, block_q), B * H)
    _fwd[grid](q, k, v, out, lse, runs, q_pn, q_pi, q_fn, q_fi,
               *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
               _bstride(runs), _bstride(q_pn), _bstride(q_pi),
               H, H // H_kv, Tq, Tk, D, q_pi.shape[-1], scale * LOG2E,
               R=runs.shape[2], BM=block_q, BN=block_k, BD=BD, PREC=prec, num_warps=warps, num_stages=stages)
    return out, lse


@block_sparse_attention.register_fake
def _(q, k, v, runs, q_pn, q_pi, q_fn, q_fi, k_pn, k_pi, k_fn, k_fi, scale, block_q, block_k):
    return _forward_outputs(q)


@torch.library.custom_op("pretrain::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                    runs: Tensor, q_pn: Tensor, q_pi: Tensor, q_fn: Tensor, q_fi: Tensor,
                                    k_pn: Tensor, k_pi: Tensor, k_fn: Tensor, k_fi: Tensor, scale: float,
                                    block_q: int, block_k: int) -> tuple[Tensor, Tensor, Tensor]:
    B, H, Tq, _ = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    D, BD, prec, warps, stages = _launch_shape(q)
    do, lse = do.contiguous(), lse.contiguous()  # the kernels index lse and delta as [B * H * Tq]
    delta = (do.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O), the softmax backward's correction
    dq, dk, dv = _backward_outputs(q, k, v)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    _bwd_kv[(triton.cdiv(Tk, block_k), B * H_kv)](
        q, k, v, do, lse, delta, dk, dv, runs, k_pn, k_pi, k_fn, k_fi, *strides, *dk.stride()[:3], *dv.stride()[:3],
        _bstride(runs), _bstride(k_pn), _bstride(k_pi), H, H_kv, H // H_kv, Tq, Tk, D, k_pi.shape[-1],
        scale * LOG2E, scale, R=runs.shape[2], BM=block_q, BN=block_k, BD=BD, PREC=prec, num_warps=warps,
        num_stages=stages)
    _bwd_q[(triton.cdiv(Tq, block_q), B * H)](
        q, k, v, do, lse, delta, dq, runs, q_pn, q_pi, q_fn, q_fi, *strides, *dq.stride()[:3],
        _bstride(runs), _bstride(q_pn), _bstride(q_pi), H, H // H_kv, Tq, Tk, D, q_pi.shape[-1],
        scale * LOG2E, scale, R=runs.shape[2], BM=block_q, BN=block_k, BD=BD, PREC=prec, num_warps=warps,
        num_stages=stages)
    return dq, dk, dv


@block_sparse_attention_backward.register_fake
def _(do, q, k, v, out, lse, runs, q_pn, q_pi, q_fn, q_fi, k_pn, k_pi, k_fn, k_fi, scale, block_q, block_k):
    return _backward_outputs(q, k, v)


def _setup(ctx, inputs, output):
    q, k, v, *lists, scale, block_q, block_k = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *lists)
    ctx.args = (scale, block_q, block_k)


def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse, *lists = ctx.saved_tensors
    dq, dk, dv = block_sparse_attention_backward(d_out, q, k, v, out, lse, *lists, *ctx.args)
    return (dq, dk, dv) + (None,) * (len(lists) + 3)


block_sparse_attention.register_autograd(_backward, setup_context=_setup)
