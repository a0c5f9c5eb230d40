"""GPN and GPN+M (spec-002) against its §6 checks: an independent naive loop written from §2.10 (the
code's indexing, fuse and decode inside the loop, no folded norms), segment recomputation, state carry
and streaming, the position-0 invariant, init and counts, the memory rule's three forms and its
chunked form, truncated BPTT, gradcheck, bf16, document resets, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels.delta_memory import chunked, delta_memory, reference
from pretrain.config import load_config
from pretrain.data.batch import collate
from pretrain.models import count_parameters, get_arch
from pretrain.models.gpn import GPN, GPNConfig, parameter_counts

V = 97
SPEC = get_arch("gpn")


def cfg_of(**kw) -> GPNConfig:
    values = dict(vocab_size=V, d_emb=16, d_state=32, d_ffn=64, mem_heads=4, d_key=8, d_value=16, n_layers=1)
    values.update(kw)
    return GPNConfig(**values)


def model_of(dtype=torch.float64, seed=0, perturb=0.1, **kw) -> GPN:
    """A model whose zero-initialised matrices and biases are perturbed (at init the FFN and gates say nothing)."""
    torch.manual_seed(seed)
    model = GPN(cfg_of(**kw)).to(dtype)
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * perturb)
    return model


def batch_of(B=2, T=21, seed=1, docs=None):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, V, (B, T + 1), generator=g).numpy()
    doc = raw * 0 if docs is None else docs
    return collate((raw, doc), eod_id=None)


# -- the naive loop of spec §2.10 (written from the spec, not from the model) --------------------------
def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2n(x):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)


def naive_logits(m: GPN, x: torch.Tensor, tbptt: int = 0) -> torch.Tensor:
    """The code's window (§2.2): logits[t] = Decode(s^p_t) predicts x[t] from x[:t], t = 0 from zeros.
    `tbptt` K: spec A10, the carried state (s^g, s^g_prev, M) detached at the step boundaries t = K, 2K, ..."""
    c = m.cfg
    B, T = x.shape
    H, dk, dv = c.mem_heads, c.d_key, c.d_value
    dt = m.fuse.weight.dtype
    sg = sgp = torch.zeros(B, c.d_state, dtype=dt)
    M = torch.zeros(B, H, dk, dv, dtype=dt)
    out = []
    emb = m.embed.weight
    for t in range(T):
        if tbptt and t and t % tbptt == 0:
            sg, sgp, M = sg.detach(), sgp.detach(), M.detach()
        if H:
            w = m.write
            u, um = rms(sg, w.norm.weight), rms(sgp, w.norm.weight)
            k = l2n(F.relu(um @ w.k.weight.T + w.k.bias).view(B, H, dk))
            v = (u @ w.v.weight.T).view(B, H, dv)
            beta = torch.sigmoid(u @ w.beta.weight.T)
            alpha = torch.exp(-w.A_log.exp() * F.softplus(u @ w.a.weight.T + w.dt_bias))
            erase = torch.einsum("bhkv,bhk->bhv", M, k)
            M = alpha[..., None, None] * M + beta[..., None, None] * k[..., :, None] * (v - erase)[..., None, :]
        s = sg
        for L in m.layers:
            a, b = (rms(s, L.ffn_norm.weight) @ L.w1.weight.T).chunk(2, -1)
            new = torch.sigmoid(rms(s, L.gate.norm.weight) @ L.gate.proj.weight.T + L.gate.proj.bias) * s \
                + (F.silu(a) * b) @ L.w2.weight.T
            if H:
                y = rms(s, L.read_norm.weight)
                q = l2n(F.relu(y @ L.q.weight.T + L.q.bias).view(B, H, dk))
                o = torch.einsum("bhkv,bhk->bhv", M, q).flatten(1)
                new = new + (F.silu(y @ L.rg.weight.T) * rms(o, L.out_norm.weight)) @ L.o.weight.T
            s = new
        h = rms(s, m.dec_norm.weight) @ m.dproj.weight.T
        if m.dec_bias is not None:
            h = h + m.dec_bias
        out.append(h @ emb.T)
        g = torch.sigmoid(rms(s, m.fuse_gate.norm.weight) @ m.fuse_gate.proj.weight.T + m.fuse_gate.proj.bias)
        sgp, sg = sg, g * s + rms(emb[x[:, t]], m.fuse_norm.weight) @ m.fuse.weight.T
    return torch.stack(out, 1)


def model_logits_uniform(m: GPN, x):
    """The model's predictions in the code's window: zeros, then after each of x[:, :-1]."""
    sp, _ = m.states(x[:, :-1])
    sp = torch.cat([torch.zeros_like(sp[:, :1]), sp], 1)
    return m.head.logits(m.decode(sp))


# -- T1: hoisted == naive -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"n_layers": 2}, {"mem_heads": 0, "d_key": 8}, {"decoder_bias": True}])
def test_hoisted_equals_the_naive_loop_in_logits_and_gradients(kw):
    m = model_of(**kw)
    x = batch_of().tokens
    want = naive_logits(m, x)
    got = model_logits_uniform(m, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    grads = []
    for fn in (naive_logits, model_logits_uniform):
        m.zero_grad()
        (fn(m, x).square().mean()).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for (name, _), a, b in zip(m.named_parameters(), *grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


def test_hoisted_equals_naive_in_float32_at_the_spec_init():
    """Spec §8.1: fp32 with the spec's own init (not a full-scale random one) within 1e-5."""
    m = model_of(torch.float32, perturb=0.0)
    x = batch_of().tokens
    torch.testing.assert_close(model_logits_uniform(m, x), naive_logits(m, x), rtol=0, atol=1e-5)


# -- T2: segment recomputation ---------------------------------------------------------------------------
def _loss_and_grads(m, batch):
    m.zero_grad()
    loss, _ = m(batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("segment", [1, 4, 5, 8, 21])
def test_segment_recomputation_changes_nothing(segment):
    batch = batch_of()
    m = model_of(n_layers=2)
    ref = _loss_and_grads(m, batch)
    m.cfg.segment = segment
    m.segment_recompute = True
    got = _loss_and_grads(m, batch)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_recompute_policy_configures_the_model_and_keeps_one_node_per_segment():
    """parallel.recompute=full turns segment recomputation on; the autograd graph then grows by a few
    nodes per segment of S steps, not by every op of every step (what a per-step graph, or a checkpoint
    that keeps a holder per saved tensor, would keep for the whole window)."""
    m = model_of()
    SPEC.recompute_policies()["full"].apply(m)
    assert m.segment_recompute

    def nodes(T):
        m.cfg.segment = 4
        loss, _ = m(batch_of(T=T))
        seen, todo = set(), [loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.extend(f for f, _ in fn.next_functions)
        return len(seen)

    m.segment_recompute = False
    plain = nodes(64) - nodes(32)
    m.segment_recompute = True
    recomputed = nodes(64) - nodes(32)
    assert recomputed <= 4 * (32 // 4), (recomputed, plain)  # a few per extra segment
    assert plain > 20 * 32, plain  # tens of nodes per extra step without


# -- T3: state carry and streaming -------------------------------------------------------------------------
def test_state_carries_across_window_halves_and_streaming_equals_the_window():
    m = model_of(n_layers=2).eval()
    x = batch_of(T=20).tokens
    with torch.no_grad():
        full = m.logits(x)
        first, state = m.step(x[:, :9], m.new_state(2))
        second, state = m.step(x[:, 9:], state)
        torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=0, atol=1e-12)
        state, pieces = m.new_state(2), []
        for t in range(x.shape[1]):
            logits, state = m.step(x[:, t:t + 1], state)
            pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-12)


# -- T4: position 0 ----------------------------------------------------------------------------------------
def test_position_zero_is_uniform_in_the_papers_window():
    m = model_of(position0="uniform")  # every bias perturbed: b_k, b_q, b_pg, b_fg nonzero
    batch = batch_of()
    logits = model_logits_uniform(m, batch.tokens)
    assert logits[:, 0].abs().max().item() == 0.0
    ce0 = F.cross_entropy(logits[:, 0], batch.tokens[:, 0])
    assert ce0.item() == pytest.approx(math.log(V), abs=1e-12)
    mb = model_of(position0="uniform", decoder_bias=True)
    torch.testing.assert_close(model_logits_uniform(mb, batch.tokens)[:, 0],
                               (mb.dec_bias @ mb.embed.weight.T).expand(2, V), rtol=0, atol=1e-12)


def test_the_two_position0_conventions_train_on_their_targets():
    batch = batch_of()
    m = model_of()
    ctx_loss, _ = m(batch)
    want = F.cross_entropy(m.logits(batch.tokens).flatten(0, 1), batch.labels.flatten())
    torch.testing.assert_close(ctx_loss, want, rtol=0, atol=1e-12)
    m.cfg.position0 = "uniform"
    uni_loss, _ = m(batch)
    want = F.cross_entropy(naive_logits(m, batch.tokens).flatten(0, 1), batch.tokens.flatten())
    torch.testing.assert_close(uni_loss, want, rtol=0, atol=1e-10)


# -- T5: init and counts -------------------------------------------------------------------------------
def test_init_invariants():
    m = model_of(perturb=0.0)
    layer = m.layers[0]
    s = torch.randn(3, 32, dtype=torch.float64)
    assert layer.w2(torch.randn(3, 64, dtype=torch.float64)).abs().max() == 0  # the FFN outputs 0
    assert torch.equal(torch.sigmoid(layer.gate.proj(s)), torch.full_like(s, 0.5))
    assert torch.equal(torch.sigmoid(m.fuse_gate.proj(s)), torch.full_like(s, 0.5))
    alpha = torch.exp(-m.write.A_log.exp() * F.softplus(m.write.dt_bias))
    assert ((alpha > 0) & (alpha < 1)).all()
    state = m.iterate(m.new_state(3), torch.zeros(3, 32, dtype=torch.float64), m.folded())
    assert state[1].abs().max() == 0  # M stays 0 at the first step (v = W_v rms(0) = 0)


@pytest.mark.parametrize("kw,total,loop,state", [
    ({}, 129_151_902, 100_738_782, 496_512),  # spec §2.12: s^g_t and s^g_(t-1) (2 d) and M
    ({"n_layers": 2, "d_state": 1920, "d_ffn": 4864, "mem_heads": 11}, 129_837_206, None, None),
    ({"mem_heads": 0, "d_state": 3184, "d_ffn": 8400}, 129_999_008, None, 3184)])
def test_parameter_counts_of_the_papers_configs(kw, total, loop, state):
    cfg = GPNConfig(**kw)
    with torch.device("meta"):
        m = GPN(cfg)
    n = parameter_counts(cfg)
    assert count_parameters(m)["total"] == n["total"] == total
    if loop is not None:
        assert n["loop"] == loop  # spec §2.9, as corrected on review
        assert n["memory_cells"] == 491_520
    if state is not None:
        assert n["state_numbers"] == state == sum(t[0].numel() for t in m.new_state(1))


# -- T6: the memory rule ---------------------------------------------------------------------------------
def _memory_inputs(B=2, T=50, H=3, dk=5, dv=4, seed=0, fast=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = l2n(F.relu(r(B, T, H, dk)))
    q = l2n(F.relu(r(B, T, H, dk)))
    v = r(B, T, H, dv)
    beta = torch.sigmoid(r(B, T, H))
    alpha = torch.sigmoid(r(B, T, H) + 2)
    if fast:
        alpha = alpha.clone()
        alpha[:, :, 0] = 1e-8  # a fast head: e^{-18} per step
    return q, k, v, beta, alpha


def test_the_three_forms_of_the_memory_rule_agree_and_contract():
    q, k, v, beta, alpha = _memory_inputs()
    B, T, H, dk = k.shape
    M1 = M2 = M3 = torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for t in range(T):
        kt, vt, bt, at = k[:, t], v[:, t], beta[:, t], alpha[:, t]
        M1 = reference.write(M1, kt, vt, bt, at)
        kk = kt[..., :, None] * kt[..., None, :]
        trans = at[..., None, None] * eye - bt[..., None, None] * kk  # (alpha I - beta k k^T)
        M2 = trans @ M2 + bt[..., None, None] * kt[..., :, None] * vt[..., None, :]
        bp, vp = bt / at, at[..., None] * vt  # the GDN form with beta / alpha, alpha v
        M3 = at[..., None, None] * (eye - bp[..., None, None] * kk) @ M3 + bp[..., None, None] * kt[..., :, None] * vp[..., None, :]
        bound = torch.maximum(at, (at - bt).abs())
        norm = torch.linalg.matrix_norm(trans, ord=2)
        assert (norm <= bound + 1e-12).all()
    torch.testing.assert_close(M2, M1, rtol=0, atol=1e-13)
    torch.testing.assert_close(M3, M1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [4, 8, 16, 7])
@pytest.mark.parametrize("fast", [False, True])
def test_chunked_memory_reads_equal_the_recurrence(chunk, fast):
    q, k, v, beta, alpha = _memory_inputs(fast=fast)
    M0 = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_o, ref_M = reference.recurrence(q, k, v, beta, alpha, M0)
    o, M = chunked.recurrence(q, k, v, beta, alpha, M0, chunk=chunk)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-10)
    torch.testing.assert_close(M, ref_M, rtol=0, atol=1e-10)
    o2, _ = delta_memory(q, k, v, beta, alpha, M0, chunk=chunk)  # the registered op picks the chunked path
    torch.testing.assert_close(o2, o, rtol=0, atol=0)


def test_the_time_loop_runs_the_memory_through_the_kernel_registry():
    """The model's step calls the registered ops (the kernels line names them, and a fused kernel registers as a
    path): the write-and-first-read op equals write then read, and every read of a two-layer model goes through
    delta_memory_read."""
    from kernels import registry
    from kernels.delta_memory import memory_read, memory_step

    q, k, v, beta, alpha = _memory_inputs(B=2, T=1, H=3, dk=5, dv=4)
    M0 = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    M, o = memory_step(M0, k[:, 0], v[:, 0], beta[:, 0], alpha[:, 0], q[:, 0])
    want = reference.write(M0, k[:, 0], v[:, 0], beta[:, 0], alpha[:, 0])
    assert torch.equal(M, want) and torch.equal(o, reference.read(want, q[:, 0]))
    assert torch.equal(memory_read(M, q[:, 0]), o)
    model = model_of(n_layers=2)
    registry.reset_paths_used()
    with torch.no_grad():
        model.logits(torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1)))
    used = registry.paths_used()
    assert used["delta_memory_step"] == ["reference"] and used["delta_memory_read"] == ["reference"]


# -- T7: truncated BPTT ----------------------------------------------------------------------------------
def test_truncated_bptt_semantics():
    """The loss equals full BPTT's; a later truncation window's loss sends no gradient to the tokens of
    an earlier one (the carried state is detached, spec §8.2); the summed gradient differs."""
    T, K = 32, 8
    batch = batch_of(T=T)
    full = model_of(segment=4)
    trunc = model_of(segment=4, tbptt=K)
    l_full, g_full = _loss_and_grads(full, batch)
    l_trunc, g_trunc = _loss_and_grads(trunc, batch)
    torch.testing.assert_close(l_trunc, l_full, rtol=0, atol=1e-12)
    assert any((a - b).abs().max() > 1e-8 for a, b in zip(g_trunc, g_full))
    # d(loss of window 3) / d(fused inputs G of windows 0-2) is exactly 0
    G = trunc.fuse(trunc.fuse_norm(trunc.embed(batch.tokens))).detach().requires_grad_()
    trunc.fuse = _Given(G, trunc.fuse.weight)
    sp, _ = trunc.states(batch.tokens)
    late = F.cross_entropy(trunc.head.logits(trunc.decode(sp[:, 3 * K:])).flatten(0, 1), batch.labels[:, 3 * K:].flatten())
    (grad,) = torch.autograd.grad(late, G, retain_graph=True)
    assert grad[:, :3 * K].abs().max().item() == 0.0
    assert grad[:, 3 * K:].abs().max().item() > 0.0
    # the token grounded at each cut (the (mK)-th) reaches the loss only after the cut: no gradient at all
    whole = F.cross_entropy(trunc.head.logits(trunc.decode(sp)).flatten(0, 1), batch.labels.flatten())
    (grad,) = torch.autograd.grad(whole, G)
    at_cut = grad.abs().amax((0, 2))
    assert at_cut[K - 1::K].max().item() == 0.0 and at_cut[K - 1::K].numel() == T // K
    assert at_cut[[t for t in range(T) if (t + 1) % K]].min().item() > 0.0


@pytest.mark.parametrize("kw", [{}, {"n_layers": 2}, {"mem_heads": 0, "d_key": 8}])
@pytest.mark.parametrize("segment,recompute", [(4, False), (5, True), (0, True)])
def test_truncated_bptt_gradients_equal_spec_a10(kw, segment, recompute):
    """Spec A10 and §8.2, from §2.10's loop: the carried state (s^g, s^g_prev, M) detached at the step
    boundaries K, 2K, ... of the code's window (between Ground and Write). position0=uniform is that window;
    position0=context is the window of T + 1 tokens without its first (uniform) prediction. Every gradient
    equal in float64, with and without segment recomputation, at segments that do not align with K."""
    K, batch = 6, batch_of(T=21)
    window = torch.cat([batch.tokens, batch.labels[:, -1:]], 1)
    for position0 in ("uniform", "context"):
        m = model_of(tbptt=K, segment=segment, position0=position0, **kw)
        m.segment_recompute = recompute
        grads = []
        for run in ("model", "spec", "full BPTT"):
            m.zero_grad()
            if run == "model":
                loss, _ = m(batch)
            elif position0 == "uniform":
                loss = F.cross_entropy(naive_logits(m, batch.tokens, K if run == "spec" else 0).flatten(0, 1),
                                       batch.tokens.flatten())
            else:
                logits = naive_logits(m, window, K if run == "spec" else 0)[:, 1:]
                loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
            loss.backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for (name, _), got, want in zip(m.named_parameters(), grads[0], grads[1]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{position0}: {name}")
        assert max((a - b).abs().max().item() for a, b in zip(grads[1], grads[2])) > 1e-4  # truncation matters


class _Given(torch.nn.Module):
    """Stands in for the fuse projection: returns a given G (so the test can differentiate by it)."""

    def __init__(self, G, weight):
        super().__init__()
        self.G, self.weight = G, weight  # the weight: what new_state reads the device and dtype from

    def forward(self, _):
        return self.G


# -- T8: gradcheck --------------------------------------------------------------------------------------
def test_gradcheck_of_the_step_and_the_memory_ops():
    m = model_of(d_state=8, d_emb=4, d_ffn=6, mem_heads=2, d_key=3, d_value=2)
    W = m.folded()
    g = torch.Generator().manual_seed(5)
    hg_prev, M, sp = (torch.randn(2, 8, dtype=torch.float64, generator=g), torch.randn(2, 2, 3, 2, dtype=torch.float64,
                      generator=g), torch.randn(2, 8, dtype=torch.float64, generator=g))
    x = torch.randn(2, 8, dtype=torch.float64, generator=g)
    inputs = [t.requires_grad_() for t in (hg_prev, M, sp, x)]
    assert torch.autograd.gradcheck(lambda a, b, c, d: tuple(m.iterate([a, b, c], d, W)), inputs)
    q, k, v, beta, alpha = (t[:1, :1].clone().requires_grad_() for t in _memory_inputs(B=1, T=1, H=2, dk=3, dv=2))
    M0 = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: reference.write(*a), (M0, k[:, 0], v[:, 0], beta[:, 0], alpha[:, 0]))
    assert torch.autograd.gradcheck(lambda a, b: reference.read(a, b), (M0, q[:, 0]))


# -- T12: bf16 ---------------------------------------------------------------------------------------------
def test_bf16_autocast_keeps_the_state_in_fp32_within_tolerance():
    m = model_of(torch.float32, perturb=0.0)
    batch = batch_of(T=24)
    ref, _ = m(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = m(batch)
        sp, state = m.states(batch.tokens)
    assert sp.dtype == torch.float32 and state[1].dtype == torch.float32
    assert abs(got.item() - ref.item()) / ref.item() < 1e-2


# -- document resets ---------------------------------------------------------------------------------------
def test_a_reset_at_a_document_start_is_a_window_start():
    """With reset_at_documents, the second document's predictions are the model's on it alone."""
    docs = torch.zeros(2, 22, dtype=torch.int64).numpy()
    docs[:, 9:] = 1
    batch = batch_of(T=21, docs=docs)
    for position0 in ("context", "uniform"):
        m = model_of(reset_at_documents=True, position0=position0)
        packed, _ = m.states(batch.tokens, batch.doc_ids)
        alone, _ = m.states(batch.tokens[:, 9:])
        torch.testing.assert_close(packed[:, 9:], alone, rtol=0, atol=1e-12)
        m.cfg.reset_at_documents = False
        carried, _ = m.states(batch.tokens, batch.doc_ids)
        assert (carried[:, 9:] - alone).abs().max() > 1e-6  # the default carries the state across (A9)
    m = model_of(reset_at_documents=True, position0="uniform")
    loss, _ = m(batch)
    logits = torch.cat([naive_logits(m, batch.tokens[:, :9]), naive_logits(m, batch.tokens[:, 9:])], 1)
    per = F.cross_entropy(logits.flatten(0, 1), batch.tokens.flatten(), reduction="none").view(2, 21)
    per[:, 9] = 0  # the data masks a target that crosses a document end: here the second document's first
    torch.testing.assert_close(loss, per.sum() / (per.numel() - 2), rtol=0, atol=1e-10)


# -- diagnostics, training, bad input ---------------------------------------------------------------------
def test_diagnostics_and_a_short_run_where_the_loss_falls():
    torch.manual_seed(0)
    m = GPN(cfg_of(vocab_size=16, d_state=32))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 16, (8,), generator=g)
    raw = pattern.repeat(4, 5)[:, :33].numpy()  # a repeating sequence: learnable through the state
    batch = collate((raw, raw * 0), eod_id=None)
    losses = []
    for _ in range(40):
        loss, diag = m(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert set(diag) >= {"mem_effect", "mem_cos", "state_norm", "mem_norm", "fuse_gate", "predict_gate", "alpha"}
    assert diag["mem_effect"] > 0


@pytest.mark.parametrize("kw,match", [
    ({"mem_heads": -1}, "mem_heads"), ({"mem_heads": 0, "n_layers": 2}, "bare GPN"),
    ({"position0": "first"}, "position0"), ({"segment": -1}, "segment"), ({"tbptt": -2}, "tbptt"),
    ({"d_state": 0}, "d_state"),
    ({"reset_at_documents": True, "eos_id": V}, f"model.eos_id {V} must be a token id below model.vocab_size {V}")])
def test_bad_model_fields_are_one_sentence(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg_of(**kw).validate()


def test_segment_or_truncation_longer_than_the_window_is_refused_before_any_work():
    for field in ("segment", "tbptt"):
        with pytest.raises(ValueError, match=f"model.{field}=300 is longer than the window"):
            load_config("gpn/tiny", [f"model.{field}=300", "data.seq_len=128"], check_data=False)
    with pytest.raises(ValueError, match="parallel.tp=2 is not supported"):
        load_config("gpn/tiny", ["parallel.tp=2"], check_data=False)


# -- T9: the recipe's schedule ---------------------------------------------------------------------------
def test_the_papers_schedule_and_decay_mask():
    from pretrain.optim import lr_at, param_groups

    cfg = load_config("gpn/gpn-m-130m", [], check_data=False)
    lr = lambda step: lr_at(step, cfg.train.max_steps, cfg.optim, cfg.schedule)  # noqa: E731
    assert lr(0) == 0.0
    assert lr(50) == pytest.approx(3e-4, rel=1e-12) and lr(100) == pytest.approx(6e-4, rel=1e-12)
    assert lr(10_000) == pytest.approx(6e-5, rel=1e-12)
    m = model_of(torch.float32, perturb=0.0)
    groups = param_groups(m, cfg.optim.weight_decay, cfg.optim.decay_all)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in m.named_parameters():  # matrices decay; norms, biases, A_log and dt_bias do not
        assert (id(p) in decayed) == (p.ndim >= 2), name


# -- T10: associative recall ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_associative_recall_gpn_m_far_above_bare_gpn():
    """Spec T10: 8 pairs then 16 queries, V=64, T=48, d=64, 4 heads of 16 x 16, batch 32, AdamW 3e-3, 500
    steps: the memory's query accuracy is far above bare GPN's at the same width, and the memory is used."""
    from pretrain.tasks import TaskCollator, TaskDataset
    from pretrain.tasks.associative_recall import AssociativeRecallConfig

    params = AssociativeRecallConfig()
    train, held = TaskDataset("associative_recall", params, 0), TaskDataset("associative_recall", params, None)
    collate_ = TaskCollator()
    valid = collate_(held.get_many(range(256)))
    acc = {}
    for name, heads in (("gpn+m", 4), ("gpn", 0)):
        torch.manual_seed(0)
        m = GPN(GPNConfig(vocab_size=64, d_emb=32, d_state=64, d_ffn=128, mem_heads=heads, d_key=16, d_value=16))
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        for step in range(500):
            loss, diag = m(collate_(train.get_many(range(32 * step, 32 * step + 32))))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        with torch.no_grad():
            pred = m.logits(valid.tokens).argmax(-1)
        acc[name] = (pred == valid.labels)[valid.loss_mask].float().mean().item()
        if heads:
            assert diag["mem_effect"] > 0
    assert acc["gpn+m"] > acc["gpn"] + 0.3, acc


@pytest.mark.parametrize("kw", [{}, {"d_state": 64}, {"mem_heads": 8}, {"n_layers": 2}, {"mem_heads": 0}])
def test_the_activation_estimate_follows_what_autograd_keeps(kw):
    """pretrain info's BPTT estimate (bptt_bytes) against the bytes autograd saves per step."""
    from pretrain.models.gpn import bptt_bytes

    m = model_of(torch.float32, perturb=0.0, **kw)

    def saved(T):
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            m(batch_of(B=1, T=T))
        return sum(storages.values())

    per_step = (saved(40) - saved(20)) / 20
    estimate = bptt_bytes(m.cfg, 1, 1, "none")
    assert 0.8 < estimate / per_step < 1.25, (estimate, per_step)


@pytest.mark.slow
def test_compiling_the_step_keeps_the_loss_and_gradients():
    """train.compile compiles the step only (GPN.compile): the same loss and gradients as eager, with
    segment recomputation (the no-grad forward and the recomputing backward each run the compiled step)."""
    batch = batch_of(T=24)
    eager = model_of(torch.float32, segment=5)
    eager.segment_recompute = True
    compiled = model_of(torch.float32, segment=5)
    compiled.segment_recompute = True
    compiled.compile(dynamic=False)
    (l1, g1), (l2, g2) = _loss_and_grads(eager, batch), _loss_and_grads(compiled, batch)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_compiled_step_has_one_graph_for_the_forward_and_one_for_the_recompute():
    """Each graph of the compiled step is a compile on the device's host (seconds to a minute): the no-grad
    forward, evaluation and the captured segments share one, and every recomputing segment (the first one,
    whose start state needs no gradient, and a shorter last one) the other. Guards on requires_grad, a
    Parameter passed through, the step input's strides or its storage offset would each add one."""
    from torch._dynamo.utils import counters

    from kernels import captured

    model = model_of(torch.float32, segment=6)
    model.segment_recompute = True
    model.compile(backend="aot_eager")  # guards are dynamo's, whatever the backend
    batch = batch_of(T=27)  # segments of 6, 6, 6, 6 and 3 steps
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        _loss_and_grads(model, batch)
    with torch.no_grad():
        model(batch)
    captured.reset(captured.Emulated())  # the segments' bodies as captured regions read static buffers
    try:
        with captured.step("on", log=lambda *_: None):
            _loss_and_grads(model, batch)
        assert captured._state.replays > 0
    finally:
        captured.reset(captured.CudaGraphs())
    assert counters["stats"]["unique_graphs"] - before == 2


def test_evaluation_after_an_optimizer_step_sees_the_new_weights():
    """The folded matrices kept for forwards without autograd are rebuilt after training steps, also
    under a fused AdamW (which does not bump the parameters' version counters)."""
    m = model_of(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    x = batch_of().tokens
    with torch.no_grad():
        before = m.logits(x)
    for _ in range(2):
        loss, _ = m(batch_of())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = m.logits(x)
        fresh = model_of(torch.float32)
        fresh.load_state_dict(m.state_dict())
        torch.testing.assert_close(after, fresh.logits(x), rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-4


def test_every_step_reads_the_loop_matrices_cast_once_and_segments_form_their_gradients(monkeypatch):
    """Under autocast every step reads the loop's matrices cast once to bf16 (compiled, a step would cast them
    at every step: inductor keeps no autocast weight cache): a segment's forward, evaluation and a segment's
    backward, whose steps are tapped (_product) and which forms each matrix's gradient over all its steps in
    one product. The loss and the evaluation loss are bitwise those of casting at each use; every gradient is
    as near the fp32 one as the window differentiated step by step (parallel.recompute=none), which casts at
    each use and sums each step's gradient of each matrix in fp32 (in fp64 the two agree to 1e-12:
    test_segment_recomputation_changes_nothing)."""
    from pretrain.models import gpn

    def trained(cast=True, segments=True, autocast=True, seen=None):
        model = model_of(dtype=torch.float32)
        if segments:
            SPEC.recompute_policies()["full"].apply(model)
        step = GPN.iterate

        def iterate(self, state, g, W, probe=None, cut=False, taps=None):
            if seen is not None and probe is None:
                seen.append((torch.is_grad_enabled(), W.first[0].dtype, W.neg_A.dtype, tuple(sorted(taps or ()))))
            return step(self, state, g, W, probe, cut, taps)

        monkeypatch.setattr(model, "iterate", iterate.__get__(model))
        if not cast:
            monkeypatch.setattr(gpn.Folded, "cast_for_loop", lambda self, like: self)
        batch = batch_of(B=3, T=40)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(batch)[0]
            loss.backward()
            with torch.no_grad():
                evaluated = model(batch)[0]
        monkeypatch.undo()
        return [loss.detach(), evaluated], [p.grad for p in model.parameters()]

    seen: list = []
    (once, grads), (each, _) = trained(seen=seen), trained(cast=False)
    tapped = ("down0", "first", "fuse_gate", "key", "out0")
    assert set(seen) == {(False, torch.bfloat16, torch.float32, ()), (True, torch.bfloat16, torch.float32, tapped)}
    assert len(seen) == 3 * 40  # the forward's segments, their recomputation, the evaluation
    assert all(torch.equal(a, b) for a, b in zip(once, each, strict=True))
    (_, fp32), (_, step_by_step) = trained(autocast=False), trained(segments=False)
    for (name, _), got, per_step, want in zip(model_of().named_parameters(), grads, step_by_step, fp32, strict=True):
        err, err_per_step = ((g - want).norm() / want.norm() for g in (got, per_step))
        assert err <= 1.5 * err_per_step + 1e-3, (name, err.item(), err_per_step.item())
        # the two share the forward's rounding (most of their distance from fp32); apart, within 0.7% here
        assert (got - per_step).norm() <= 0.02 * per_step.norm(), name