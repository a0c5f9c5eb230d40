"""The RT tile (spec-003 §3.8) as Triton kernels: the two per-tile functions of tiled.py.

    update_tile(qs, k, v, m, l, O, slopes, q0, k0)      fold keys into queries' online softmax, in place
    tile_grads(qs, k, v, g, D, lse, slopes, q0, k0, dk, dv)   add one tile's d k, d v into dk, dv (from the log-sum-exp)

with the signatures and semantics of tiled.update_tile and tiled.tile_grads (the references they are
tested against), so the tile schedule, the leaf-block variant and the custom backward run unchanged
around them (`OPS`). Every key of a tile precedes every query, so no causal mask: only ALiBi,
-slope_h (i - j), computed in the kernel from the positions q0.., k0.. (no bias tensor).

The forward kernel gives each program a block of queries of one (sample, head), loads its (m, l, O),
loops over the tile's keys in blocks and writes the state back. The backward is FlashAttention-2's
restricted to the tile: each program takes a block of keys, accumulates its dk, dv over the query
blocks and adds them into the layer's accumulators (the queries' gradient is taken after the reverse
loop, for all positions at once: tiled.earlier_keys_grad). Scaled queries and the softmax state are fp32 (tiled.py's accumulators).
The products take the operands the PyTorch tile's do (tiled._product): under the tiled call's autocast both
operands of every product in its 16-bit dtype, accumulated in fp32 (tensor cores; the scores stay fp32, where
the PyTorch tile's bf16 product rounds them); without autocast IEEE fp32, keys and values of any float dtype
widened, so the kernels agree with the PyTorch tile to rounding. Blocks (kernels/triton_support.FLASH_TILES):
16-bit products 64 rows at head dim 64, fp32 products 16 to 32 (64 spilled 6.7 KB of registers a thread at
head dim 64; tl.dot needs 16), rows past a tile masked;
tiles of P < 16 keys are where the leaf-block variant (leaf = 16: every query reads its own leaf's keys
directly) saves launches: N = 512 runs 31 tiles instead of 511.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.rt_prefill import tiled
from kernels.triton_support import flash_tiles, pow2_block


@triton.jit
def _narrow(x, LOW: tl.constexpr):
    """x in the products' dtype: bf16 (LOW 1), fp16 (2), or fp32 (0)."""
    if LOW == 1:
        x = x.to(tl.bfloat16)
    elif LOW == 2:
        x = x.to(tl.float16)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _bf16_rounded(x):
    """x (fp32) rounded to the nearest bf16, ties to even, as fp32: the interpreter's own conversion truncates
    (Triton 3.8) where a GPU's rounds to nearest. Finite values only (all the tile's operands are)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, LOW: tl.constexpr):
    """a @ b accumulated in fp32: IEEE fp32 products (LOW 0), or both operands in bf16 (1) or fp16 (2); LOW 3
    and 4 are 1 and 2 for Triton's CPU interpreter, whose 16-bit tl.dot is wrong (3.8): operands rounded to
    bf16 (to nearest, as a GPU) or fp16 (the interpreter's conversion: truncated), then IEEE products of them."""
    if LOW == 3:
        out = tl.dot(_bf16_rounded(a), _bf16_rounded(b), input_precision="ieee")
    elif LOW == 4:
        out = tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), input_precision="ieee")
    elif LOW == 0:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(_narrow(a, LOW), _narrow(b, LOW))
    return out


@triton.jit
def _scores(q, k, rows, cols, slope, q0, k0, HAS_ALIBI: tl.constexpr, LOW: tl.constexpr):
    s = _dot(q, tl.trans(k), LOW)
    if HAS_ALIBI:
        s -= slope * ((q0 + rows)[:, None] - (k0 + cols)[None, :]).to(tl.float32)
    return s


@triton.jit
def _load2(X, base, idx, stride, dd, ok, LOW: tl.constexpr):
    """Rows idx of one [n, D] slice (X + base), zero where masked: as fp32, or (LOW 1, 2, for operands that only
    enter products) in the products' 16-bit dtype; fp32 in the interpreter's modes (3, 4), whose _dot rounds."""
    x = tl.load(X + base + idx[:, None] * stride + dd[None, :], mask=ok, other=0.0)
    if LOW < 3:
        x = _narrow(x, LOW)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _slope(SLOPES, h, HAS_ALIBI: tl.constexpr):
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32)
    return slope


@triton.jit
def _query_rows(QS, G, DL, LSE, b, h, rows, dd, nq, D, sqb, sqh, sqt, sgb, sgh, sgt, sdb, sdh, sdt, seb, seh, set_,
                LOW: tl.constexpr):
    """A block of the tile's queries for the backward: (row mask, scaled q, dL/dA, D = <A, g>, lse)."""
    r_ok = rows < nq
    q_ok = r_ok[:, None] & (dd[None, :] < D)
    return (r_ok, _load2(QS, b * sqb + h * sqh, rows, sqt, dd, q_ok, LOW),
            _load2(G, b * sgb + h * sgh, rows, sgt, dd, q_ok, LOW),
            tl.load(DL + b * sdb + h * sdh + rows * sdt, mask=r_ok, other=0.0),
            tl.load(LSE + b * seb + h * seh + rows * set_, mask=r_ok, other=0.0))


@triton.jit
def _key_cols(K, V, b, h, cols, dd, nk, D, skb, skh, skt, svb, svh, svt, LOW: tl.constexpr):
    """A block of the tile's keys: (column mask, k, v)."""
    c_ok = cols < nk
    kv_ok = c_ok[:, None] & (dd[None, :] < D)
    return (c_ok, _load2(K, b * skb + h * skh, cols, skt, dd, kv_ok, LOW),
            _load2(V, b * svb + h * svh, cols, svt, dd, kv_ok, LOW))


@triton.jit
def _rt_fwd(QS, K, V, M, L, O, SLOPES, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, smb, smh, smt, slb, slh, slt,
            sob, soh, sot, H, nq, nk, D, q0, k0,
            HAS_ALIBI: tl.constexpr, LOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: b * stride passes 2**31 at B x N x d of 2**31 (e.g. 512 x 2048 x 2048)
    h = bh % H
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    dd = tl.arange(0, BD)
    r_ok = rows < nq
    q_ok = r_ok[:, None] & (dd[None, :] < D)
    q = _load2(QS, b * sqb + h * sqh, rows, sqt, dd, q_ok, LOW)
    m = tl.load(M + b * smb + h * smh + rows * smt, mask=r_ok, other=0.0)
    l = tl.load(L + b * slb + h * slh + rows * slt, mask=r_ok, other=0.0)
    acc = tl.load(O + b * sob + h * soh + rows[:, None] * sot + dd[None, :], mask=q_ok, other=0.0)
    slope = _slope(SLOPES, h, HAS_ALIBI)
    for start in range(0, nk, BN):
        cols = start + tl.arange(0, BN)
        c_ok, k, v = _key_cols(K, V, b, h, cols, dd, nk, D, skb, skh, skt, svb, svh, svt, LOW)
        s = tl.where(c_ok[None, :], _scores(q, k, rows, cols, slope, q0, k0, HAS_ALIBI, LOW), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        c = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        acc = acc * c[:, None] + _dot(e, v, LOW)
        l = l * c + tl.sum(e, 1)
        m = m_new
    tl.store(M + b * smb + h * smh + rows * smt, m, mask=r_ok)
    tl.store(L + b * slb + h * slh + rows * slt, l, mask=r_ok)
    tl.store(O + b * sob + h * soh + rows[:, None] * sot + dd[None, :], acc, mask=q_ok)


@triton.jit
def _rt_bwd_kv(QS, K, V, G, DL, LSE, SLOPES, DK, DV, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt,
               sdb, sdh, sdt, seb, seh, set_, sab, sah, sat, H, nq, nk, D, q0, k0,
               HAS_ALIBI: tl.constexpr, LOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """dk, dv of a block of the tile's keys over all its queries, added into DK, DV (fp32 accumulators of
    strides sab, sah, sat: each key block is one program's, so no atomics)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: b * stride passes 2**31 at B x N x d of 2**31 (e.g. 512 x 2048 x 2048)
    h = bh % H
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    dd = tl.arange(0, BD)
    c_ok, k, v = _key_cols(K, V, b, h, cols, dd, nk, D, skb, skh, skt, svb, svh, svt, LOW)
    kv_ok = c_ok[:, None] & (dd[None, :] < D)
    slope = _slope(SLOPES, h, HAS_ALIBI)
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BD), tl.float32)
    for start in range(0, nq, BM):
        rows = start + tl.arange(0, BM)
        r_ok, q, g, delta, lse = _query_rows(QS, G, DL, LSE, b, h, rows, dd, nq, D, sqb, sqh, sqt, sgb, sgh, sgt,
                                             sdb, sdh, sdt, seb, seh, set_, LOW)
        p = tl.exp(_scores(q, k, rows, cols, slope, q0, k0, HAS_ALIBI, LOW) - lse[:, None])
        p = tl.where(r_ok[:, None] & c_ok[None, :], p, 0.0)
        dv += _dot(tl.trans(p), g, LOW)
        ds = p * (_dot(g, tl.trans(v), LOW) - delta[:, None])
        dk += _dot(tl.trans(ds), q, LOW)
    out = b * sab + h * sah + cols[:, None] * sat + dd[None, :]
    tl.store(DK + out, tl.load(DK + out, mask=kv_ok, other=0.0) + dk, mask=kv_ok)
    tl.store(DV + out, tl.load(DV + out, mask=kv_ok, other=0.0) + dv, mask=kv_ok)


_LOW = {torch.bfloat16: 1, torch.float16: 2}  # the kernels' LOW: the products' 16-bit dtype (0: IEEE fp32)


def _launch(nq: int, nk: int, head_dim: int, device: torch.device, backward: bool = False) -> dict:
    """The products' dtype (LOW: the running tiled call's autocast dtype, as tiled._product's), and the blocks,
    warps and stages of FLASH_TILES' entry for it, blocks no larger than the tile. The backward with 16-bit
    products takes blocks of 32 keys and 32 queries: it holds dk, dv [BN, D] in fp32 besides p, ds [BM, BN], and
    64 x 64 spilled (python -m kernels.cuda_build: 136 bytes a thread on sm_80 at head dim 64, 24 on sm_90 at
    128; 32 queries x 64 keys still 64-80 on sm_80; 8 warps more registers, not fewer)."""
    low = _LOW.get(tiled._low(), 0)
    bm, bn, warps, stages = flash_tiles(head_dim, sixteen_bit=low != 0)
    if backward and low:
        bm, bn = min(bm, 32), min(bn, 32)
    if low and device.type == "cpu":
        low += 2  # Triton's interpreter (the only way these run on a CPU): its 16-bit products (_dot)
    return dict(LOW=low, BM=min(bm, pow2_block(nq)), BN=min(bn, pow2_block(nk)), BD=pow2_block(head_dim),
                num_warps=warps, num_stages=stages)


def _s3(t: Tensor) -> tuple[int, int, int]:
    """Strides of [B, H, n, D] (dims 0-2; the last must be 1) or of [B, H, n] (all three)."""
    if t.dim() == 4 and t.stride(-1) != 1:
        raise ValueError("RT tile kernels need tensors contiguous in their last dimension")
    return tuple(t.stride()[:3])


def _check(qs: Tensor) -> None:
    if qs.dtype != torch.float32:
        raise ValueError(f"the RT tile kernels accumulate in fp32: scaled queries must be float32, got {qs.dtype}")


def update_tile(qs: Tensor, k: Tensor, v: Tensor, m: Tensor, l: Tensor, O: Tensor, slopes, q0: int, k0: int) -> None:
    _check(qs)
    B, H, nq, D = qs.shape
    nk = k.shape[2]
    if nq == 0 or nk == 0:
        return
    meta = _launch(nq, nk, D, qs.device)
    _rt_fwd[(triton.cdiv(nq, meta["BM"]), B * H)](
        qs, k, v, m, l, O, slopes if slopes is not None else qs, *_s3(qs), *_s3(k), *_s3(v), *_s3(m), *_s3(l),
        *_s3(O), H, nq, nk, D, q0, k0, HAS_ALIBI=slopes is not None, **meta)


def tile_grads(qs, k, v, g, D, lse, slopes, q0: int, k0: int, dk: Tensor, dv: Tensor) -> None:
    _check(qs)
    if dk.dtype != torch.float32 or dv.dtype != torch.float32 or dk.stride() != dv.stride():
        raise ValueError("the RT tile kernels add into float32 dk, dv of one layout")
    B, H, nq, Dh = qs.shape
    nk = k.shape[2]
    if nq == 0 or nk == 0:
        return
    meta = dict(HAS_ALIBI=slopes is not None, **_launch(nq, nk, Dh, qs.device, backward=True))
    _rt_bwd_kv[(triton.cdiv(nk, meta["BN"]), B * H)](
        qs, k, v, g, D, lse, slopes if slopes is not None else qs, dk, dv, *_s3(qs), *_s3(k), *_s3(v), *_s3(g),
        *_s3(D), *_s3(lse), *_s3(dk), H, nq, nk, Dh, q0, k0, **meta)


OPS = tiled.TileOps(update_tile, tile_grads)
