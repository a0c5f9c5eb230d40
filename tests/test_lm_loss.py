"""The language-model loss's chunked path against its reference (kernels/lm_loss): the value and the
gradients of h and of the (tied) output weight, at odd shapes, with masks, ignored labels and chunks
that do not divide the positions; the model field that turns it on, and what it saves."""
import pytest
import torch

from kernels import paths_used, reset_paths_used
from kernels.lm_loss import chunked, lm_loss, reference


def _case(B, T, d, V, seed=0, dtype=torch.float64, mask=True, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        y[0, :2] = -100
    m = (torch.rand(B, T, generator=g) > 0.3) if mask else None
    return h, w, y, m


def _grads(fn, h, w, y, m, **kw):
    h.grad = w.grad = None
    loss = fn(h, w, y, m, **kw)
    (loss * 1.7).backward()  # a non-unit upstream gradient: the backward scales what the forward kept
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("B,T,d,V,chunk,mask", [(2, 7, 5, 11, 3, True), (3, 13, 8, 37, 64, False),
                                                (1, 9, 6, 5, 1, True), (2, 10, 4, 17, 10, True)])
def test_chunked_equals_reference_in_value_and_gradients(B, T, d, V, chunk, mask):
    h, w, y, m = _case(B, T, d, V, mask=mask)
    ref = _grads(reference.lm_loss, h, w, y, m)
    got = _grads(chunked.lm_loss, h, w, y, m, chunk=chunk)
    for a, b, name in zip(got, ref, ("loss", "grad h", "grad weight")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_chunked_in_float32_and_an_all_masked_batch():
    h, w, y, m = _case(2, 33, 16, 50, dtype=torch.float32)
    ref, got = _grads(reference.lm_loss, h, w, y, m), _grads(chunked.lm_loss, h, w, y, m, chunk=8)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    none = torch.zeros_like(m)
    loss, gh, gw = _grads(chunked.lm_loss, h, w, y, none, chunk=8)
    assert loss.item() == 0.0 and gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_tied_weight_gradients_add_up():
    """Tied to the embedding: the head's gradient adds to the embedding's, as the reference's does."""
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(23, 6, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randint(0, 23, (2, 9), generator=g)
    y = torch.randint(0, 23, (2, 9), generator=g)
    out = []
    for fn, kw in ((reference.lm_loss, {}), (chunked.lm_loss, {"chunk": 4})):
        emb.grad = None
        h = torch.tanh(emb[x])
        fn(h, emb, y, None, **kw).backward()
        out.append(emb.grad.clone())
    torch.testing.assert_close(out[1], out[0], rtol=1e-10, atol=1e-12)


def test_the_op_picks_chunked_only_when_asked_and_training():
    h, w, y, m = _case(2, 5, 4, 9, dtype=torch.float32)
    reset_paths_used()
    lm_loss(h, w, y, m)
    assert paths_used()["lm_loss"] == ["reference"]
    reset_paths_used()
    lm_loss(h, w, y, m, chunk=4)
    assert paths_used()["lm_loss"] == ["chunked"]
    reset_paths_used()
    with torch.no_grad():  # evaluation keeps nothing either way: the reference, as the golden runs
        lm_loss(h, w, y, m, chunk=4)
    assert paths_used()["lm_loss"] == ["reference"]
    with pytest.raises(ValueError, match="chunk >= 1"):
        chunked.lm_loss(h, w, y, m, chunk=0)


def test_model_loss_chunk_trains_the_same_model():
    """model.loss_chunk on a registry model: the same loss and gradients as without, to float32 rounding."""
    from pretrain.data.batch import collate
    from pretrain.models import get_arch

    spec = get_arch("baseline")
    torch.manual_seed(0)
    cfg = spec.config_cls(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    a = spec.build(cfg)
    b = spec.build(spec.config_cls(**{**cfg.__dict__, "loss_chunk": 7}))
    b.load_state_dict(a.state_dict())
    raw = torch.randint(0, 97, (3, 17)).numpy()
    batch = collate((raw, raw * 0), eod_id=None)
    la, lb = a(batch)[0], b(batch)[0]
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="loss_chunk"):
        spec.config_cls(loss_chunk=-1).validate()


def test_chunked_under_bf16_autocast_follows_the_reference():
    """Under autocast the head's input is bf16 and the weight fp32: the products run in bf16 (as the
    reference's do), the softmax and sums in fp32, the gradients in the inputs' dtypes."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(50, 16, generator=g) * 0.3).requires_grad_()
    x = torch.randn(2, 33, 16, generator=g)
    y = torch.randint(0, 50, (2, 33), generator=g)
    out = []
    for fn, kw in ((reference.lm_loss, {}), (chunked.lm_loss, {"chunk": 8})):
        w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, torch.eye(16))  # a bf16 activation, as a model's under autocast
            loss = fn(h, w, y, None, **kw)
        loss.backward()
        out.append((loss.detach().float(), w.grad.clone()))
    assert out[1][1].dtype == torch.float32
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=5e-2, atol=5e-3)


def test_chunked_compiled_keeps_its_gradients():
    """Compiled, the chunked loss gives eager's value and gradients. On torch 2.11 (the GPU image's) the running
    total added in place into the Function's output made dynamo trace a backward of zeros: every gradient of
    RT's and GPN's compiled 512-sequence runs was 0 on the H200 (2026-11-30); scripts/image_torch_check.sh runs
    this file under that torch."""
    h, w, y, m = _case(2, 13, 8, 37, dtype=torch.float32)
    eager = _grads(chunked.lm_loss, h, w, y, m, chunk=5)
    torch._dynamo.reset()
    got = _grads(torch.compile(chunked.lm_loss, backend="aot_eager", fullgraph=True), h, w, y, m, chunk=5)
    assert float(eager[2].abs().sum()) > 0
    for a, b, name in zip(got, eager, ("loss", "grad h", "grad weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
