"""CART's own mechanism (spec-004 §6 and §8): parameter accounting, the anchor's K/V computed once,
causality of the core's cross-attention (and the leak without it), the gate, the growth of the
reference update against the paper's, the HyperConnection's start, variable R, checkpointing and
shared-weight gradients, every ablation, decode against the full forward, bad input.

Tiny config of spec §6: d=64 (one 64-wide head), P=2, R=4, V=256, T=32.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import full
from pretrain.config import ConfigError, load_config
from pretrain.models import count_parameters, get_arch
from pretrain.models.baseline import BaselineConfig, TransformerPP
from pretrain.models.cart import CART, CARTConfig, CoreBlock, loop_embedding, parameter_counts

V = 256
ABLATIONS = [{}, {"dense": True}, {"core_update": "paper"}, {"unfreeze_kv": True}, {"unshare_core": True},
             {"unshare_core": True, "self_attn_core": True}, {"disable_hyper": True}, {"disable_lti": True},
             {"disable_lie": True}, {"n_loops": 1}]


def cfg_of(**kw) -> CARTConfig:
    values = dict(vocab_size=V, d_model=64, n_heads=1, n_layers=2, n_loops=4, max_seq_len=64)
    values.update(kw)
    return CARTConfig(**values)


def model_of(dtype=torch.float64, seed=0, **kw) -> CART:
    torch.manual_seed(seed)
    return CART(cfg_of(**kw)).to(dtype).eval()


def tokens_of(B=2, T=32, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_parameter_accounting_of_spec_section_2_10_and_2_11():
    table = {(256, 6): (14_365_187, 17_972_227), (512, 6): (41_051_139, 55_474_179), (768, 6): (75_339_267, 104_838_147),
             (1024, 6): (125_093_891, 178_843_651), (1024, 8): (125_093_891, 200_343_555),
             (1024, 10): (125_093_891, 221_843_459), (256, 10): (14_365_187, 20_857_859),
             (512, 10): (41_051_139, 67_012_611), (768, 10): (75_339_267, 128_437_251)}
    for (d, R), (stored, effective) in table.items():
        cfg = CARTConfig(d_model=d, n_heads=d // 64, n_loops=R)
        with torch.device("meta"):
            assert count_parameters(CART(cfg))["total"] == stored == parameter_counts(cfg)["stored"]
        assert parameter_counts(cfg)["effective"] == effective
    for kw, stored in (({"unshare_core": True}, 178_843_651), ({"unshare_core": True, "self_attn_core": True}, 182_775_811),
                       ({"n_loops": 1}, 125_093_891)):
        cfg = CARTConfig(**{"d_model": 1024, "n_heads": 16, "n_loops": 6, **kw})
        with torch.device("meta"):
            assert count_parameters(CART(cfg))["total"] == stored == parameter_counts(cfg)["stored"], kw
    cfg = CARTConfig(d_model=1024, n_heads=16, n_layers=4, n_loops=10)
    assert round(parameter_counts(cfg)["stored"] / 1e6, 2) == 102.02 and round(parameter_counts(cfg)["effective"] / 1e6, 2) == 198.77
    for L, count in ((7, 122_698_752), (12, 186_934_272), (17, 251_169_792)):
        with torch.device("meta"):
            dense = TransformerPP(BaselineConfig(vocab_size=32000, d_model=1024, n_layers=L, n_heads=16, ffn_hidden=2816))
        assert count_parameters(dense)["total"] == count


@pytest.mark.parametrize("R", [1, 4, 16])
def test_the_anchor_kv_is_computed_once_and_reused(R):
    for unfreeze in (False, True):
        model = model_of(n_loops=R, unfreeze_kv=unfreeze)
        calls, pointers = [], []
        model.kv_proj.register_forward_hook(lambda m, i, o: calls.append(1))
        original = CoreBlock.forward

        def spy(self, h, k, v, a, offset):
            pointers.append(k.data_ptr())
            return original(self, h, k, v, a, offset)

        CoreBlock.forward = spy
        try:
            with torch.no_grad():
                model.logits(tokens_of())
        finally:
            CoreBlock.forward = original
        assert len(calls) == (R if unfreeze else 1)
        assert len(pointers) == R and (unfreeze or len(set(pointers)) == 1)


def test_the_core_cross_attention_is_causal_and_its_absence_leaks():
    model, tokens = model_of(), tokens_of()
    later = tokens.clone()
    later[:, 17:] = (later[:, 17:] + 5) % V
    with torch.no_grad():
        a, b = model.logits(tokens), model.logits(later)
    assert torch.equal(a[:, :17], b[:, :17])
    original = CoreBlock.forward

    def leaky(self, h, k, v, at, offset):  # the pre-fix code: the core attends to every anchor position
        return original(self, h, k, v, type(at)(full(), at.rope, at.cache, at.slot), offset)

    CoreBlock.forward = leaky
    try:
        with torch.no_grad():
            a, b = model.logits(tokens), model.logits(later)
    finally:
        CoreBlock.forward = original
    assert (a[:, :17] - b[:, :17]).abs().amax() > 1e-6


def test_the_gate_and_the_hyperconnection_start_where_the_paper_says():
    model = model_of()
    gate = torch.sigmoid(model.a)
    assert bool(((gate > 0) & (gate < 1)).all()) and abs(model.spectral_radius().item() - 0.9) < 1e-6
    torch.testing.assert_close(torch.softmax(model.hyper, 0), torch.tensor([0.5761, 0.2119, 0.2119], dtype=torch.float64),
                               rtol=0, atol=1e-4)
    # at r = 0 all three slots hold e, so the blend is e (to round-off: the weights sum to 1 in floating point)
    e = torch.randn(2, 5, 64, dtype=torch.float64)
    w = torch.softmax(model.hyper, 0)
    torch.testing.assert_close(w[0] * e + w[1] * e + w[2] * e, e, rtol=0, atol=1e-15)


def _norm_ratios(model, R, T=32):
    states = []
    tokens = tokens_of(1, T)
    with torch.no_grad():
        positions = torch.arange(T)[None]
        a = model.attend(positions, model.mask(None))
        x = model.embed(tokens)
        for i, layer in enumerate(model.prelude):
            x = layer(x, a.at(i))
        model.loops(x, a, None, 0, R, states)
    norms = torch.stack([s.norm() for s in states])
    return norms[1:] / norms[:-1], norms


def test_the_reference_update_grows_geometrically_and_the_papers_stays_bounded():
    ratios, norms = _norm_ratios(model_of(torch.float32), 64)
    assert abs(ratios[30:].mean().item() - 1.53) < 0.02  # 1 + sigmoid(a) through the blend's filter (spec §6.7)
    ratios, _ = _norm_ratios(model_of(torch.float32, disable_hyper=True), 64)
    assert abs(ratios[30:].mean().item() - 1.90) < 0.02
    ratios, norms = _norm_ratios(model_of(torch.float32, core_update="paper"), 128)
    assert (ratios[20:] - 1).abs().max() <= 0.05 and torch.isfinite(norms).all()  # spec §8.2's tolerance
    _, norms = _norm_ratios(model_of(torch.float32), 256)
    assert not torch.isfinite(norms).all()  # the reference semantics overflow float32


def test_variable_R_at_inference_beyond_the_papers_16_row_table():
    model, tokens = model_of(), tokens_of(1, 12)
    outs = {}
    for R in (1, 2, 6, 16, 17, 20):  # the same weights, another number of passes (spec §2.9, §7.13)
        model.cfg.n_loops = R
        with torch.no_grad():
            outs[R] = model.logits(tokens)
        assert torch.isfinite(outs[R]).all()
    assert not torch.equal(outs[16], outs[17])
    i = torch.arange(0, 32, 2, dtype=torch.float64)
    torch.testing.assert_close(loop_embedding(3, 32, dtype=torch.float64)[0::2], torch.sin(3 / 10000 ** (i / 32)))
    torch.testing.assert_close(loop_embedding(3, 32, dtype=torch.float64)[1::2], torch.cos(3 / 10000 ** (i / 32)))


@pytest.mark.parametrize("overrides", [{}, {"backprop_loops": 2}, {"unshare_core": True}])
def test_checkpointing_each_pass_gives_the_same_gradients(overrides):
    """Spec §6.12: every recompute policy gives the gradients of none."""
    grads = {policy: _step(policy, **overrides)[0] for policy in (None, "full", "pass", "loop", "block")}
    for policy in ("full", "pass", "loop", "block"):
        for a, b in zip(grads[policy], grads[None]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _step(policy, **overrides):
    """One backward under a recompute policy: the gradients, and the bytes of the distinct storages
    autograd saved outside checkpointed regions (a checkpointed region saves its tensor inputs: the
    anchor's keys and values, the blend weights and the gate, the same storages at every pass)."""
    model = model_of(torch.float32, **overrides)
    model.train()
    if policy:
        get_arch("cart").recompute_policies()[policy].apply(model)
    tokens, storages = tokens_of(), {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = model.head.logits(model.hidden(tokens, torch.arange(32).expand(2, 32)))
        loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], sum(storages.values())


def test_policies_pass_and_loop_keep_nothing_per_pass_beyond_its_state():
    """What each extra pass adds to the saved activations: a whole pass's (norms, attention, SwiGLU,
    blend, gate) without recompute, none under policy pass (its state is the next pass's input)."""
    per_pass = {}
    for policy in (None, "pass", "loop"):
        s2, s6 = _step(policy, n_loops=2)[1], _step(policy, n_loops=6)[1]
        per_pass[policy] = (s6 - s2) / 4
    d_state = 2 * 32 * 64 * 4  # one [B, T, d] float32 state
    assert per_pass[None] > 10 * d_state, per_pass
    assert per_pass["pass"] == per_pass["loop"] == 0, per_pass


def test_the_shared_core_gradient_is_the_sum_over_passes_of_an_unshared_copy():
    shared = model_of()
    unshared = model_of(unshare_core=True)
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith("core.")}
    for r in range(4):  # every unshared pass starts from the shared block's weights
        for name, tensor in shared.core.state_dict().items():
            state[f"core.{r}.{name}"] = tensor
    unshared.load_state_dict(state)
    tokens = tokens_of()
    for model in (shared, unshared):
        logits = model.logits(tokens)
        logits.square().mean().backward()
    for name, p in shared.core.named_parameters():
        total = sum(dict(unshared.core[r].named_parameters())[name].grad for r in range(4))
        torch.testing.assert_close(p.grad, total, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("ablation", ABLATIONS, ids=lambda kw: ",".join(kw) or "base")
def test_every_ablation_runs_decodes_exactly_and_counts_by_the_formula(ablation):
    model = model_of(**ablation)
    tokens = tokens_of(2, 13)
    with torch.no_grad():
        full_logits = model.logits(tokens)
        state = model.new_state(2)
        pieces = [model.step(tokens[:, :5], state)[0]] + [model.step(tokens[:, t:t + 1], state)[0] for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(pieces, 1), full_logits, rtol=0, atol=1e-10)
    model.train()
    model.logits(tokens).sum().backward()
    unused = {"disable_hyper": "hyper", "disable_lti": "a", "disable_lie": "lie.weight"}  # kept, as in the paper's count
    idle = {unused[k] for k in ablation if k in unused}
    assert {n for n, p in model.named_parameters() if p.grad is None} == idle
    assert count_parameters(model)["total"] == parameter_counts(model.cfg)["stored"]


def test_bad_input_is_refused_with_one_sentence():
    base = ["model.vocab_size=256", "data.train=[]"]
    cases = [
        (["model.core_update=sometimes"], "model.core_update must be reference or paper"),
        (["model.n_loops=0"], "model.n_loops must be >= 1"),
        (["model.lie_dim=7"], "model.lie_dim must be an even number"),
        (["model.window=4"], "model.window is not supported by CART"),
        (["model.n_layers=-1"], "model.n_layers must be >= 1"),
        (["model.d_model=130", "model.n_heads=2"], "model.d_model 130 is not divisible by 4 for the d/4 key/value latent"),
        (["model.self_attn_core=true"], "model.self_attn_core=true needs model.unshare_core=true"),
        (["model.loops_sampling=uniform", "model.loops_min=0"], "the draw needs mass at R >= 1"),
        (["model.backprop_loops=5"], "model.backprop_loops=5 must lie in 0..4"),
        (["model.loops_sampling=uniform", "model.loops_min=2", "model.backprop_loops=3"], "must lie in 0..2"),
    ]
    for extra, message in cases:
        with pytest.raises((ConfigError, ValueError)) as e:
            load_config("cart/tiny", base + extra, check_data=False)
        assert message in str(e.value) and "\n" not in str(e.value), (extra, str(e.value))


def test_a_short_training_run_falls(tmp_path):
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"model.d_model": 64, "model.n_heads": 1, "train.max_steps": 40,
                                               "train.eval_every": 0, "checkpoint.every": 0, "optim.lr": 3e-3,
                                               "schedule.warmup_steps": 4})
    Trainer(load_config("cart/tiny", over), log=lambda *_: None).fit()
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses


def test_random_depth_is_the_same_on_every_rank_and_after_a_resume_and_flops_follow_it():
    from pretrain.models.base import StepContext
    from pretrain.models.cart import flops_per_token

    for sampling in ("uniform", "huginn"):
        cfg = cfg_of(n_loops=6, loops_sampling=sampling, loops_min=2, loops_max=12)
        draws = [cfg.draw_loops(StepContext.for_step(7, step)) for step in range(200)]
        again = [cfg.draw_loops(StepContext.for_step(7, step)) for step in range(200)]  # another rank, a resume
        assert draws == again and len(set(draws)) > 3 and min(draws) >= 1 and max(draws) <= 12
        assert cfg.draw_loops(StepContext(3, 3, training=False)) == 6  # evaluation runs n_loops
        ctx = StepContext.for_step(7, 0)
        R = cfg.draw_loops(ctx)
        fixed = dataclasses.replace(cfg, loops_sampling="fixed", n_loops=R)
        assert flops_per_token(cfg, 32, ctx) == flops_per_token(fixed, 32)
    uniform = cfg_of(n_loops=6, loops_sampling="uniform", loops_min=2)
    assert uniform.expected_loops() == 4.0
    model = model_of(n_loops=6, loops_sampling="uniform", loops_min=2)
    model.train()
    from pretrain.data.batch import collate

    raw = tokens_of(2, 33).numpy()
    batch = collate((raw, raw * 0), eod_id=None)
    _, diag = model(batch, StepContext.for_step(7, 5))
    assert diag["loops"].item() == uniform.draw_loops(StepContext.for_step(7, 5))
    assert abs(diag["rho"].item() - 0.9) < 1e-6 and diag["rho_min"] <= diag["rho_mean"] <= diag["rho"]


def test_truncated_backprop_takes_no_gradient_from_the_first_passes():
    """With k trained passes of R, the gradient equals that of a model whose first R - k passes are
    constants: the same as detaching the state after them."""
    R, k = 5, 2
    model = model_of(n_loops=R, backprop_loops=k)
    model.train()
    tokens = tokens_of()
    model.logits(tokens).square().mean().backward()
    truncated = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the same computation by hand: the first R - k passes under no_grad, then the last k with gradient
    full = model_of(n_loops=R)
    full.load_state_dict(model.state_dict())
    original = CART._pass

    def spy(self, r, buf, *rest):
        if r == R - k:
            buf = [b.detach() for b in buf]
        return original(self, r, buf, *rest)

    CART._pass = spy
    try:
        full.logits(tokens).square().mean().backward()
    finally:
        CART._pass = original
    for n, p in full.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(truncated[n], p.grad, rtol=1e-10, atol=1e-14)
    # the core's gradient comes from the last k passes only: smaller than with every pass
    full.zero_grad()
    full.logits(tokens).square().mean().backward()
    assert not torch.allclose(full.core.ffn.down.weight.grad, truncated["core.ffn.down.weight"])


def test_eval_sweeps_R_on_a_run_and_on_an_exported_folder_and_refuses_what_cannot_run(tmp_path, capsys):
    import json

    from pretrain.cli import main
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov")
    base = {"model.d_model": 64, "model.n_heads": 1, "train.max_steps": 3, "train.eval_every": 0,
            "checkpoint.every": 0, "schedule.warmup_steps": 1}
    Trainer(load_config("cart/tiny", tiny_overrides(tmp_path, corpus, **base)), log=lambda *_: None).fit()
    run = str(tmp_path / "run")
    assert main(["export", run, str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    for path in (run, str(tmp_path / "exported")):
        assert main(["eval", path, "--batches", "1", "--sweep", "model.n_loops=1,4,20", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["model.n_loops"] for r in rows] == ["1", "4", "20"] and len({r["val_loss"] for r in rows}) == 3
    assert main(["eval", run, "--batches", "1", "--sweep", "model.n_loops=4"]) == 0
    assert "model.n_loops" in capsys.readouterr().out
    # an unshared core has one block per pass: another R changes the weights' shapes, refused before any work
    Trainer(load_config("cart/tiny", tiny_overrides(tmp_path, corpus, **base, **{
        "model.unshare_core": "true", "train.run_dir": str(tmp_path / "unshared")})), log=lambda *_: None).fit()
    assert main(["eval", str(tmp_path / "unshared"), "--batches", "1", "--sweep", "model.n_loops=4,5"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "model.n_loops" in err and "\n" not in err.strip() and "val loss" not in captured.out


def test_the_stage1_grid_is_a_64_point_sweep_whose_points_load():
    import os

    from slurm.sweep import expand, load_sweep

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    points = expand(load_sweep(os.path.join(root, "configs", "cart", "sweeps", "stage1.yaml")))
    assert len(points) == 64 and len({p["name"] for p in points}) == 64
    seen = set()
    for p in points[::9]:
        cfg = load_config("cart/d256-r6", p["overrides"], check_data=False).model
        assert cfg.d_model == 64 * cfg.n_heads and cfg.n_loops in (2, 4, 6, 8) and cfg.n_layers in (2, 3, 4, 6)
        seen.add(cfg.d_model)
    assert seen == {256, 512, 768, 1024}


def test_frozen_kv_equals_recomputing_the_anchor_in_every_pass_bitwise():
    model, tokens = model_of(torch.float32), tokens_of()
    with torch.no_grad():
        frozen = model.logits(tokens)
    anchor = {}
    loops, forward = CART.loops, CoreBlock.forward

    def keep_e(self, e, *rest, **kw):
        anchor["e"] = e
        return loops(self, e, *rest, **kw)

    def recompute(self, h, k, v, a, offset):
        k, v = model.kv_proj(anchor["e"])  # kv_proj(e) again, inside this pass
        return forward(self, h, k, v, a, offset)

    CART.loops, CoreBlock.forward = keep_e, recompute
    try:
        with torch.no_grad():
            again = model.logits(tokens)
    finally:
        CART.loops, CoreBlock.forward = loops, forward
    assert torch.equal(frozen, again)
