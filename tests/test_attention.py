"""kernels.attention: every path against the naive reference (contract 4), and the dispatcher.

The reference is an explicit masked softmax in float64; the sdpa path must match it in outputs and in
the gradients of q, k and v at odd shapes, with packed documents (a one-token document included),
with and without a custom scale, and in streaming decode at several cache offsets; the same with a
sliding window. The dispatcher must say which path ran, obey a forced path, and survive
torch.compile(fullgraph=True).
"""
import itertools
import os
import subprocess
import sys

import pytest
import torch

import kernels.attention as attn
from kernels.attention import reference, sdpa

TOL = dict(rtol=1e-10, atol=1e-12)


def M(doc_ids=None, window=None):
    """The causal decoder's mask value: within documents when doc_ids is given, within `window` keys
    when window is given (a window below one is refused when the mask is made)."""
    mask = attn.causal()
    if doc_ids is not None:
        mask = mask & attn.document(doc_ids)
    if window is not None:
        mask = mask & attn.window(window)
    return mask


@pytest.fixture(autouse=True)
def automatic_path():
    attn.use_path(None)
    attn.reset_paths_used()
    yield
    attn.use_path(None)


def qkv(B, H, Tq, Tk, Dh, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64, requires_grad=True) for T in (Tq, Tk, Tk)]


def packed_doc_ids(B, T):
    """Several documents per row with different boundaries per row; row 0 holds a one-token document."""
    rows = []
    for b in range(B):
        lengths = [1, 2, T] if b == 0 else [b + 2, 1, T]
        rows.append(torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[:T])
    return torch.stack(rows).to(torch.int32)


def cotangent(shape):
    """A fixed random output gradient, so every gradient entry is checked (not only their sum)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def output_and_grads(fn, q, k, v, grad_out=None):
    out = fn(q, k, v)
    out.backward(cotangent(out.shape) if grad_out is None else grad_out)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return [out.detach()] + grads


def assert_same(fast, ref):
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("B,H,T,Dh", [(B, H, T, Dh) for B, H, T, Dh in
                                      itertools.product((1, 3), (1, 3), (1, 7, 33), (4, 10))])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_sdpa_matches_reference(B, H, T, Dh, docs, scale):
    q, k, v = qkv(B, H, T, T, Dh)
    doc_ids = packed_doc_ids(B, T) if docs else None
    fast = output_and_grads(lambda q, k, v: sdpa.attention(q, k, v, M(doc_ids), scale=scale), q, k, v)
    ref = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(doc_ids), scale=scale), q, k, v)
    assert_same(fast, ref)


def test_reference_is_the_textbook_formula():
    """Checked against a per-row loop, so a bug shared by the mask code of both paths cannot hide."""
    B, H, T, Dh = 2, 1, 6, 3
    q, k, v = (t.detach() for t in qkv(B, H, T, T, Dh))
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    out = reference.attention(q, k, v, M(doc_ids))
    for b, i in itertools.product(range(B), range(T)):
        keys = [j for j in range(i + 1) if doc_ids[b, j] == doc_ids[b, i]]
        w = torch.softmax(q[b, 0, i] @ k[b, 0, keys].T / Dh**0.5, dim=-1)
        torch.testing.assert_close(out[b, 0, i], w @ v[b, 0, keys], **TOL)
    allowed = torch.tensor([[[j <= i and doc_ids[b, j] == doc_ids[b, i] for j in range(T)] for i in range(T)]
                            for b in range(B)])
    assert torch.equal(attn.document_causal_mask(doc_ids), allowed[:, None])


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("offset,Tq", [(0, 1), (0, 5), (1, 1), (6, 1), (6, 4), (32, 1), (20, 13)])
def test_cached_attention_equals_the_tail_of_full_attention(path, offset, Tq):
    B, H, Dh = 3, 3, 10
    Tk = offset + Tq
    q_full, k, v = qkv(B, H, Tk, Tk, Dh, seed=offset + Tq)
    q = q_full.detach()[:, :, offset:].requires_grad_()
    attn.use_path(path)
    dec = output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(), offset), q, k, v)
    assert attn.paths_used() == {path}
    # The full-length run with the decode's output gradient on its last Tq rows and zero on the cached
    # rows: its tail must equal the decode in output and dq, and its dk, dv must equal the decode's.
    grad_full = torch.cat([torch.zeros(B, H, offset, Dh, dtype=torch.float64), cotangent(dec[0].shape)], dim=2)
    out, dq, dk, dv = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M()), q_full, k, v, grad_full)
    assert_same(dec, [out[:, :, offset:], dq[:, :, offset:], dk, dv])
    assert torch.all(dq[:, :, :offset] == 0)


def test_dispatcher_reports_and_forces_the_path():
    q, k, v = (t.detach() for t in qkv(2, 3, 7, 7, 4))
    doc_ids = packed_doc_ids(2, 7)
    assert attn.paths_used() == set()
    fast = attn.attention(q, k, v, M(doc_ids))
    assert attn.paths_used() == {"sdpa"}
    attn.use_path("reference")
    attn.reset_paths_used()
    forced = attn.attention(q, k, v, M(doc_ids))
    assert attn.paths_used() == {"reference"}
    torch.testing.assert_close(forced, reference.attention(q, k, v, M(doc_ids)), rtol=0, atol=0)
    torch.testing.assert_close(fast, forced, **TOL)
    with pytest.raises(ValueError, match="'cudnn' is not an attention path"):
        attn.use_path("cudnn")


def test_environment_variable_forces_the_path():
    code = ("import torch, kernels.attention as a; x = torch.randn(1, 1, 3, 2); a.attention(x, x, x, a.causal()); "
            "print(sorted(a.paths_used()))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PRETRAIN_ATTENTION": "reference", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['reference']"


def test_compiles_with_fullgraph():
    """The models are compiled by default: dispatch and recording must not break the graph. aot_eager
    runs dynamo (where graph breaks happen) and traces the backward, in well under a second; inductor
    adds only code generation and would take ~15 s here."""
    torch._dynamo.reset()
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(2, 3, 7, 7, 4))
    doc_ids = packed_doc_ids(2, 7)

    def fn(q, k, v, doc_ids):
        return attn.attention(q, k, v, M()) + attn.attention(q, k, v, M(doc_ids)) + attn.attention(q, k, v, M(), 0)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, doc_ids)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v, doc_ids))
    assert attn.paths_used() == {"sdpa"}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(q, k, v, doc_ids)  # recorded at trace time: the cached graph runs without a retrace
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    attn.use_path("reference")  # dynamo guards on the forced path, so this recompiles
    attn.reset_paths_used()
    torch.testing.assert_close(compiled(q, k, v, doc_ids), fn(q, k, v, doc_ids), rtol=1e-5, atol=1e-6)
    assert attn.paths_used() == {"reference"}


# --- sliding window: query t sees keys t - window < s <= t (window counts the query itself) ---------


def test_windowed_reference_is_the_textbook_formula():
    """A per-row loop over the keys the window allows, with packed documents."""
    B, H, T, Dh, window = 2, 1, 9, 3, 3
    q, k, v = (t.detach() for t in qkv(B, H, T, T, Dh))
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 2]])
    out = reference.attention(q, k, v, M(doc_ids, window))
    for b, i in itertools.product(range(B), range(T)):
        keys = [j for j in range(i - window + 1, i + 1) if j >= 0 and doc_ids[b, j] == doc_ids[b, i]]
        w = torch.softmax(q[b, 0, i] @ k[b, 0, keys].T / Dh**0.5, dim=-1)
        torch.testing.assert_close(out[b, 0, i], w @ v[b, 0, keys], **TOL)


@pytest.mark.parametrize("B,H,T,Dh", [(1, 1, 7, 4), (3, 3, 7, 10), (3, 1, 33, 4), (1, 3, 33, 10)])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("window", [1, 2, 5, 32])
def test_windowed_sdpa_matches_reference(B, H, T, Dh, docs, window):
    q, k, v = qkv(B, H, T, T, Dh, seed=window)
    doc_ids = packed_doc_ids(B, T) if docs else None
    fast = output_and_grads(lambda q, k, v: sdpa.attention(q, k, v, M(doc_ids, window), scale=0.37), q, k, v)
    ref = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(doc_ids, window), scale=0.37), q, k, v)
    assert_same(fast, ref)
    longest_doc = T - 3 if docs else T  # packed_doc_ids' last document of row 0
    if window < longest_doc:  # the window must actually change the answer, or this test could not fail
        plain = reference.attention(q, k, v, M(doc_ids), scale=0.37).detach()
        assert not torch.allclose(fast[0], plain)


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("window", [1, 3, 6])
def test_windowed_cached_attention_equals_full_row_by_row(path, window):
    """Token-by-token decode with the whole cache, and with a cache trimmed to the last window-1 keys
    (passing the offset into the trimmed cache), equals the full windowed attention at every row."""
    B, H, T, Dh = 2, 3, 11, 4
    q, k, v = (t.detach() for t in qkv(B, H, T, T, Dh, seed=3))
    full = reference.attention(q, k, v, M(None, window))
    attn.use_path(path)
    for t in range(T):
        row = attn.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], M(None, window), t)
        torch.testing.assert_close(row[:, :, 0], full[:, :, t], **TOL)
        start = max(0, t - window + 1)
        trimmed = attn.attention(q[:, :, t : t + 1], k[:, :, start : t + 1], v[:, :, start : t + 1],
                                 M(None, window), t - start)
        torch.testing.assert_close(trimmed[:, :, 0], full[:, :, t], **TOL)
    # and a multi-token chunk after a cache (chunked prefill), with gradients
    offset = 4
    qc = q[:, :, offset:].clone().requires_grad_()
    kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
    dec = output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(None, window), offset), qc, kr, vr)
    qf = q.clone().requires_grad_()
    grad_full = torch.cat([torch.zeros(B, H, offset, Dh, dtype=torch.float64), cotangent(dec[0].shape)], dim=2)
    out, dq, dk, dv = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(None, window)), qf, kr, vr,
                                       grad_full)
    assert_same(dec, [out[:, :, offset:], dq[:, :, offset:], dk, dv])
    assert attn.paths_used() == {path}


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("docs", [False, True])
def test_window_at_least_T_equals_no_window(path, docs):
    B, H, T, Dh = 2, 3, 9, 4
    q, k, v = qkv(B, H, T, T, Dh, seed=5)
    doc_ids = packed_doc_ids(B, T) if docs else None
    attn.use_path(path)
    plain = output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(doc_ids)), q, k, v)
    for window in (T, T + 1, 1000):
        assert_same(output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(doc_ids, window)), q, k, v),
                    plain)
        dec = attn.attention(q[:, :, 3:], k, v, M(None, window), 3)
        torch.testing.assert_close(dec, attn.attention(q[:, :, 3:], k, v, M(), 3), **TOL)


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("docs", [False, True])
def test_window_one_attends_to_self_only(path, docs):
    B, H, T, Dh = 2, 3, 8, 5
    q, k, v = qkv(B, H, T, T, Dh, seed=6)
    doc_ids = packed_doc_ids(B, T) if docs else None
    attn.use_path(path)
    out, dq, dk, dv = output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(doc_ids, 1)), q, k, v)
    torch.testing.assert_close(out, v.detach(), **TOL)
    # one key per row: the softmax is constant, so nothing flows to q or k and dv is the cotangent
    assert torch.all(dq.abs() < 1e-12) and torch.all(dk.abs() < 1e-12)
    torch.testing.assert_close(dv, cotangent(out.shape), **TOL)
    torch.testing.assert_close(attn.attention(q[:, :, 5:], k, v, M(None, 1), 5), v.detach()[:, :, 5:], **TOL)


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("window", [0, -2])
def test_window_below_one_is_refused(path, window):
    q, k, v = (t.detach() for t in qkv(1, 1, 4, 4, 2))
    attn.use_path(path)
    with pytest.raises(ValueError, match=f"attention window={window} must be at least 1"):
        attn.attention(q, k, v, M(None, window))
    with pytest.raises(ValueError, match=f"attention window={window} must be at least 1"):
        attn.attention(q, k, v, M(None, window), 0)


def test_windowed_attention_compiles_with_fullgraph():
    torch._dynamo.reset()
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(2, 3, 7, 7, 4))
    doc_ids = packed_doc_ids(2, 7)

    def fn(q, k, v, doc_ids):
        return attn.attention(q, k, v, M(doc_ids, 3)) + attn.attention(q, k, v, M(None, 2), 0)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, doc_ids)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v, doc_ids))


# --- grouped-query attention: k and v with H_kv heads, query head h reading kv head h // (H / H_kv) --


def gqa_qkv(B, H, H_kv, Tq, Tk, Dh, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, T, Dh, generator=g, dtype=torch.float64, requires_grad=True)
            for heads, T in ((H, Tq), (H_kv, Tk), (H_kv, Tk))]


@pytest.mark.parametrize("H,H_kv", [(6, 2), (6, 1), (6, 3), (4, 2)])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_gqa_sdpa_matches_reference(H, H_kv, T, docs, window):
    B, Dh = 3, 4
    q, k, v = gqa_qkv(B, H, H_kv, T, T, Dh, seed=H_kv + T)
    doc_ids = packed_doc_ids(B, T) if docs else None
    fast = output_and_grads(lambda q, k, v: sdpa.attention(q, k, v, M(doc_ids, window), scale=0.37), q, k, v)
    ref = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(doc_ids, window), scale=0.37), q, k, v)
    assert [t.shape[1] for t in fast] == [H, H, H_kv, H_kv]  # dk, dv have the kv heads' shape
    assert_same(fast, ref)


@pytest.mark.parametrize("H_kv", [1, 2, 3])
def test_gqa_reference_is_mha_on_repeated_heads(H_kv):
    """Against plain multi-head attention on k and v whose head h is built as kv head h // (H / H_kv)
    (not with repeat_interleave, which the reference itself uses): outputs and every gradient, the
    kv gradients summed over the query heads sharing them by autograd through the copies."""
    B, H, T, Dh = 2, 6, 9, 4
    q, k, v = gqa_qkv(B, H, H_kv, T, T, Dh, seed=H_kv)
    doc_ids = packed_doc_ids(B, T)
    group = H // H_kv

    def repeated(t):
        return torch.stack([t[:, h // group] for h in range(H)], dim=1)

    gqa = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(doc_ids)), q, k, v)
    mha = output_and_grads(lambda q, k, v: reference.attention(q, repeated(k), repeated(v), M(doc_ids)), q, k, v)
    assert_same(gqa, mha)
    if H_kv > 1:  # the grouping matters: another assignment of query heads to kv heads answers differently
        shuffled = torch.stack([k[:, h % H_kv] for h in range(H)], dim=1)
        other = reference.attention(q, shuffled, torch.stack([v[:, h % H_kv] for h in range(H)], dim=1), M(doc_ids))
        assert not torch.allclose(other, gqa[0])


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("offset,Tq", [(0, 1), (6, 1), (6, 4), (20, 13)])
@pytest.mark.parametrize("window", [None, 3])
def test_gqa_cached_attention_equals_the_tail_of_full_attention(path, offset, Tq, window):
    B, H, H_kv, Dh = 2, 6, 2, 4
    Tk = offset + Tq
    q_full, k, v = gqa_qkv(B, H, H_kv, Tk, Tk, Dh, seed=offset + Tq)
    q = q_full.detach()[:, :, offset:].requires_grad_()
    attn.use_path(path)
    dec = output_and_grads(lambda q, k, v: attn.attention(q, k, v, M(None, window), offset), q, k, v)
    assert attn.paths_used() == {path}
    grad_full = torch.cat([torch.zeros(B, H, offset, Dh, dtype=torch.float64), cotangent(dec[0].shape)], dim=2)
    out, dq, dk, dv = output_and_grads(lambda q, k, v: reference.attention(q, k, v, M(None, window)), q_full, k, v,
                                       grad_full)
    assert_same(dec, [out[:, :, offset:], dq[:, :, offset:], dk, dv])


@pytest.mark.parametrize("docs", [False, True])
def test_gqa_sdpa_dropout_equals_dropout_on_repeated_heads(docs):
    """SDPA's enable_gqa with dropout_p: the same dropped probabilities (same seed) and gradients as
    SDPA on k and v expanded to every query head; dropout really acts."""
    B, H, H_kv, T, Dh = 2, 6, 2, 11, 4
    q, k, v = gqa_qkv(B, H, H_kv, T, T, Dh, seed=9)
    doc_ids = packed_doc_ids(B, T) if docs else None

    def seeded(fn):
        def run(q, k, v):
            torch.manual_seed(123)
            return fn(q, k, v)
        return run

    gqa = output_and_grads(seeded(lambda q, k, v: sdpa.attention(q, k, v, M(doc_ids), dropout_p=0.3)), q, k, v)
    mha = output_and_grads(seeded(lambda q, k, v: sdpa.attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), M(doc_ids), dropout_p=0.3)), q, k, v)
    assert_same(gqa, mha)
    assert not torch.allclose(gqa[0], sdpa.attention(q, k, v, M(doc_ids)).detach())


@pytest.mark.parametrize("path", attn.GENERAL_PATHS)
@pytest.mark.parametrize("heads", [(6, 4), (4, 3), (2, 4)])
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused(path, heads):
    H, H_kv = heads
    q, k, v = (t.detach() for t in gqa_qkv(1, H, H_kv, 4, 4, 2))
    attn.use_path(path)
    message = rf"key and value heads \({H_kv}, {H_kv}\) must be equal and divide the {H} query heads"
    with pytest.raises(ValueError, match=message):
        attn.attention(q, k, v, M())
    with pytest.raises(ValueError, match=message):
        attn.attention(q, k, v, M(), 0)
    with pytest.raises(ValueError, match=r"key and value heads \(2, 1\)"):
        attn.attention(q, k[:, :2], v[:, :1], M())


def test_gqa_compiles_with_fullgraph():
    torch._dynamo.reset()
    q, k, v = (t.detach().float().requires_grad_() for t in gqa_qkv(2, 6, 2, 7, 7, 4))
    doc_ids = packed_doc_ids(2, 7)

    def fn(q, k, v, doc_ids):
        return attn.attention(q, k, v, M()) + attn.attention(q, k, v, M(doc_ids, 3)) + attn.attention(q, k, v, M(), 0)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, doc_ids)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v, doc_ids))
    assert k.grad.shape == k.shape
