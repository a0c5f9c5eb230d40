"""kernels.attention on CUDA (marker `gpu`; skipped without a CUDA device): the mask values through the
SDPA path on the GPU against the float64 reference, in float32 and bf16, training and decode, with GQA,
ALiBi and an architecture's own predicate; and the dispatcher under torch.compile (inductor) there.
The mask logic itself is tested on the CPU (tests/test_masks.py, tests/test_attention.py); this file
only shows the same calls hold on the device."""
import pytest
import torch

import kernels.attention as attn
from kernels.attention import masks, reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (SDPA's GPU kernels)")]

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def docs(B, T):
    return torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5 + b, 40, 7, T]))[:T]
                        for b in range(B)]).cuda()


def mask_of(kind, doc_ids, B):
    m = masks.causal()
    if "doc" in kind:
        m = m & masks.document(doc_ids)
    if "window" in kind:
        m = m & masks.window(17)
    if "prefix" in kind:
        m = m | masks.prefix(torch.tensor([3, 9], device="cuda")[:B])
    if "strided" in kind:
        m = m & masks.Mask(lambda b, h, q, kv: (q - kv) % 2 == 0, "strided")
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "causal+doc", "causal+window", "causal+doc+window", "causal+prefix",
                                  "causal+strided"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("alibi", [False, True])
def test_sdpa_on_cuda_matches_the_float64_reference(dtype, kind, heads, alibi):
    B, T, Dh = 2, 131, 64
    H, H_kv = heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, Dh, device="cuda", generator=g)
    k, v = (torch.randn(B, H_kv, T, Dh, device="cuda", generator=g) for _ in range(2))
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H) if alibi else None
    mask = mask_of(kind, docs(B, T), B)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    attn.use_path("sdpa")  # the other paths have their own test below
    out = attn.attention(*leaves, mask, alibi_slopes=slopes)
    assert attn.paths_used() >= {"sdpa"}
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*exact, mask, alibi_slopes=None if slopes is None else slopes.double())
    want_grads = torch.autograd.grad(want.square().sum(), exact)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), ref, **{k: 10 * v for k, v in TOL[dtype].items()})
    # decode: the last 5 queries after a cache, the same mask value at an offset
    dec = attn.attention(leaves[0][:, :, -5:].detach(), leaves[1].detach(), leaves[2].detach(), mask, T - 5,
                         alibi_slopes=slopes)
    torch.testing.assert_close(dec.double(), want[:, :, -5:].detach(), **TOL[dtype])


@pytest.fixture
def static_priority():
    """The static order of the paths (measured choices are tested in tests/test_kernel_measure.py)."""
    from kernels import registry

    was = registry.measuring()
    registry.measuring(False)
    yield
    registry.measuring(was)


def test_compiled_attention_on_cuda_reports_and_matches_eager(static_priority):
    torch._dynamo.reset()
    B, H, T, Dh = 2, 4, 64, 32
    q, k, v = (torch.randn(B, H, T, Dh, device="cuda", requires_grad=True) for _ in range(3))
    doc_ids = docs(B, T)

    def fn(q, k, v, doc_ids):
        return attn.attention(q, k, v, masks.causal()) + attn.attention(q, k, v, masks.decoder_mask(doc_ids, 9))

    attn.reset_paths_used()
    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, v, doc_ids)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v, doc_ids), rtol=1e-4, atol=1e-4)
    assert attn.paths_used() == {"sdpa", "triton"}  # plain causal: SDPA's kernel; documents + window: Triton


def _sps(T, B):
    from pretrain.models.sps import VARIANTS, SlotMask, slot_tables

    tok, kind = slot_tables(T, "cuda")
    d = docs(B, T).repeat(1, 2)
    return SlotMask(tok, kind, tok, kind, VARIANTS["sps"][0], 5, d, d, tokens=T)


@pytest.mark.parametrize("path", ["triton", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "causal+doc", "causal+doc+window", "causal+prefix", "sps"])
@pytest.mark.parametrize("offset", [0, 19])
def test_block_sparse_paths_on_cuda_match_the_float64_reference(path, dtype, kind, offset):
    """The Triton kernel and FlexAttention on the device, forward and backward (the CPU tests run the
    Triton kernel interpreted and FlexAttention forward only)."""
    B = 2
    if kind == "sps":
        if offset:
            pytest.skip("the SPS training mask has no decode offset (decode uses its ring cache)")
        T = 70
        mask, Tq, Tk = _sps(T, B), 2 * T, 2 * T
    else:
        Tq, Tk = 131 - offset, 131
        mask = mask_of(kind, docs(B, Tk), B)
    _check_path(path, dtype, mask, B, Tq, Tk, offset, 64)


@pytest.mark.parametrize("dtype, Dh", [(torch.bfloat16, 128), (torch.bfloat16, 136), (torch.float32, 90),
                                       (torch.float32, 256)])
def test_the_triton_kernels_at_each_tile_configuration_on_cuda(dtype, Dh):
    """kernels/triton_support.FLASH_TILES' other entries (64 x 32, 32 x 32, 16 x 16 with 1 or 2 stages), which
    kernels/cuda_build.py compiles on a CPU and the interpreter runs at their sizes: here on the device."""
    B, T = 2, 200
    _check_path("triton", dtype, mask_of("causal+doc", docs(B, T), B), B, T, T, 0, Dh)


def _check_path(path, dtype, mask, B, Tq, Tk, offset, Dh):
    """The forced path's output and input gradients against the float64 reference, on the device."""
    H, H_kv = 4, 2
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, Tq, Dh, device="cuda", generator=g)
    k, v = (torch.randn(B, H_kv, Tk, Dh, device="cuda", generator=g) for _ in range(2))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    attn.use_path(path)
    attn.reset_paths_used()
    try:
        out = attn.attention(*leaves, mask, offset)
        grads = torch.autograd.grad(out.float().square().sum(), leaves)
    finally:
        attn.use_path(None)
    assert attn.paths_used() == {path}
    exact = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*exact, mask, offset)
    want_grads = torch.autograd.grad(want.square().sum(), exact)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), ref, **{k: 10 * v for k, v in TOL[dtype].items()})


def test_the_dispatcher_picks_a_block_sparse_path_for_masked_training_on_cuda(static_priority):
    B, H, T, Dh = 2, 4, 256, 64
    q, k, v = (torch.randn(B, H, T, Dh, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attn.use_path(None)
    attn.reset_paths_used()
    attn.attention(q, k, v, mask_of("causal+doc", docs(B, T), B)).sum().backward()
    picked = attn.paths_used()
    attn.reset_paths_used()
    attn.attention(q, k, v, masks.causal()).sum().backward()
    assert picked == {"triton"} and attn.paths_used() == {"sdpa"}
    attn.reset_paths_used()  # a mask without declared runs: FlexAttention
    strided = masks.causal() & masks.Mask(lambda b, h, qi, kv: (qi - kv) % 2 == 0, "strided")
    attn.attention(q, k, v, strided).sum().backward()
    assert attn.paths_used() == {"flex"}


def test_rt_triton_tile_on_cuda_under_bf16_autocast_errs_as_the_pytorch_tile():
    """Under bf16 autocast the Triton tile multiplies bf16 operands on the tensor cores, as the PyTorch tile
    does: a layer's output and input gradient err against the fp64 loop alike (the CPU test rounds operands
    itself on Triton's interpreter; this one runs the GPU's own conversion and tl.dot)."""
    from kernels.rt_prefill import reference, tiled, triton_tile
    from pretrain.models.rt import RT, LayerView, RTConfig

    cfg = RTConfig(vocab_size=64, d_model=128, n_layers=1, n_heads=2, max_seq_len=128)
    torch.manual_seed(0)
    model, m64 = RT(cfg), RT(cfg).double()
    m64.load_state_dict(model.state_dict())
    x, g = torch.randn(4, 100, 128), torch.randn(4, 100, 128)
    x64 = x.double().requires_grad_()
    want = reference.prefill(x64, LayerView(m64.blocks[0], None, 0))
    want = [want, *torch.autograd.grad(want, x64, g.double())]
    model = model.cuda()
    errors = []
    for ops in (triton_tile.OPS, tiled.TORCH_OPS):
        xc = x.cuda().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            z = tiled.prefill(xc, LayerView(model.blocks[0], None, 0), 1, ops=ops)
        got = [z, *torch.autograd.grad(z, xc, g.cuda())]
        errors.append(max(((a.double().cpu() - b).norm() / b.norm()).item() for a, b in zip(got, want)))
    assert errors[0] < 1.5 * errors[1] and errors[1] < 0.05, errors


@pytest.mark.parametrize("leaf", [1, 16])
def test_rt_triton_tile_on_cuda_matches_the_naive_loop(leaf):
    """The RT layer through the Triton tile kernels on the device against the naive loop (float64, CPU
    oracle on the same weights): z and the input gradient."""
    from kernels.rt_prefill import reference, tiled, triton_tile
    from pretrain.models.rt import RT, LayerView, RTConfig

    torch.manual_seed(0)
    model = RT(RTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=128))
    N = 77
    x = torch.randn(2, N, 64)
    g = torch.randn(2, N, 64)
    x64 = x.double().requires_grad_()
    m64 = RT(RTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=128)).double()
    m64.load_state_dict(model.state_dict())
    want = reference.prefill(x64, LayerView(m64.blocks[0], None, 0))
    (want_dx,) = torch.autograd.grad(want, x64, g.double())
    model = model.cuda()
    xc = x.cuda().requires_grad_()
    z = tiled.prefill(xc, LayerView(model.blocks[0], None, 0), leaf, ops=triton_tile.OPS)
    (dx,) = torch.autograd.grad(z, xc, g.cuda())
    torch.testing.assert_close(z.double().cpu(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx.double().cpu(), want_dx, rtol=1e-3, atol=1e-3)
