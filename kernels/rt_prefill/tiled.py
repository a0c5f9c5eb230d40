"""The Recurrent Transformer layer computed exactly with the dyadic tile schedule (spec-003 §3), and its
custom backward (§3.5, tiled as §3.8 and §8.3 say).

Forward: all queries are known up front, so each query's online-softmax state (m, l, O) starts from its
own temporary pair (and from any cached keys of a decode prefix) and receives the persistent keys tile
by tile (schedule.py); position t is finalised at step t, its output z_t computed, its persistent pair
written in place. Keys moved: (N/2) log2 N instead of the naive N (N - 1) / 2.

Backward (`TiledPrefill`): saved are the layer's input X, output Z and each query's log-sum-exp, never
an N x N matrix. Phase 0 recomputes q and the temporary pairs from X, the persistent pairs from Z (values
only: phase 2 builds their graphs again when it needs them), and the attention outputs A from the
log-sum-exp, for all positions at once (strictly causal, in blocks of queries). Phase 1 walks the
positions backwards: the gradient reaching z_t is the upstream one plus what its persistent pair received
(complete by then, since only later queries read it), the attention gradient g_t follows through post(),
and the tiles whose queries start at t (the forward's, mirrored) add their gradient into the earlier keys
and values. Only that is sequential: the queries' gradient waits for the loop's end and is taken for all
positions at once, like A.
A layer may provide its own input gradients of kv and post (vjp_kv, vjp_post: cheaper than an autograd
graph per position), and vjp_prepare, what they read of the forward computed for all positions before the
loop; autograd is used otherwise. A layer may also give a context for its per-position calls, `in_loop(dtype)`
(RT's: its linear weights cast to the autocast dtype once per loop, which compiled pieces would cast at every
position). Phase 2 adds the diagonal terms and backpropagates once, batched over all positions, through pre(),
kv() and post() for the input and parameter gradients; a layer whose loop calls wrote the gradients at its
linears' outputs into vjp_prepare's buffers takes kv's and post's from them (`weight_grads`: products over
all positions, without building those two graphs again).

Both the forward and the backward are functions of tensors, run through kernels/captured.py: in a
training step on a GPU with train.cuda_graphs on, each is one CUDA graph per layer replayed every step
(spec §3.7: the position loop's launches, not its arithmetic, are the cost there); elsewhere they run
as written. A layer takes part by naming itself (`region_key`) and listing the tensors it reads that
are made per forward (`tensors()`, `with_tensors()`: RoPE tables); KEYS_MOVED counts the capture only.
The backward differentiates with respect to fresh leaves that alias the parameters (`parameters_as`, a
context in which the layer computes with them): the parameters' own gradient nodes belong to the outer
autograd graph, made on the default stream, and a backward captured on another stream that reached them
would break its capture (the engine syncs a leaf's node with the stream it was made on).

`update_tile` and `tile_grads` are the two per-tile functions a kernel replaces (spec §3.8): every
entry point takes them as `ops` (TileOps; triton_tile.OPS are the Triton kernels).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from kernels import captured
from kernels.rt_prefill.reference import acc_dtype, alibi
from kernels.rt_prefill.schedule import leaf_keys, lowbit, tiles

KEYS_MOVED = [0]  # persistent key rows loaded by tiled forwards since the last reset (benchmarks, tests), counted
# by the schedule, not the tile (whose measured choice runs tiles of its own)


class _Call:
    """What one tiled forward or backward shares across its positions: the autocast dtype its products run
    in (None without autocast) and its ALiBi biases by shape."""

    def __init__(self, low):
        self.low, self.biases = low, {}


_CALLS: list[_Call] = []  # the tiled forward or backward running now (see _per_call)


def _per_call(fn):
    """fn (a tiled forward or backward) with its own _Call: the autocast dtype read once, at its start (the
    tile ops' measurements run with autocast off and must time the products as the call runs them), and
    its biases, alive for the call (tensors a CUDA graph capture made stay in it)."""
    def run(*args, **kwargs):
        x = next(a for a in args if isinstance(a, Tensor))
        _CALLS.append(_Call(_autocast_dtype(x)))
        try:
            return fn(*args, **kwargs)
        finally:
            _CALLS.pop()
    run.__doc__, run.__name__ = fn.__doc__, fn.__name__
    return run


def _autocast_dtype(x: Tensor):
    """The autocast dtype on x's device, or None: autocast off, float64 (which autocast leaves alone), or a
    device autocast has no notion of (meta, in a planner's dry run: torch raises for it)."""
    if x.dtype == torch.float64:
        return None
    try:
        on = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(x.device.type) if on else None


def _low():
    """The 16-bit dtype the running tiled call's products take (autocast's), or None."""
    return _CALLS[-1].low if _CALLS else None


@contextlib.contextmanager
def products_in(low):
    """The tile functions called directly (tests, the kernel build), outside a tiled forward or backward, with
    their products in `low` (an autocast dtype; None: the operands' own), as a call under that autocast."""
    _CALLS.append(_Call(low))
    try:
        yield
    finally:
        _CALLS.pop()


def _product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of a tile: in the running call's autocast dtype, each operand cast once (autocast had bf16 keys
    widened to the fp32 accumulators' dtype and narrowed back, two kernels per product at every position);
    without autocast, b widened to a's dtype (the accumulators')."""
    low = _low()
    return a.to(low) @ b.to(low) if low is not None else a @ b.to(a.dtype)


def _cast(x: Tensor) -> Tensor:
    """x in the running call's autocast dtype (as _product would cast it), for an operand of two products."""
    low = _low()
    return x.to(low) if low is not None else x


def scores(qs: Tensor, k: Tensor, slopes, q0: int, k0: int) -> Tensor:
    """[B, H, nq, nk] scores of scaled queries qs (positions q0..) against keys k (positions k0..)."""
    s = _product(qs, k.transpose(-1, -2))
    if slopes is not None:
        s = s + _alibi(slopes, q0, k0, qs.shape[2], k.shape[2], qs.dtype, qs.device)
    return s


def _alibi(slopes: Tensor, q0: int, k0: int, nq: int, nk: int, dtype, device) -> Tensor:
    """The [H, nq, nk] ALiBi bias of queries q0.. against keys k0..: a function of q0 - k0 and the shape
    only, so inside a tiled forward or backward each one is made once, not at every position that uses it
    (the tiles of one size repeat N / 2P times; on a GPU each making is a few kernels of the serial loop)."""
    key = (id(slopes), q0 - k0, nq, nk, dtype)
    memo = _CALLS[-1].biases if _CALLS else {}
    if key not in memo:
        memo[key] = alibi(slopes, torch.arange(q0, q0 + nq, device=device), torch.arange(k0, k0 + nk, device=device),
                          dtype)
    return memo[key]


BLOCK = 128  # queries per score block: a tile of P keys and P queries holds [B, H, BLOCK, P] scores at once


def update_tile(qs: Tensor, k: Tensor, v: Tensor, m: Tensor, l: Tensor, O: Tensor, slopes, q0: int, k0: int) -> None:
    """Fold keys k, v into the online-softmax state (m, l, O) of queries qs, in place (spec Algorithm 2),
    BLOCK queries at a time so that memory stays linear in the tile."""
    for a in range(0, qs.shape[2], BLOCK):
        b = slice(a, a + BLOCK)
        s = scores(qs[:, :, b], k, slopes, q0 + a, k0)
        m_new = torch.maximum(m[:, :, b], s.amax(-1))
        c = torch.exp(m[:, :, b] - m_new)
        e = torch.exp(s - m_new[..., None])
        O[:, :, b].mul_(c[..., None]).add_(_product(e, v))
        l[:, :, b].mul_(c).add_(e.sum(-1))
        m[:, :, b] = m_new


class TileOps(NamedTuple):
    update: Callable  # update_tile's signature
    grads: Callable  # tile_grads' signature


def _pieces(N: int, leaf: int, t: int):
    """(query range, key range) blocks whose queries start at t: t's own leaf keys, and the tile of
    keys [t - P, t) into queries [t, t + P) (run in the forward after step t - 1)."""
    out = []
    k0, k1 = leaf_keys(t, leaf)
    if k1 > k0:
        out.append((t, t + 1, k0, k1))
    if t >= 1 and lowbit(t) >= leaf:
        P = lowbit(t)
        out.append((t, min(t + P, N), t - P, t))
    return out


@_per_call
def forward(x: Tensor, layer, leaf: int = 1, offset: int = 0, prefix: tuple[Tensor, Tensor] | None = None,
            ops: "TileOps | None" = None):
    """(Z [B, N, d], K, V [B, H, N, Dh], LSE [B, H, N]) of layer input x at positions offset..;
    `prefix` = (K0, V0) [B, H, offset, Dh]: the persistent pairs of earlier positions (decode)."""
    update = (ops or TORCH_OPS).update
    B, N, _ = x.shape
    dtype = acc_dtype(x)
    q, kt, vt = layer.pre(x, offset)
    qs = (q.to(dtype) * layer.scale).contiguous()  # head-major, as K and V below
    m = (qs * kt.to(dtype)).sum(-1)  # the temporary pair first (its ALiBi distance is 0)
    l = torch.ones_like(m)
    O = vt.to(dtype).clone()
    if prefix is not None and prefix[0].shape[2]:
        update(qs, prefix[0], prefix[1], m, l, O, layer.slopes, offset, 0)
        KEYS_MOVED[0] += prefix[0].shape[2]
    # head-major ([B, H, N, Dh] contiguous): a tile's key slice then folds (B, H) into one batch of a
    # product as a view; in the projections' position-major layout matmul copied it at every position
    K, V = kt.new_empty(kt.shape), vt.new_empty(vt.shape)
    Z = torch.empty_like(x)
    schedule = {t: (k0, k1, q1) for t, k0, k1, q1 in tiles(N, leaf)}
    position = getattr(layer, "position", None) or (lambda *a: _position(layer, *a))
    with _in_loop(layer, N):
        for t in range(N):
            k0, k1 = leaf_keys(t, leaf)
            sl = slice(t, t + 1)
            if k1 > k0:
                update(qs[:, :, sl], K[:, :, k0:k1], V[:, :, k0:k1], m[:, :, sl], l[:, :, sl], O[:, :, sl],
                       layer.slopes, offset + t, offset + k0)
                KEYS_MOVED[0] += k1 - k0
            position(x[:, sl], O[:, :, sl], l[:, :, sl], offset + t, Z[:, sl], K[:, :, sl], V[:, :, sl])
            if t in schedule:
                k0, k1, q1 = schedule[t]
                sl = slice(k1, q1)
                update(qs[:, :, sl], K[:, :, k0:k1], V[:, :, k0:k1], m[:, :, sl], l[:, :, sl], O[:, :, sl],
                       layer.slopes, offset + k1, offset + k0)
                KEYS_MOVED[0] += k1 - k0
    return Z, K, V, m + torch.log(l)


def _position(layer, x: Tensor, O: Tensor, l: Tensor, offset: int, z_out: Tensor, k_out: Tensor,
              v_out: Tensor) -> None:
    """A position of the forward through the layer's post and kv, for a layer without a `position` of its own
    (RT's is one compiled piece): z = post(x, O / l) and kv(z), written into the loop's buffers."""
    z = layer.post(x, (O / l[..., None]).to(x.dtype))
    z_out.copy_(z)
    k, v = layer.kv(z, offset)
    k_out.copy_(k)
    v_out.copy_(v)


def _in_loop(layer, n: int):
    """The layer's context for its n per-position calls (`in_loop(dtype)`: RT's casts its linear weights to the
    running call's autocast dtype once per loop, not once per position), or none: for one position (a decode
    step) a cast per loop is no fewer, and eager autocast's own cache may outlive the call."""
    enter = getattr(layer, "in_loop", None)
    return enter(_low()) if enter is not None and n > 1 else contextlib.nullcontext()


def tile_grads(qs, k, v, g, D, lse, slopes, q0: int, k0: int, dk: Tensor, dv: Tensor) -> None:
    """Add one tile's key and value gradients into dk, dv (in place), from the saved log-sum-exp
    (FlashAttention-2's dK, dV on a tile) given g = dL/dA of its queries and D = <A, g>; BLOCK queries
    at a time. The queries' own gradient waits for the loop's end (earlier_keys_grad: all at once)."""
    for a in range(0, qs.shape[2], BLOCK):
        b = slice(a, a + BLOCK)
        p = torch.exp(scores(qs[:, :, b], k, slopes, q0 + a, k0) - lse[:, :, b, None])
        gb = _cast(g[:, :, b])  # read by two products: cast once
        dv.add_(_product(p.transpose(-1, -2), gb))
        ds = p * (_product(gb, v.transpose(-1, -2)) - D[:, :, b, None])
        dk.add_(_product(ds.transpose(-1, -2), qs[:, :, b]))


TORCH_OPS = TileOps(update_tile, tile_grads)

ROWS = 64  # queries per block of earlier_keys: its [B, H, ROWS, N] scores are the size of A itself at head dim 64


def _earlier(qs: Tensor, K: Tensor, lse: Tensor, slopes, offset: int):
    """(a, a1, nk, p) for each block of ROWS queries a..a1: p = exp(s - lse) [B, H, a1 - a, nk] of its
    queries against keys 0..nk, zero where the key is not earlier than the query (strictly causal)."""
    N = qs.shape[2]
    for a in range(0, N, ROWS):
        a1 = min(a + ROWS, N)
        nk = a1 - 1  # the last query's earlier keys
        if nk <= 0:
            continue
        s = scores(qs[:, :, a:a1], K[:, :, :nk], slopes, offset + a, offset)
        s.masked_fill_(torch.ones(a1 - a, nk, dtype=torch.bool, device=s.device).triu(a), float("-inf"))  # j >= i
        yield a, a1, nk, s.to(lse.dtype).sub_(lse[:, :, a:a1, None]).exp_()  # the accumulators' dtype, in place


def earlier_keys(qs: Tensor, K: Tensor, V: Tensor, lse: Tensor, slopes, offset: int) -> Tensor:
    """sum_{j < i} p_ij v_j for every query i: the persistent keys' part of the attention outputs, given each
    query's log-sum-exp (the tiles the forward ran cover exactly these pairs)."""
    out = torch.zeros_like(qs)
    for a, a1, nk, p in _earlier(qs, K, lse, slopes, offset):
        out[:, :, a:a1] = _product(p, V[:, :, :nk])
    return out


def earlier_keys_grad(qs: Tensor, K: Tensor, V: Tensor, G: Tensor, D: Tensor, lse: Tensor, slopes,
                      offset: int) -> Tensor:
    """d scaled queries through their earlier keys, sum_{j < i} p_ij (<g_i, v_j> - D_i) k_j, once every g is
    known (FlashAttention-2's dQ, strictly causal): no query's gradient is read inside the reverse loop."""
    dq = torch.zeros_like(qs)
    for a, a1, nk, p in _earlier(qs, K, lse, slopes, offset):
        ds = p * (_product(G[:, :, a:a1], V[:, :, :nk].transpose(-1, -2)) - D[:, :, a:a1, None])
        dq[:, :, a:a1] = _product(ds, K[:, :, :nk])
    return dq


class TiledPrefill(torch.autograd.Function):
    """z = layer(x) by the tile schedule, with the tiled backward described in the module docstring.
    Called as TiledPrefill.apply(x, layer, leaf, offset, ops, *params), params being every parameter that
    pre, post and kv read (their gradients are returned in that order)."""

    @staticmethod
    def forward(ctx, x, layer, leaf, offset, ops, *params):
        def run(x, *extra):  # a captured region (kernels/captured.py): tensors in, tensors out
            with torch.no_grad():
                Z, _, _, lse = forward(x, _bound(layer, extra), leaf, offset, ops=ops)
            return Z, lse

        Z, lse = _region("rt_prefill forward", layer, (leaf, offset, ops), run, [x])
        ctx.save_for_backward(x, Z, lse)
        ctx.layer, ctx.leaf, ctx.offset, ctx.n_params, ctx.ops = layer, leaf, offset, len(params), ops
        ctx.autocast = captured.autocast_state(x.device)  # the backward recomputes in the forward's precision
        ctx.params = params
        return Z

    @staticmethod
    def backward(ctx, gZ):
        x, Z, lse = ctx.saved_tensors
        layer, leaf, offset, params, ops = ctx.layer, ctx.leaf, ctx.offset, ctx.params, ctx.ops

        def run(x, Z, lse, gZ, *extra):
            return _backward(_bound(layer, extra), leaf, offset, params, ops, x, Z, lse, gZ)

        with captured.autocast_as(x.device, ctx.autocast):
            # the number of parameters in the key: freezing some changes the gradients the graph returns
            dx, *grads = _region("rt_prefill backward", layer, (leaf, offset, ops, len(params)), run, [x, Z, lse, gZ])
        return (dx, None, None, None, None, *grads)


def _region(what: str, layer, key: tuple, run, inputs: list) -> list:
    """run(*inputs, *the layer's own tensors) as a captured region (a CUDA graph in a training step on a
    GPU under train.cuda_graphs) when the layer names itself (`region_key`: the same every step), else
    as is."""
    name = getattr(layer, "region_key", None)
    if name is None:
        return list(run(*inputs))
    return captured.region((what, name, *key), run, [*inputs, *layer.tensors()])


def _bound(layer, extra):
    """The layer reading the region's copies of its own tensors (RoPE tables), when it has any."""
    return layer.with_tensors(list(extra)) if extra else layer


def _backward(layer, leaf: int, offset: int, params: tuple, ops, x: Tensor, Z: Tensor, lse: Tensor,
              gZ: Tensor) -> list:
    """TiledPrefill's backward as a function of tensors: [dx, *parameter gradients], taken with respect to
    leaves made here that share the parameters' storage (the module docstring says why), where the layer
    can compute with them (`parameters_as`)."""
    swap = getattr(layer, "parameters_as", None)
    if swap is None or not params:
        return _backward_with(layer, leaf, offset, params, ops, x, Z, lse, gZ)
    leaves = tuple(p.detach().requires_grad_() for p in params)
    with swap(leaves):
        return _backward_with(layer, leaf, offset, leaves, ops, x, Z, lse, gZ)


@_per_call
def _backward_with(layer, leaf: int, offset: int, params: tuple, ops, x: Tensor, Z: Tensor, lse: Tensor,
                   gZ: Tensor) -> list:
    B, N, _ = x.shape
    dtype = acc_dtype(x)
    # phase 0: the values only; phase 2 rebuilds pre's and kv's graphs one at a time when it backpropagates
    # through them. Held through the loop, their saved tensors (the norms' float32 copies among them) were a
    # quarter of its peak (benchmarks/activation_peak.py), for ~5 d^2 multiply-adds per token to recompute.
    # A layer with `pre_grads` keeps instead what it reads of pre's forward (`pre_kept`: RT's projections
    # before their norms) and backpropagates through pre itself, without its graph.
    pre_grads = getattr(layer, "pre_grads", None)
    with torch.no_grad():
        q, kt, vt, *kept = layer.pre_kept(x, offset) if pre_grads is not None else layer.pre(x, offset)
        K, V = layer.kv(Z, offset)
    qs = (q.to(dtype) * layer.scale).contiguous()
    Kd, Vd = K.contiguous(), V.contiguous()  # head-major, as the forward's (no copy per tile)
    pre_dtypes = q.dtype, kt.dtype, vt.dtype
    # the temporary pairs through the loop in their own dtype (bf16 under autocast: half the accumulators'),
    # widened again after it; v apart from the k | v projection's output it is a view of
    vt = vt.contiguous()
    del q, K, V
    p_diag = torch.exp((qs * kt.to(dtype)).sum(-1) - lse)
    # the attention outputs, rebuilt from the log-sum-exp: the temporary pairs' part, then the persistent keys'
    # for all positions at once (they do not depend on the loop below, which once rebuilt them tile by tile)
    A = p_diag[..., None] * vt.to(dtype) + earlier_keys(qs, Kd, Vd, lse, layer.slopes, offset)
    A_in = A.to(x.dtype)
    # dK, dV position-major: phase 1 hands each position's slice to vjp_kv, which flattens its heads (a view
    # in this layout, a copy in the head-major one)
    dK = A.new_zeros(B, N, A.shape[1], A.shape[3]).transpose(1, 2)
    dV = torch.zeros_like(dK)
    G = torch.zeros_like(A)
    D = torch.zeros_like(lse)
    gZ_total = torch.empty_like(gZ)
    vjp_kv, vjp_post = getattr(layer, "vjp_kv", None), getattr(layer, "vjp_post", None)
    prepare = getattr(layer, "vjp_prepare", None)  # what the two read of the forward, for all positions at once
    prep = None
    if prepare is not None and vjp_kv is not None and vjp_post is not None:
        with torch.no_grad():
            prep = prepare(x, A_in, Z, offset)
    # one position's dL/dz, dL/da and D: the layer's own piece (RT's, compiled as one) when it has one and
    # vjp_prepare's quantities, else through its vjp_kv / vjp_post, else autograd on the position
    fused = getattr(layer, "position_grad", None) if prep is not None else None
    with _in_loop(layer, N):
        for t in reversed(range(N)):  # phase 1
            sl = slice(t, t + 1)
            dk_t, dv_t = dK[:, :, sl].to(x.dtype), dV[:, :, sl].to(x.dtype)
            at = prep.at(t) if prep is not None else None
            if fused is not None:
                fused(offset + t, dk_t, dv_t, gZ[:, sl], A[:, :, sl], at, gZ_total[:, sl], G[:, :, sl], D[:, :, sl])
            else:
                _position_grad(layer, offset + t, dk_t, dv_t, gZ[:, sl], A[:, :, sl], at, gZ_total[:, sl],
                               G[:, :, sl], D[:, :, sl], x[:, sl], Z[:, sl], A_in[:, :, sl])
            for a0, a1, k0, k1 in _pieces(N, leaf, t):
                ops.grads(qs[:, :, a0:a1], Kd[:, :, k0:k1], Vd[:, :, k0:k1], G[:, :, a0:a1], D[:, :, a0:a1],
                          lse[:, :, a0:a1], layer.slopes, offset + a0, offset + k0, dK[:, :, k0:k1], dV[:, :, k0:k1])
    # phase 2: the batched graphs and the queries' gradient, one at a time, each graph and whatever the next
    # step does not read dropped before it: what the loop read and each graph's saved tensors are the layer's
    # backward's peak (at 512 x 512 tokens a layer's MLP graph alone holds ~9 GB). The parameters' gradients
    # are summed in the same order as ever (pre, kv, post). kv's and post's come from the layer's own products
    # over what its loop calls wrote into prep (`weight_grads`), where it has them: autograd through kv() and
    # post() would recompute both and their input gradients, which the loop already took.
    own = prep is not None and getattr(layer, "weight_grads", None) is not None
    if own:
        del dK, dV, at  # (the last position's views of prep's buffers)
        with torch.no_grad():
            dx_post, grads_kv, grads_post = layer.weight_grads(x, A_in, gZ_total, prep, params)
        del gZ_total, A_in  # post's input gradient is all the rest needs of post: as much as these held
    prep = at = A = None
    if not own:
        with torch.enable_grad():
            K, V = layer.kv(Z.detach().requires_grad_(), offset)
        grads_kv = torch.autograd.grad((K, V), params, (dK.to(K.dtype), dV.to(V.dtype)), allow_unused=True)
        del K, V, dK, dV
    dqs = earlier_keys_grad(qs, Kd, Vd, G, D, lse, layer.slopes, offset)
    del Kd, Vd
    ktd, vtd = kt.to(dtype), vt.to(dtype)
    del kt, vt
    ds_diag = p_diag * ((G * vtd).sum(-1) - D)
    dqs += ds_diag[..., None] * ktd
    d_kt = ds_diag[..., None] * qs
    d_vt = p_diag[..., None] * G
    del G, ds_diag, qs, ktd, vtd, p_diag
    d_pre = [(dqs * layer.scale).to(pre_dtypes[0]), d_kt.to(pre_dtypes[1]), d_vt.to(pre_dtypes[2])]
    del dqs, d_kt, d_vt
    if pre_grads is not None:
        with torch.no_grad():
            grads_pre = pre_grads(x, offset, kept, *d_pre, params)
    else:
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            q, kt, vt = layer.pre(xd, offset)
        grads_pre = torch.autograd.grad((q, kt, vt), (xd, *params), d_pre, allow_unused=True)
        del q, kt, vt
    del d_pre, kept
    # each parameter's pre + kv now (the order the sum has always had), so that at most three sets of the
    # layer's parameter gradients are alive at once, not five
    summed = [_sum(a, b) for a, b in zip(grads_pre[1:], grads_kv)]
    dx_pre = grads_pre[0]
    del grads_pre, grads_kv
    if not own:
        with torch.enable_grad():
            xp = x.detach().requires_grad_()
            zp = layer.post(xp, A_in)
        dx_post, *grads_post = torch.autograd.grad(zp, (xp, *params), gZ_total, allow_unused=True)
    return [dx_pre + dx_post, *(_sum(a, c) for a, c in zip(summed, grads_post))]


def _position_grad(layer, offset: int, dk: Tensor, dv: Tensor, gz: Tensor, A: Tensor, prep, dz_out: Tensor,
                   g_out: Tensor, D_out: Tensor, x: Tensor, z: Tensor, a: Tensor) -> None:
    """A position of the backward for a layer without a `position_grad` of its own: dL/dz through its vjp_kv
    (or autograd on kv at the position), dL/da through its vjp_post (or autograd on post), and D = <A, dL/da>,
    written into dz_out, g_out, D_out; x, z, a: the position's layer input, output and attention output as
    post read it."""
    vjp_kv, vjp_post = getattr(layer, "vjp_kv", None), getattr(layer, "vjp_post", None)
    if vjp_kv is not None:
        dz = torch.add(vjp_kv(z, offset, dk, dv, prep), gz, out=dz_out)
    else:
        with torch.enable_grad():
            zt = z.detach().requires_grad_()
            dz = torch.add(torch.autograd.grad(layer.kv(zt, offset), zt, (dk, dv))[0], gz, out=dz_out)
    if vjp_post is not None:
        g = vjp_post(x, a, dz, prep)
    else:
        with torch.enable_grad():
            at = a.detach().requires_grad_()
            g = torch.autograd.grad(layer.post(x, at), at, dz)[0]
    g_out.copy_(g)  # the cast inside the copy
    torch.sum(A * g_out, -1, out=D_out)  # written in place: out= saves a copy per position


def _sum(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


def prefill(x: Tensor, layer, leaf: int = 1, offset: int = 0, ops: TileOps | None = None) -> Tensor:
    """z [B, N, d] by the tile schedule; differentiable through TiledPrefill's backward."""
    ops = ops or TORCH_OPS
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return TiledPrefill.apply(x, layer, leaf, offset, ops, *params)
    return forward(x, layer, leaf, offset, ops=ops)[0]
