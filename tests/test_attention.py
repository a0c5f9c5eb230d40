"""kernels.attention: every path against the naive reference (contract 4), and the dispatcher.

The reference is an explicit masked softmax in float64; the sdpa path must match it in outputs and in
the gradients of q, k and v at odd shapes, with packed documents (a one-token document included),
with and without a custom scale, and in streaming decode at several cache offsets. The dispatcher
must say which path ran, obey a forced path, and survive torch.compile(fullgraph=True).
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
    fast = output_and_grads(lambda q, k, v: sdpa.attention(q, k, v, doc_ids, scale), q, k, v)
    ref = output_and_grads(lambda q, k, v: reference.attention(q, k, v, doc_ids, scale), q, k, v)
    assert_same(fast, ref)


def test_reference_is_the_textbook_formula():
    """Checked against a per-row loop, so a bug shared by the mask code of both paths cannot hide."""
    B, H, T, Dh = 2, 1, 6, 3
    q, k, v = (t.detach() for t in qkv(B, H, T, T, Dh))
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    out = reference.attention(q, k, v, doc_ids)
    for b, i in itertools.product(range(B), range(T)):
        keys = [j for j in range(i + 1) if doc_ids[b, j] == doc_ids[b, i]]
        w = torch.softmax(q[b, 0, i] @ k[b, 0, keys].T / Dh**0.5, dim=-1)
        torch.testing.assert_close(out[b, 0, i], w @ v[b, 0, keys], **TOL)
    allowed = torch.tensor([[[j <= i and doc_ids[b, j] == doc_ids[b, i] for j in range(T)] for i in range(T)]
                            for b in range(B)])
    assert torch.equal(attn.document_causal_mask(doc_ids), allowed[:, None])


@pytest.mark.parametrize("path", attn.PATHS)
@pytest.mark.parametrize("offset,Tq", [(0, 1), (0, 5), (1, 1), (6, 1), (6, 4), (32, 1), (20, 13)])
def test_cached_attention_equals_the_tail_of_full_attention(path, offset, Tq):
    B, H, Dh = 3, 3, 10
    Tk = offset + Tq
    q_full, k, v = qkv(B, H, Tk, Tk, Dh, seed=offset + Tq)
    q = q_full.detach()[:, :, offset:].requires_grad_()
    attn.use_path(path)
    dec = output_and_grads(lambda q, k, v: attn.cached_attention(q, k, v, offset), q, k, v)
    assert attn.paths_used() == {path}
    # The full-length run with the decode's output gradient on its last Tq rows and zero on the cached
    # rows: its tail must equal the decode in output and dq, and its dk, dv must equal the decode's.
    grad_full = torch.cat([torch.zeros(B, H, offset, Dh, dtype=torch.float64), cotangent(dec[0].shape)], dim=2)
    out, dq, dk, dv = output_and_grads(lambda q, k, v: reference.attention(q, k, v), q_full, k, v, grad_full)
    assert_same(dec, [out[:, :, offset:], dq[:, :, offset:], dk, dv])
    assert torch.all(dq[:, :, :offset] == 0)


def test_dispatcher_reports_and_forces_the_path():
    q, k, v = (t.detach() for t in qkv(2, 3, 7, 7, 4))
    doc_ids = packed_doc_ids(2, 7)
    assert attn.paths_used() == set()
    fast = attn.attention(q, k, v, doc_ids)
    assert attn.paths_used() == {"sdpa"}
    attn.use_path("reference")
    attn.reset_paths_used()
    forced = attn.attention(q, k, v, doc_ids)
    assert attn.paths_used() == {"reference"}
    torch.testing.assert_close(forced, reference.attention(q, k, v, doc_ids), rtol=0, atol=0)
    torch.testing.assert_close(fast, forced, **TOL)
    with pytest.raises(ValueError, match="'triton' is not an attention path"):
        attn.use_path("triton")


def test_environment_variable_forces_the_path():
    code = ("import torch, kernels.attention as a; x = torch.randn(1, 1, 3, 2); a.attention(x, x, x); "
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
        return attn.attention(q, k, v) + attn.attention(q, k, v, doc_ids) + attn.cached_attention(q, k, v, 0)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, doc_ids)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v, doc_ids))
    assert attn.paths_used() == {"sdpa"}
    attn.reset_paths_used()
    compiled(q, k, v, doc_ids)  # a cached graph still reports
    assert attn.paths_used() == {"sdpa"}
    attn.use_path("reference")  # dynamo guards on the forced path, so this recompiles
    attn.reset_paths_used()
    torch.testing.assert_close(compiled(q, k, v, doc_ids), fn(q, k, v, doc_ids), rtol=1e-5, atol=1e-6)
    assert attn.paths_used() == {"reference"}
