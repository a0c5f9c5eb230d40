"""Masks as values (kernels/attention/masks.py): each predicate, evaluated densely, equals the boolean
mask the SDPA path actually hands to torch (or its is_causal call), for causal, document, window,
prefix and their combinations, in training and at decode offsets; the predicates are FlexAttention's
mask_mod form (they evaluate on scalar indices too); no tile reported empty holds a visible pair, and
tiles are reported empty where they are; ALiBi and fully masked rows in the reference."""
import itertools

import pytest
import torch

import kernels.attention as attn
from kernels.attention import masks, reference, sdpa


def doc_ids(B, T):
    rows = [torch.repeat_interleave(torch.arange(4), torch.tensor([1 + b, 2, 3, T]))[:T] for b in range(B)]
    return torch.stack(rows)


def textbook(kind, b, q, kv, docs=None, w=None, prefix=None):
    """Each built-in by hand, one pair at a time."""
    allowed = kv <= q
    if "doc" in kind:
        allowed &= bool(docs[b, q] == docs[b, kv])
    if "window" in kind:
        allowed &= q - kv < w
    if "prefix" in kind:
        allowed |= kv < int(prefix[b])
    return allowed


def make(kind, docs, w, prefix):
    mask = masks.causal()
    if "doc" in kind:
        mask = mask & masks.document(docs)
    if "window" in kind:
        mask = mask & masks.window(w)
    if "prefix" in kind:
        mask = mask | masks.prefix(prefix)
    return mask


KINDS = ["causal", "causal+doc", "causal+window", "causal+doc+window", "causal+prefix", "causal+doc+prefix"]


def sdpa_call(mask, Tq, Tk, offset, B=2, H=3):
    """What sdpa.attention passes to torch: (attn_mask, is_causal)."""
    seen = {}

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.update(mask=attn_mask, causal=is_causal)
        return torch.zeros_like(q)

    real = sdpa.F.scaled_dot_product_attention
    sdpa.F.scaled_dot_product_attention = spy
    try:
        sdpa.attention(torch.zeros(B, H, Tq, 4), torch.zeros(B, H, Tk, 4), torch.zeros(B, H, Tk, 4), mask, offset)
    finally:
        sdpa.F.scaled_dot_product_attention = real
    return seen["mask"], seen["causal"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offset,Tq", [(0, 9), (0, 1), (4, 1), (4, 5), (8, 1)])
@pytest.mark.parametrize("w", [1, 3, 100])
def test_dense_predicates_equal_the_sdpa_masks_and_the_textbook(kind, offset, Tq, w):
    B, Tk = 2, offset + Tq
    docs, prefix = doc_ids(B, Tk), torch.tensor([2, 5])
    mask = make(kind, docs, w, prefix)
    dense = mask.evaluate(B, 3, Tq, Tk, offset)
    want = torch.tensor([[[textbook(kind, b, offset + i, j, docs, w, prefix) for j in range(Tk)]
                          for i in range(Tq)] for b in range(B)])
    assert torch.equal(dense.expand(B, 3, Tq, Tk), want[:, None].expand(B, 3, Tq, Tk))
    given, causal_flag = sdpa_call(mask, Tq, Tk, offset)
    if causal_flag:  # only plain causal attention, aligned, may drop the mask
        assert given is None and offset == 0 and Tq == Tk and torch.equal(dense[0, 0], torch.ones(Tq, Tk).tril().bool())
    else:
        assert given.dtype == torch.bool and torch.equal(given.expand(B, 3, Tq, Tk), dense.expand(B, 3, Tq, Tk))
    # the fast calls are kept: causal (or a window covering the sequence) is SDPA's own causal kernel
    aligned = offset == 0 and Tq == Tk
    assert causal_flag == (aligned and (kind == "causal" or (kind == "causal+window" and w >= Tk)))


@pytest.mark.parametrize("kind", KINDS)
def test_predicates_are_flexattention_mask_mods(kind):
    """mask_mod(b, h, q_idx, kv_idx) on scalar tensors (as FlexAttention calls it, vmapped) agrees with
    the dense evaluation at every point."""
    B, T = 2, 7
    docs, prefix = doc_ids(B, T), torch.tensor([2, 5])
    mask = make(kind, docs, 3, prefix)
    dense = mask.evaluate(B, 1, T, T).expand(B, 1, T, T)
    for b, q, kv in itertools.product(range(B), range(T), range(T)):
        value = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(kv))
        assert value.shape == () and bool(value) == bool(dense[b, 0, q, kv])
    mods = torch.vmap(torch.vmap(mask.mask_mod, in_dims=(None, None, None, 0)), in_dims=(None, None, 0, None))
    assert torch.equal(mods(torch.tensor(1), torch.tensor(0), torch.arange(T), torch.arange(T)), dense[1, 0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks", [(1, 1), (2, 3), (4, 4), (8, 5), (16, 16)])
@pytest.mark.parametrize("offset,Tq", [(0, 13), (6, 7), (12, 1)])
def test_empty_tiles_hold_no_visible_pair_and_every_other_tile_holds_one(kind, blocks, offset, Tq):
    bq, bk = blocks
    B, Tk = 2, offset + Tq
    docs, prefix = doc_ids(B, Tk), torch.tensor([2, 5])
    mask = make(kind, docs, 3, prefix)
    empty = mask.empty_tiles(Tq, Tk, bq, bk, offset, B=B)
    dense = mask.evaluate(B, 1, Tq, Tk, offset).expand(B, 1, Tq, Tk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    assert empty.shape[-2:] == (nq, nk)
    for b, i, j in itertools.product(range(empty.shape[0]), range(nq), range(nk)):
        tile = dense[b, 0, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        assert bool(empty[b, 0, i, j]) == (not tile.any()), (b, i, j)
    if kind == "causal" and offset == 0 and bq == bk and nq > 1:  # the check can fail: tiles above the diagonal
        assert empty[0, 0, 0, -1]


def test_an_architectures_own_mask_runs_on_every_path():
    """A predicate written outside kernels/ (a strided mask) through sdpa and the reference, with grads."""
    B, H, T, Dh = 2, 2, 9, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    strided = masks.Mask(lambda b, h, qi, kv: (qi - kv) % 3 == 0, "strided")
    mask = masks.causal() & strided
    outs = []
    for path in attn.GENERAL_PATHS:
        attn.use_path(path)
        out = attn.attention(q, k, v, mask)
        outs.append([out] + list(torch.autograd.grad(out.square().sum(), (q, k, v))))
    attn.use_path(None)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_alibi_reference_is_the_textbook_formula_and_sdpa_matches_it():
    B, H, T, Dh = 2, 4, 7, 3
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
    docs = doc_ids(B, T)
    mask = masks.causal() & masks.document(docs)
    out = reference.attention(q, k, v, mask, alibi_slopes=slopes)
    for b, h, i in itertools.product(range(B), range(H), range(T)):
        keys = [j for j in range(i + 1) if docs[b, j] == docs[b, i]]
        scores = q[b, h, i] @ k[b, h, keys].T / Dh ** 0.5 - slopes[h] * torch.tensor([i - j for j in keys])
        torch.testing.assert_close(out[b, h, i], torch.softmax(scores, -1) @ v[b, h, keys], rtol=1e-10, atol=1e-12)
    fast = sdpa.attention(q, k, v, mask, alibi_slopes=slopes)
    for a, b in zip([fast] + list(torch.autograd.grad(fast.sum(), (q, k, v))),
                    [out] + list(torch.autograd.grad(out.sum(), (q, k, v)))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    dec = sdpa.attention(q[:, :, 4:], k, v, mask, 4, alibi_slopes=slopes)  # decode: the same bias at an offset
    torch.testing.assert_close(dec, out[:, :, 4:], rtol=1e-10, atol=1e-12)


def test_reference_gives_zero_for_a_query_that_sees_no_key():
    q = k = v = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    nothing_for_first = masks.Mask(lambda b, h, qi, kv: (kv <= qi) & (qi > 0), "late")
    out = reference.attention(q, k, v, nothing_for_first)
    assert torch.equal(out[0, 0, 0], torch.zeros(2)) and torch.isfinite(out).all()


def test_window_below_one_and_names():
    with pytest.raises(ValueError, match="attention window=0 must be at least 1"):
        masks.window(0)
    assert repr(masks.causal() & masks.window(3)) == "causal & window(3)"
    assert masks.is_causal(masks.decoder_mask(None, 8), 8, 8) and not masks.is_causal(masks.decoder_mask(None, 7), 8, 8)
    assert not masks.is_causal(masks.causal(), 1, 5, 4)  # decode: queries after a cache are not SDPA's causal
