"""The Recurrent Transformer's own mechanism (spec-003 §6 and §8): the tile schedule against the naive
definition (values in float64 and float32, gradients of the custom backward against autograd through
the naive loop), the schedule's coverage and order, keys moved, decode against prefill, the first
position against the Transformer, the transformer-emulation theorem (§6.7), bad input, a short run.

The registry-wide tests (tests/test_registry.py, tests/test_layout_matrix.py, tests/test_export.py)
cover streaming decode, generation, the golden curve, kill-and-resume, the layouts and export.
"""
import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import registry
from kernels.rt_prefill import reference, rt_prefill, schedule, tiled
from pretrain.config import ConfigError, load_config
from pretrain.models.rt import RT, LayerView, RTConfig, flops_per_token

V = 64


def model_of(dtype=torch.float64, seed=0, **kw) -> RT:
    values = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=4, max_seq_len=128)
    values.update(kw)
    torch.manual_seed(seed)
    model = RT(RTConfig(**values)).to(dtype)
    with torch.no_grad():  # gains away from one, so a norm applied to the wrong tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def layer_of(model: RT, N: int, i: int = 0) -> LayerView:
    rope = model.rope.at(torch.arange(N)[None]) if model.rope is not None else None
    return LayerView(model.blocks[i], rope, 0)


# -- the schedule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("leaf", [1, 2, 4, 16])
def test_the_schedule_covers_every_pair_once_in_order_for_every_N_up_to_300(leaf):
    for N in range(1, 301):
        seen = torch.zeros(N, N, dtype=torch.int32)
        for t in range(N):  # forward: leaf keys just before query t is finalised, then the tile after step t
            k0, k1 = schedule.leaf_keys(t, leaf)
            seen[t, k0:k1] += 1
        for t, k0, k1, q1 in schedule.tiles(N, leaf):
            assert k1 == t + 1 and q1 > k1  # keys revealed by step t, queries not finalised yet
            seen[k1:q1, k0:k1] += 1
        assert torch.equal(seen, torch.ones(N, N, dtype=torch.int32).tril(-1)), N
        back = torch.zeros(N, N, dtype=torch.int32)  # backward: the pieces whose queries start at t
        for t in range(N):
            for a0, a1, k0, k1 in tiled._pieces(N, leaf, t):
                assert a0 == t and k1 <= t  # every query's gradient known, every key still accumulating
                back[a0:a1, k0:k1] += 1
        assert torch.equal(back, seen), N


def test_keys_moved_counts():
    for N in (256, 512, 1024, 2048):
        assert schedule.keys_moved(N) == N // 2 * int(math.log2(N))
    assert schedule.keys_moved(512) == 2304 and schedule.naive_keys_moved(512) == 130816
    model = model_of()
    for N, leaf in itertools.product((1, 2, 7, 16, 33, 64), (1, 2, 4, 16)):
        view = LayerView(model.blocks[0], None, 0)
        tiled.KEYS_MOVED[0] = 0
        with torch.no_grad():
            tiled.forward(torch.randn(1, N, 16, dtype=torch.float64), view, leaf)
        want = sum(P for t, k0, k1, _ in schedule.tiles(N, leaf) for P in [k1 - k0])
        want += sum(t - schedule.leaf_keys(t, leaf)[0] for t in range(N))
        assert tiled.KEYS_MOVED[0] == schedule.keys_moved(N, leaf) == want, (N, leaf)
    assert schedule.keys_moved(512, 16) < schedule.keys_moved(512) + 512 * 15


@pytest.mark.parametrize("H", [6, 16, 22, 32])
def test_alibi_slopes_are_exact_in_float64_and_unchanged_in_float32(H):
    """Spec §2.3's 2^(-8h/H) in the model's dtype: a float64 model's slopes are computed in float64, not
    float32 values cast up (H not a power of two: every paper row); float32 keeps its values."""
    want = torch.tensor([2.0 ** (-8.0 * h / H) for h in range(1, H + 1)], dtype=torch.float64)
    exact = dict(rtol=1e-15, atol=0)  # float64 rounding (float32 cast up is off by up to 3e-8)
    model = model_of(d_model=2 * H, n_heads=H)
    for view in (model.blocks[0].attn.alibi.slopes, layer_of(model, 3).slopes):
        assert view.dtype == torch.float64
        torch.testing.assert_close(view, want, **exact)
    back = model.float()
    assert torch.equal(back.blocks[1].attn.alibi.slopes, want.float())
    torch.testing.assert_close(back.double().blocks[1].attn.alibi.slopes, want, **exact)  # float32 and back


# -- values and gradients -----------------------------------------------------------------------------
SETTINGS = list(itertools.product([1, 3], [1, 4], ["alibi", "rope"], ["rms", "layer"]))  # B, H, positions, norm
# spec §6.1's lengths: every setting at the short ones, the long ones (the naive loop is slow) at two settings each
GRID = [(N, *s) for N in (1, 2, 3, 5, 8, 17) for s in SETTINGS]
GRID += [(N, *SETTINGS[i]) for N, i in ((37, 5), (37, 10), (64, 15), (64, 0), (100, 6), (100, 9))]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_tiled_equals_the_naive_loop_over_the_spec_grid(dtype, tol, grid=GRID):
    for N, B, H, positions, norm in grid:
        model = model_of(dtype, n_heads=H, positions=positions, norm=norm, d_model=8 * H)
        x = torch.randn(B, N, 8 * H, dtype=dtype, generator=torch.Generator().manual_seed(N))
        view = layer_of(model, N)
        with torch.no_grad():
            want = reference.prefill(x, view)
            for leaf in (1, 4):
                got = tiled.forward(x, view, leaf)[0]
                torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=f"{N, B, H, positions, norm, leaf}")


@pytest.mark.slow
def test_tiled_equals_the_naive_loop_over_the_whole_spec_grid():
    grid = [(N, *s) for N in (1, 2, 3, 5, 8, 17, 37, 64, 100) for s in SETTINGS]
    test_tiled_equals_the_naive_loop_over_the_spec_grid(torch.float64, 1e-12, grid)
    test_tiled_equals_the_naive_loop_over_the_spec_grid(torch.float32, 1e-5, grid)


class _WithoutOwnGradients:
    """A layer exposing only what the kernels require: the backward then differentiates kv and post
    with autograd, position by position, instead of the model's hand-written vjp_kv / vjp_post."""

    def __init__(self, view):
        self.view, self.scale, self.slopes = view, view.scale, view.slopes
        self.pre, self.post, self.kv, self.parameters = view.pre, view.post, view.kv, view.parameters


@pytest.mark.parametrize("positions,norm,qk_norm,leaf,own,N", [("alibi", "rms", "full", 1, True, 37),
                                                               ("rope", "layer", "head", 1, True, 37),
                                                               ("alibi", "layer", "full", 4, True, 37),
                                                               ("rope", "rms", "full", 2, False, 37),
                                                               # past the 64-query blocks that rebuild the
                                                               # attention outputs and the queries' gradient
                                                               ("alibi", "rms", "full", 16, True, 130)])
def test_the_custom_backward_equals_autograd_through_the_naive_loop(positions, norm, qk_norm, leaf, own, N):
    model = model_of(positions=positions, norm=norm, qk_norm=qk_norm, residual_multiplier=0.7, max_seq_len=max(128, N))
    x = torch.randn(3, N, 16, dtype=torch.float64, requires_grad=True)
    view = layer_of(model, N) if own else _WithoutOwnGradients(layer_of(model, N))
    params = list(model.blocks[0].parameters())
    g = torch.randn(3, N, 16, dtype=torch.float64)
    want = torch.autograd.grad(reference.prefill(x, view), [x, *params], g)
    z = tiled.prefill(x, view, leaf)
    assert z.grad_fn is not None and "TiledPrefill" in type(z.grad_fn).__name__
    got = torch.autograd.grad(z, [x, *params], g)
    for (name, _), a, b in zip([("x", x)] + list(model.blocks[0].named_parameters()), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_the_model_trains_through_the_tiled_path_and_matches_the_naive_path():
    from pretrain.data.batch import collate
    from kernels import registry

    model = model_of(n_layers=2)
    raw = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    batch = collate((raw.numpy(), torch.zeros_like(raw).numpy()), eod_id=None)
    grads = {}
    for path in ("tiled", "naive"):
        registry.force("rt_prefill", path)
        try:
            model.zero_grad()
            loss, _ = model(batch)
            loss.backward()
        finally:
            registry.force("rt_prefill", None)
        grads[path] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["tiled"][0], grads["naive"][0], rtol=1e-12, atol=0)
    for a, b in zip(grads["tiled"][1], grads["naive"][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# -- decode, the Transformer ---------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["alibi", "rope"])
def test_decode_equals_prefill_in_any_chunking(positions):
    model, tokens = model_of(positions=positions).eval(), torch.randint(0, V, (2, 23))
    with torch.no_grad():
        full = model.logits(tokens)
        for chunks in ((23,), (1,) * 23, (5, 1, 7, 2, 8)):
            state, pieces, t = model.new_state(2), [], 0
            for n in chunks:
                pieces.append(model.step(tokens[:, t:t + n], state)[0])
                t += n
            torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-12)


def test_the_first_position_is_the_transformer_with_the_same_weights():
    rt = model_of().eval()
    transformer = RT(dataclasses.replace(rt.cfg, recurrent=False)).double().eval()
    transformer.load_state_dict(rt.state_dict())  # the same parameter names: RT adds none
    tokens = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        a, b = rt.logits(tokens), transformer.logits(tokens)
    torch.testing.assert_close(a[:, 0], b[:, 0], rtol=0, atol=1e-12)
    assert (a[:, 1:] - b[:, 1:]).abs().amax() > 1e-3


def test_parameter_counts_of_the_paper_rows_and_flops():
    for (L, d, H), non_embedding in [((12, 1024, 16), 151_045_120), ((6, 1408, 22), 142_772_608),
                                     ((12, 1408, 22), 285_543_808), ((6, 2048, 32), 302_041_088)]:
        for recurrent in (True, False):
            with torch.device("meta"):
                model = RT(RTConfig(n_layers=L, d_model=d, n_heads=H, recurrent=recurrent))
            from pretrain.models import count_parameters

            counts = count_parameters(model)
            assert counts["non_embedding"] == non_embedding and counts["embedding"] == 2 * 32128 * d
    cfg = RTConfig(n_layers=2, d_model=16, n_heads=4, vocab_size=V)
    t = dataclasses.replace(cfg, recurrent=False)
    assert flops_per_token(cfg, 32) - flops_per_token(t, 32) == 6 * 2 * 2 * 16 * 16  # K|V twice: +2 d^2 per layer


# -- Theorem 1: a norm-free RT of width 3d' computes a norm-free Transformer of width d' -----------------
class _NormFreeTransformerLayer:
    def __init__(self, d, f, gen):
        w = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen) / math.sqrt(s[-1])  # noqa: E731
        self.Wq, self.Wk, self.Wv, self.Wo, self.W1, self.W2 = w(d, d), w(d, d), w(d, d), w(d, d), w(f, d), w(d, f)
        self.scale = 1 / math.sqrt(d)

    def __call__(self, x):  # x [N, d]
        q, k, v = x @ self.Wq.T, x @ self.Wk.T, x @ self.Wv.T
        s = (self.scale * q @ k.T).masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
        h = x + (s.softmax(-1) @ v) @ self.Wo.T
        return h + F.relu(h @ self.W1.T) @ self.W2.T


class _EmulatingRTLayer:
    """The construction of Theorem 1 as a layer the kernels run: blocks carry | live | scratch of width
    d'; Q, K, V read the carry block (the Transformer layer's input), the output projection writes the
    scratch, and a ReLU MLP writes the Transformer's output into the live block and clears the scratch.
    The next layer's carry is this one's live block (the swap is absorbed into its weights)."""

    def __init__(self, t: _NormFreeTransformerLayer, d: int, parity: int):
        c, l, s = (slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d))
        if parity:
            c, l = l, c
        D, f = 3 * d, t.W1.shape[0]
        self.scale, self.slopes = t.scale, None
        self.read = torch.zeros(d, D, dtype=torch.float64)
        self.read[:, c] = torch.eye(d, dtype=torch.float64)
        self.Wq, self.Wk, self.Wv = t.Wq @ self.read, t.Wk @ self.read, t.Wv @ self.read
        self.Wo = torch.zeros(D, d, dtype=torch.float64)
        self.Wo[s] = t.Wo
        # MLP(h) = E_l (W2 relu(W1 u)) + relu(A h) - relu(-A h), u = h_c + h_s, A h = (0, u - h_l, -h_s)
        A = torch.zeros(D, D, dtype=torch.float64)
        eye = torch.eye(d, dtype=torch.float64)
        A[l, c], A[l, s], A[l, l], A[s, s] = eye, eye, -eye, -eye
        U = torch.zeros(d, D, dtype=torch.float64)
        U[:, c], U[:, s] = eye, eye
        self.W1 = torch.cat([t.W1 @ U, A, -A])
        self.W2 = torch.zeros(D, f + 2 * D, dtype=torch.float64)
        self.W2[l, :f] = t.W2
        self.W2[:, f:f + D], self.W2[:, f + D:] = torch.eye(D, dtype=torch.float64), -torch.eye(D, dtype=torch.float64)

    def pre(self, x, offset):
        return tuple((x @ W.T)[:, None] for W in (self.Wq, self.Wk, self.Wv))

    def kv(self, z, offset):
        return (z @ self.Wk.T)[:, None], (z @ self.Wv.T)[:, None]

    def post(self, x, a):
        h = x + a[:, 0] @ self.Wo.T
        return h + F.relu(h @ self.W1.T) @ self.W2.T

    def parameters(self):
        return []


def test_theorem_1_a_3x_wider_norm_free_rt_computes_the_transformer():
    d, f, L, N = 5, 7, 3, 11
    gen = torch.Generator().manual_seed(0)
    layers = [_NormFreeTransformerLayer(d, f, gen) for _ in range(L)]
    x = torch.randn(N, d, dtype=torch.float64, generator=gen)
    want = x
    for t in layers:
        want = t(want)
    h = torch.cat([x, torch.zeros(N, 2 * d, dtype=torch.float64)], -1)[None]
    for i, t in enumerate(layers):
        h = rt_prefill(h, _EmulatingRTLayer(t, d, i % 2))
    live = slice(d, 2 * d) if (L - 1) % 2 == 0 else slice(0, d)
    torch.testing.assert_close(h[0, :, live], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(h[0, :, 2 * d:], torch.zeros(N, d, dtype=torch.float64), rtol=0, atol=1e-12)


# -- bad input, a short run --------------------------------------------------------------------------
def test_bad_input_is_refused_with_one_sentence():
    base = ["model.vocab_size=64", "data.train=[]"]
    cases = [
        (["data.seq_len=256"], "data.seq_len 256 exceeds model.max_seq_len 128"),
        (["model.positions=alibi+rope"], "model.positions must be one of alibi, rope (one position scheme"),
        (["parallel.tp=2"], "parallel.tp=2 is not supported (RT's QK-norm normalises over the heads"),
        (["parallel.sp=true", "parallel.tp=2"], "is not supported"),
        (["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"], "parallel.zero_stage=3 is not supported (ZeRO-3"),
        (["model.document_mask=true"], "model.document_mask=true is not supported by RT"),
        (["parallel.recompute=full"], "parallel.recompute=full adds nothing to RT"),
        (["model.leaf_block=3"], "the RT leaf block must be a power of two"),
        (["data.reset_positions=true"], "data.reset_positions=true restarts positions"),
    ]
    for extra, message in cases:
        with pytest.raises((ConfigError, ValueError)) as e:
            load_config("rt/tiny", base + extra, check_data=False)
        assert message in str(e.value) and "\n" not in str(e.value), (extra, str(e.value))
    model = model_of(max_seq_len=8).eval()
    state = model.new_state(1)
    with pytest.raises(ValueError, match="exceed model.max_seq_len 8"):
        model.step(torch.zeros(1, 9, dtype=torch.long), state)


def test_a_short_training_run_falls(tmp_path):
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 40, "train.eval_every": 0, "checkpoint.every": 0,
                                               "optim.lr": 1e-2, "schedule.warmup_steps": 4})
    Trainer(load_config("rt/tiny", over), log=lambda *_: None).fit()
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses


def test_large_tiles_are_computed_in_query_blocks_with_the_same_values_and_gradients(monkeypatch):
    monkeypatch.setattr(tiled, "BLOCK", 4)  # tiles of up to 16 keys and queries split into blocks of 4 queries
    model = model_of()
    N = 33
    x = torch.randn(2, N, 16, dtype=torch.float64, requires_grad=True)
    view, params = layer_of(model, N), list(model.blocks[0].parameters())
    g = torch.randn(2, N, 16, dtype=torch.float64)
    z0 = reference.prefill(x, view)
    want = torch.autograd.grad(z0, [x, *params], g)
    z1 = tiled.prefill(x, view)
    torch.testing.assert_close(z1, z0, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(z1, [x, *params], g), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- the tile as Triton kernels (kernels/rt_prefill/triton_tile.py), run by Triton's interpreter -----------
def _interpreted_triton():
    triton = pytest.importorskip("triton", reason="needs Triton (its interpreter runs the RT tile kernels on a CPU)")
    if not triton.knobs.runtime.interpret:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) on a CPU")
    from kernels.rt_prefill import triton_tile
    return triton_tile


@pytest.mark.parametrize("nq,nk,alibi", [(1, 1, True), (2, 2, False), (16, 16, True), (33, 64, True), (5, 70, False)])
def test_triton_tile_kernels_equal_the_pytorch_tile(nq, nk, alibi):
    triton_tile = _interpreted_triton()
    g = torch.Generator().manual_seed(nq * 100 + nk)
    B, H, D = 2, 3, 16
    qs = torch.randn(B, H, nq, D, generator=g)
    k, v = (torch.randn(B, H, nk, D, generator=g) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125]) if alibi else None
    m0 = torch.randn(B, H, nq, generator=g)
    l0 = torch.rand(B, H, nq, generator=g) + 0.5
    O0 = torch.randn(B, H, nq, D, generator=g)
    want = [m0.clone(), l0.clone(), O0.clone()]
    tiled.update_tile(qs, k, v, *want, slopes, 70, 3)
    got = [m0.clone(), l0.clone(), O0.clone()]
    triton_tile.update_tile(qs, k, v, *got, slopes, 70, 3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    gq, D_, lse = torch.randn(B, H, nq, D, generator=g), torch.randn(B, H, nq, generator=g), want[0] + want[1].log()
    # each adds into accumulators that already hold something, laid out position-major as the backward's
    start = torch.randn(B, nk, H, D, generator=g).transpose(1, 2), torch.randn(B, nk, H, D, generator=g).transpose(1, 2)
    got, want = [a.clone() for a in start], [a.clone() for a in start]
    triton_tile.tile_grads(qs, k, v, gq, D_, lse, slopes, 70, 3, *got)
    tiled.tile_grads(qs, k, v, gq, D_, lse, slopes, 70, 3, *want)
    for a, b, s in zip(got, want, start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.equal(b, s)  # the tile added something


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nk,alibi", [(16, 16, True), (33, 64, True), (5, 70, False)])
def test_triton_tile_products_follow_the_calls_autocast_as_the_pytorch_tiles_do(nq, nk, alibi, low):
    """Under a tiled call's bf16 (fp16) autocast both tiles take both operands of every product in bf16 (fp16;
    tensor cores on a GPU), accumulating in fp32: their errors against fp64 are that dtype's and of one size (the
    Triton tile's scores stay fp32, where the PyTorch tile's 16-bit product rounds them), far above the fp32
    products' error."""
    triton_tile = _interpreted_triton()
    g = torch.Generator().manual_seed(nq * 100 + nk)
    B, H, D = 2, 3, 16
    qs = torch.randn(B, H, nq, D, generator=g)
    k, v = (torch.randn(B, H, nk, D, generator=g).to(low) for _ in range(2))  # as the loop's, under autocast
    slopes = torch.tensor([0.5, 0.25, 0.125]) if alibi else None
    state = torch.randn(B, H, nq, generator=g), torch.rand(B, H, nq, generator=g) + 0.5, torch.randn(B, H, nq, D, generator=g)
    gq, D_ = torch.randn(B, H, nq, D, generator=g), torch.randn(B, H, nq, generator=g)
    acc = torch.randn(B, nk, H, D, generator=g).transpose(1, 2), torch.randn(B, nk, H, D, generator=g).transpose(1, 2)

    def run(tile, products, lse, dtype=None):
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        qkv, upd, grads = [cast(t) for t in (qs, k, v)], [cast(t).clone() for t in state], [cast(t).clone() for t in acc]
        with tiled.products_in(products):
            tile.update_tile(*qkv, *upd, slopes, 70, 3)
            if lse is not None:
                tile.tile_grads(*qkv, cast(gq), cast(D_), cast(lse), slopes, 70, 3, *grads)
        return upd + grads

    # the backward reads the log-sum-exp the forward leaves (fp64's, for every run: only the products differ)
    folded = run(tiled, None, None, torch.float64)
    lse = folded[0] + folded[1].log()
    want = run(tiled, None, lse, torch.float64)
    errors = {name: max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(run(tile, dt, lse.float()), want))
              for name, tile, dt in (("torch 16-bit", tiled, low), ("triton 16-bit", triton_tile, low),
                                     ("triton fp32", triton_tile, None))}
    assert errors["triton fp32"] < 1e-5, errors
    # (here 0.4-0.75x the PyTorch tile's: its fp32 scores; a wrong product is orders of magnitude off, an unrounded
    # operand at fp32's error)
    assert errors["triton 16-bit"] < errors["torch 16-bit"], errors
    assert errors["triton 16-bit"] > 1000 * errors["triton fp32"], errors


@pytest.mark.parametrize("N,leaf,positions", [(17, 1, "alibi"), (37, 16, "alibi"), (33, 4, "rope")])
def test_the_triton_path_runs_the_schedule_and_backward_like_the_tiled_one(N, leaf, positions):
    """Whole layers through the rt_prefill op, forced onto the Triton tile, against the naive loop in
    float64: outputs and every gradient (leaf 16: the fewer-launch variant of spec §3.8)."""
    _interpreted_triton()
    from kernels.rt_prefill import OP

    model = model_of(torch.float32, positions=positions)
    x = torch.randn(2, N, 16, generator=torch.Generator().manual_seed(N), requires_grad=True)
    view = layer_of(model, N)
    params = list(model.blocks[0].parameters())
    g = torch.randn(2, N, 16)
    OP.force("triton")
    try:
        registry.reset_paths_used()
        z = rt_prefill(x, view, leaf)
        got = torch.autograd.grad(z, [x, *params], g)
        assert registry.paths_used()["rt_prefill"] == ["triton"]
    finally:
        OP.force(None)
    model64 = model_of(torch.float64, positions=positions)
    model64.load_state_dict(model.state_dict())
    x64 = x.detach().double().requires_grad_()
    p64 = list(model64.blocks[0].parameters())
    want_z = reference.prefill(x64, layer_of(model64, N))
    want = torch.autograd.grad(want_z, [x64, *p64], g.double())
    torch.testing.assert_close(z.double(), want_z, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_the_triton_path_under_bf16_autocast_errs_as_the_tiled_one():
    """A whole layer under CPU bf16 autocast, forced onto the Triton tile (its products in bf16, as on a GPU's
    training step) and on the PyTorch tile: output and every gradient err against the fp64 loop alike."""
    _interpreted_triton()
    from kernels.rt_prefill import OP

    N = 37
    model = model_of(torch.float32, d_model=32)
    x = torch.randn(2, N, 32, generator=torch.Generator().manual_seed(N))
    g = torch.randn(2, N, 32, generator=torch.Generator().manual_seed(1))
    model64 = model_of(torch.float64, d_model=32)
    model64.load_state_dict(model.state_dict())
    x64 = x.double().requires_grad_()
    want_z = reference.prefill(x64, layer_of(model64, N))
    want = [want_z, *torch.autograd.grad(want_z, [x64, *model64.blocks[0].parameters()], g.double())]
    errors = {}
    for path in ("triton", None):
        OP.force(path)
        try:
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16):
                z = rt_prefill(xi, layer_of(model, N), 1)
            got = [z, *torch.autograd.grad(z, [xi, *model.blocks[0].parameters()], g)]
        finally:
            OP.force(None)
        errors[path] = max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want))
    assert errors["triton"] < 1.5 * errors[None] and errors[None] < 0.05, errors


def _decoded(model, tokens) -> torch.Tensor:
    """Logits of a chunked prefill (5 tokens) then one token at a time."""
    state = model.new_state(tokens.shape[0])
    pieces = [model.step(tokens[:, :5], state)[0]]
    pieces += [model.step(tokens[:, t:t + 1], state)[0] for t in range(5, tokens.shape[1])]
    return torch.cat(pieces, 1)


def test_decode_runs_through_the_rt_decode_op_and_its_triton_path_decodes_alike():
    """Decode goes through the kernel registry ("rt_decode": the tile schedule after the cached prefix), so the
    kernels line names it and a faster path slots in: the Triton tile, forced, gives the tiled path's logits."""
    from kernels.rt_prefill import DECODE

    model = model_of(torch.float32).eval()
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(5))
    registry.reset_paths_used()
    with torch.no_grad():
        want = _decoded(model, tokens)
    assert registry.paths_used()["rt_decode"] == ["tiled"]
    _interpreted_triton()
    DECODE.force("triton")
    try:
        registry.reset_paths_used()
        with torch.no_grad():
            got = _decoded(model, tokens)
        assert registry.paths_used()["rt_decode"] == ["triton"]
    finally:
        DECODE.force(None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_leaves_the_loops_out_and_gives_the_eager_loss_and_gradients():
    """train.compile on RT compiles its read-out and the pieces each position runs (tracing a layer unrolls
    N positions: minutes), so the loops are the eager ones; the pieces are compiled once for every layer and
    position, so the graphs do not grow with depth or steps."""
    from pretrain.data.batch import collate

    tokens = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3)).numpy()
    batch = collate((tokens, tokens * 0), eod_id=None)
    eager, compiled = model_of(dtype=torch.float32), model_of(dtype=torch.float32)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counters outlive dynamo.reset
    compiled.compile()
    results = []
    for m in (eager, compiled, compiled):
        m.zero_grad(set_to_none=True)
        loss, _ = m(batch)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert compiled._compiled_call_impl is None and not any(b._compiled_call_impl for b in compiled.blocks)
    steps = {id(b.steps) for b in compiled.blocks}
    assert len(steps) == 1 and compiled.blocks[0].steps.compiled and len(compiled.blocks) >= 2
    # the read-out and one piece per position each way, for every layer: a graph per layer would outgrow dynamo's
    # cache (8 entries) at 12 layers and run the rest uncompiled
    assert graphs == 3, graphs


def test_the_backward_loop_runs_no_norm_statistics_and_no_alibi_making_per_position():
    """What does not depend on the gradient is out of the tiled loops (on a GPU each position's kernels are
    the layer's cost): doubling N adds no per-position rsqrt (norm statistics) to the backward, and the
    ALiBi biases are made once per tile shape (a few more shapes per doubling), not at every position."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from rt_ops_per_position import count_ops

    (f32, b32), (f64, b64) = count_ops(32), count_ops(64)
    assert b64["rsqrt"] == b32["rsqrt"], (b32["rsqrt"], b64["rsqrt"])
    assert f64["arange"] - f32["arange"] <= 8 and b64["arange"] - b32["arange"] <= 8, (f32, f64, b32, b64)
    assert sum(b64.values()) / 64 < 110, b64  # under bf16 autocast; 160 before the hoisting


def test_tile_products_follow_the_calls_autocast_not_the_keys_dtype():
    """The PyTorch tile casts its products once to the autocast dtype read at the start of the tiled call
    (what autocast did at every product); without autocast, bf16 keys (a bf16 model, an export) are widened to
    the fp32 accumulators as before, so a model run in bf16 keeps fp32 attention products."""
    g = torch.Generator().manual_seed(0)
    qs, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g).bfloat16()
    run = tiled._per_call(lambda x: tiled.scores(x, k, None, 5, 0))
    plain = run(qs)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, qs @ k.float().transpose(-1, -2), rtol=0, atol=0)
    with torch.autocast("cpu", torch.bfloat16):
        cast = run(qs)
    assert cast.dtype == torch.bfloat16
    torch.testing.assert_close(cast, qs.bfloat16() @ k.transpose(-1, -2), rtol=0, atol=0)


def _layer_under_bf16_autocast(blk, cast_once: bool, positions_seen: list | None = None):
    """(z, dx, every parameter's gradient) of one tiled layer under CPU bf16 autocast, its loops reading the
    linear weights cast once (LayerView.in_loop) or, as autocast alone does, at each use."""
    from contextlib import nullcontext

    class Seen(LayerView):  # records the dtype of the weights each per-position call reads
        def in_loop(self, low):
            return super().in_loop(low) if cast_once else nullcontext()

        def position(self, *args):
            if positions_seen is not None:
                positions_seen.append((self.block.ffn.fc1.weight.dtype, self.block.attn.kv.weight.dtype))
            return super().position(*args)

    blk.zero_grad(set_to_none=True)
    x = torch.randn(3, 37, blk.attn.proj.weight.shape[0], generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        z = tiled.prefill(x, Seen(blk, None, 0), 1)
        (z.float() * torch.linspace(-1, 1, z.numel()).view_as(z)).sum().backward()
    return [z.detach(), x.grad, *(p.grad for p in blk.parameters())]


def test_the_loops_read_the_linear_weights_cast_once_and_give_the_same_bits():
    """Under autocast each position's pieces read the block's linear weights already in bf16 (compiled, they
    would cast every weight at every position: inductor keeps no autocast weight cache), and the layer's
    output and every gradient are bitwise those of autocast casting at each use; outside the loops the block
    holds its fp32 Parameters again."""
    blk = model_of(dtype=torch.float32, d_model=32).blocks[0]
    seen: list = []
    once = _layer_under_bf16_autocast(blk, True, seen)
    each = _layer_under_bf16_autocast(blk, False)
    assert len(seen) == 37 and set(seen) == {(torch.bfloat16, torch.bfloat16)}, set(seen)
    assert all(torch.equal(a, b) for a, b in zip(once, each, strict=True))
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in blk.parameters())


class _PiecesApart(LayerView):
    """RT's layer without its one-piece positions: the tiled loops call post, kv and their vjps apart."""
    position = position_grad = None


@pytest.mark.parametrize("positions", ["alibi", "rope"])
def test_one_piece_positions_give_the_bits_of_the_pieces_apart(positions):
    """The loops' one call per position (LayerView.position, position_grad: compiled as one piece each, so
    that their writes fuse) runs the operations of post, kv and their vjps apart, in their order: the layer's
    output and every gradient are bitwise equal, in fp64 and under CPU bf16 autocast."""
    for dtype, amp in ((torch.float64, False), (torch.float32, True)):
        model = model_of(dtype=dtype, d_model=32, positions=positions)
        view = layer_of(model, 37)
        runs = []
        for cls in (LayerView, _PiecesApart):
            model.zero_grad(set_to_none=True)
            x = torch.randn(3, 37, 32, generator=torch.Generator().manual_seed(1), dtype=dtype, requires_grad=True)
            with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                z = tiled.prefill(x, cls(view.block, view.rope, 0), 1)
                (z.float() * torch.linspace(-1, 1, z.numel()).view_as(z)).sum().backward()
            runs.append([z.detach(), x.grad, *(p.grad for p in view.block.parameters())])
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), (dtype, amp)


class _AutogradPhase2(LayerView):
    """RT's layer with phase 2 through autograd: pre's, kv's and post's graphs built again over all positions."""
    pre_grads = weight_grads = None


@pytest.mark.parametrize("positions,qk_norm", [("alibi", "full"), ("rope", "head")])
def test_the_hand_written_phase_2_runs_a_bf16_model_as_autograd_does(positions, qk_norm):
    """The layer's own pre_grads and weight_grads on a model whose weights are bf16, without autocast (a
    Hugging Face user's torch_dtype=bfloat16): every gradient within bf16 rounding of autograd's phase 2."""
    model = model_of(dtype=torch.bfloat16, d_model=32, positions=positions, qk_norm=qk_norm)
    view = layer_of(model, 33)
    runs = []
    for cls in (LayerView, _AutogradPhase2):
        model.zero_grad(set_to_none=True)
        x = torch.randn(2, 33, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
        z = tiled.prefill(x, cls(view.block, view.rope, 0), 1)
        (z.float() * torch.linspace(-1, 1, z.numel()).view_as(z)).sum().backward()
        runs.append([x.grad, *(p.grad for p in view.block.parameters())])
    for name, a, b in zip(["x", *(n for n, _ in view.block.named_parameters())], *runs, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert (a.float() - b.float()).norm() <= 0.02 * b.float().norm(), name


@pytest.mark.slow  # compiles the per-position pieces twice (weights fp32 and bf16): ~20 s on 2 cores
def test_the_compiled_pieces_reading_weights_cast_once_give_the_same_bits():
    from pretrain.models.rt import Steps

    blk = model_of(dtype=torch.float32, d_model=32).blocks[0]
    blk.steps = Steps(compile=True)
    torch._dynamo.reset()
    once = _layer_under_bf16_autocast(blk, True)
    each = _layer_under_bf16_autocast(blk, False)
    assert all(torch.equal(a, b) for a, b in zip(once, each, strict=True))
