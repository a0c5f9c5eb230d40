"""CRT's own mechanism (spec-000 §6 and §8): the K-pass parallel forward against the streaming
recurrence, the off-by-one of which positions are exact, BPTT gradients, conversion, prefix
consistency, chunked prefill, dropout per pass, the K sampler, L̂, recompute policies, bad input.

The registry-wide tests (tests/test_registry.py, tests/test_layout_matrix.py) cover the rest.
Numerical checks run in float64 at spec §6's tiny shapes (V=64, C=32, 4 heads, T=9..16).
"""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.models import get_arch
from pretrain.models.base import EVAL, StepContext
from pretrain.models.crt import CRT, CRTConfig, convert, flops_per_token, num_passes, paper_formula_params

V, C = 64, 32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_of(**kw) -> CRTConfig:
    values = dict(vocab_size=V, d_model=C, n_layers=2, n_heads=4, max_seq_len=64, k_max=3, k_min=2)
    values.update(kw)
    return CRTConfig(**values)


def model_of(seed=0, corr_std=0.3, **kw) -> CRT:
    """A float64 CRT in eval mode; the correction's weights at std 0.3 so that its map is not trivially
    contractive (spec §6.1) and a wrong index shows."""
    torch.manual_seed(seed)
    model = CRT(cfg_of(**kw)).double().eval()
    if hasattr(model.correction, "ffn") and corr_std:
        for p in model.correction.ffn.parameters():
            torch.nn.init.normal_(p, std=corr_std)
    return model


def tokens_of(B=2, T=9, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def streamed(model, tokens, chunk=1):
    """Logits of the streaming recurrence: `chunk` tokens per step (1: token by token)."""
    model.cfg.prefill_chunk = chunk
    state = model.new_state(tokens.shape[0])
    with torch.no_grad():
        return model.step(tokens, state)[0]


def parallel(model, tokens, K):
    model.cfg.eval_k = K
    with torch.no_grad():
        return model.logits(tokens)


@pytest.mark.parametrize("variant", [dict(), dict(block="llama"), dict(correction="concat"),
                                     dict(correction="blind"), dict(correction="block_head"), dict(pre_ffn=True),
                                     dict(window=3), dict(n_kv_heads=2), dict(block="llama", n_kv_heads=1)])
def test_streaming_equals_parallel_at_T_plus_1_and_the_first_K_minus_1_positions(variant):
    model, tokens = model_of(**variant), tokens_of(T=9)
    seq = streamed(model, tokens)
    torch.testing.assert_close(parallel(model, tokens, 10), seq, rtol=0, atol=1e-10)  # K = T + 1
    torch.testing.assert_close(parallel(model, tokens, -1), seq, rtol=0, atol=1e-10)  # eval_k=-1: exact
    model.cfg.eval_k = -1
    with torch.no_grad():
        z, _ = model.passes(tokens, torch.arange(9).expand_as(tokens), None, 10)
    torch.testing.assert_close(model.logits(tokens), model.head.logits(model.norm(z)), rtol=0, atol=1e-10)
    for K in (2, 3, 5):
        err = (parallel(model, tokens, K) - seq).abs().amax(dim=(0, 2))
        assert err[:K - 1].max() < 1e-10, (K, err)  # positions t <= K-2 are exact ...
        if variant.get("correction") not in ("blind", "block_head"):
            assert err[K - 1] > 1e-3, (K, err)  # ... and t = K-1 is not (the off-by-one of spec §7.1)
        assert err[K:].min() > 1e-6  # and generally not beyond


def test_float32_streaming_is_within_1e_4_of_parallel_T_plus_1():
    model, tokens = model_of().float(), tokens_of(T=16)
    torch.testing.assert_close(parallel(model, tokens, 17), streamed(model, tokens), rtol=0, atol=1e-4)


def test_K1_is_the_roformer():
    crt, tokens = model_of(), tokens_of()
    roformer = CRT(cfg_of(correction="none", k_max=1, k_min=0)).double().eval()
    missing, unexpected = roformer.load_state_dict(crt.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("correction.") for k in unexpected)
    torch.testing.assert_close(parallel(crt, tokens, 1), parallel(roformer, tokens, 1), rtol=0, atol=0)


def _converted(source_arch, source_cfg, source_model, **target):
    target_cfg = cfg_of(corr_out_init="normal", **target)
    model = CRT(target_cfg).double().eval()
    model.load_state_dict(convert(source_arch, source_cfg, source_model.state_dict(), target_cfg))
    return model


@pytest.mark.parametrize("source", ["roformer", "baseline"])
def test_conversion_preserves_the_function_for_every_K_and_streaming(source):
    tokens = tokens_of(T=12)
    if source == "roformer":
        scfg = cfg_of(correction="none", k_max=1, k_min=0)
        src = CRT(scfg).double().eval()
        want = parallel(src, tokens, 1)
        model = _converted("crt", scfg, src)
    else:
        scfg = load_config("baseline/tiny", [f"model.vocab_size={V}", f"model.d_model={C}", "model.n_layers=2",
                                             "model.n_heads=4"], check_data=False).model
        torch.manual_seed(0)
        src = get_arch("baseline").build(scfg).double().eval()
        with torch.no_grad():
            want = src.logits(tokens)
        model = _converted("baseline", scfg, src, block="llama", tie_embeddings=True, norm_eps=scfg.norm_eps)
    for K in (1, 2, 5):
        torch.testing.assert_close(parallel(model, tokens, K), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(streamed(model, tokens), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(streamed(model, tokens, chunk=5), want, rtol=0, atol=1e-12)

    # Fine-tuning moves the output layer first (fc1's gradient is zero while fc2 is), then fc1.
    out, inner = ("fc2", "fc1") if source == "roformer" else ("down", "gate")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(2):
        opt.zero_grad()
        model.cfg.eval_k = 3
        loss = torch.nn.functional.cross_entropy(model.logits(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        grads.append({n: getattr(model.correction.ffn, n).weight.grad.abs().max().item() for n in (out, inner)})
        opt.step()
    assert grads[0][out] > 0 and grads[0][inner] == 0 and grads[1][inner] > 0, grads


def test_conversion_refuses_another_width_depth_vocabulary_or_block():
    scfg = cfg_of(correction="none", k_max=1, k_min=0)
    state = CRT(scfg).state_dict()
    for change, field in ((dict(d_model=64), "d_model"), (dict(n_layers=3), "n_layers"),
                          (dict(vocab_size=128), "vocab_size"), (dict(block="llama"), "block")):
        with pytest.raises(ValueError, match=f"model.{field}="):
            convert("crt", scfg, state, cfg_of(**change))
    with pytest.raises(ValueError, match="converts from a baseline or crt run"):
        convert("sps", scfg, state, cfg_of())
    with pytest.raises(ValueError, match="model.pre_ffn=False into a CRT with model.pre_ffn=True"):
        convert("crt", scfg, state, cfg_of(pre_ffn=True))
    with pytest.raises(ValueError, match="model.correction=block_head would not start from the source's function"):
        convert("crt", scfg, state, cfg_of(correction="block_head"))


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("n_kv_heads", [0, 2])
def test_bptt_gradients_equal_the_parallel_forward_at_K_T_plus_1(window, n_kv_heads):
    tokens = tokens_of(T=8)
    labels = tokens.roll(-1, 1)

    def grads(K):
        model = model_of(window=window, n_kv_heads=n_kv_heads)
        model.cfg.eval_k = K
        positions = torch.arange(8).expand_as(tokens)
        z = model.recurrence(tokens, positions) if K is None else model.passes(tokens, positions, None, K)[0]
        logits = model.head.logits(model.norm(z))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    bptt, exact, short = grads(None), grads(9), grads(3)
    assert bptt.keys() == exact.keys()
    for name in bptt:
        torch.testing.assert_close(bptt[name], exact[name], rtol=1e-8, atol=1e-12, msg=name)
    assert any((short[n] - bptt[n]).abs().max() > 1e-6 for n in bptt)  # K < T+1 is not BPTT


def test_bptt_is_the_training_forward_in_bptt_mode():
    from pretrain.data.batch import Batch

    model, tokens = model_of(train_mode="bptt"), tokens_of(T=8)
    B, T = tokens.shape
    batch = Batch(tokens, tokens.roll(-1, 1), torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.int32),
                  torch.arange(T).expand(B, T))
    loss, _ = model(batch, StepContext(training=True))
    model.cfg.eval_k = T + 1
    want, _ = model(batch, EVAL)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("K", [1, 2, 4, 10])
def test_prefix_consistency(K):
    model, tokens = model_of(), tokens_of(T=12)
    short = parallel(model, tokens[:, :7], K)
    torch.testing.assert_close(parallel(model, tokens, K)[:, :7], short, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [2, 3, 5, 16])
def test_chunked_prefill_then_token_by_token_equals_streaming(chunk):
    model, tokens = model_of(), tokens_of(T=13)
    want = streamed(model, tokens)
    model.cfg.prefill_chunk = chunk
    state = model.new_state(2)
    with torch.no_grad():
        got = [model.step(tokens[:, :7], state)[0]] + [model.step(tokens[:, t:t + 1], state)[0] for t in range(7, 13)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=1e-10)


def test_dropout_masks_differ_across_passes_and_eval_is_deterministic():
    model, tokens = model_of(dropout=0.5, k_max=3, k_min=0), tokens_of()
    masks = []
    model.trunk.blocks[0].drop.register_forward_hook(lambda m, i, o: masks.append((o == 0) & (i[0] != 0)))
    model.train()
    model.passes(tokens, torch.arange(9).expand_as(tokens), None, 3)
    attn_masks = masks[0::2]  # each pass applies the block's dropout twice (attention, FFN)
    assert len(attn_masks) == 3 and attn_masks[0].any()
    assert not torch.equal(attn_masks[0], attn_masks[1]) and not torch.equal(attn_masks[1], attn_masks[2])
    model.eval()
    torch.testing.assert_close(parallel(model, tokens, 3), parallel(model, tokens, 3), rtol=0, atol=0)


def test_the_K_sampler_is_in_range_and_the_same_on_every_rank_and_after_a_resume():
    cfg = cfg_of(k_max=5, k_min=2)
    draws = [num_passes(cfg, StepContext.for_step(1234, step), 16) for step in range(200)]
    assert set(draws) == {2, 3, 4, 5}
    # another "rank" (or a resumed run) rebuilds the context from (seed, step) alone
    assert draws == [num_passes(cfg, StepContext.for_step(1234, step), 16) for step in range(200)]
    assert draws != [num_passes(cfg, StepContext.for_step(99, step), 16) for step in range(200)]
    assert num_passes(cfg_of(k_max=4, k_min=0), StepContext.for_step(1, 3), 16) == 4  # fixed K
    assert num_passes(cfg, EVAL, 16) == 5 and num_passes(cfg_of(eval_k=-1), EVAL, 16) == 17


def test_flops_follow_K():
    cfg = cfg_of(k_max=5, k_min=2, d_model=64)
    ctxs = {num_passes(cfg, StepContext.for_step(0, s), 32): StepContext.for_step(0, s) for s in range(50)}
    f = {K: flops_per_token(cfg, 32, ctx) for K, ctx in ctxs.items()}
    block = 6 * 2 * (4 * 64 ** 2 + 2 * 64 * 256) + 12 * 2 * 64 * 32  # D=2 blocks at T=32 keys
    corr = 6 * 2 * 64 * 256
    for K in (3, 4, 5):
        assert f[K] - f[K - 1] == pytest.approx(block + corr)
    assert flops_per_token(cfg, 32) == pytest.approx(sum(f.values()) / 4)  # the expectation over U{2..5}
    # absolute, spec §5: forward MACs K D (12 C^2 + 2 T C) + (K-1) 8C^2 + V C, times 2 FLOPs and 3 (with backward)
    C, D, T = 64, 2, 32
    assert f[5] == pytest.approx(6 * (5 * D * 12 * C * C + 4 * 8 * C * C + V * C) + 12 * 5 * D * C * T)
    bptt = flops_per_token(cfg_of(k_max=5, k_min=2, d_model=64, train_mode="bptt"), 32, ctxs[5])
    assert bptt == pytest.approx(f[2] - block)  # one pass of the blocks and one correction per token


def test_contraction_diagnostic_at_evaluation():
    from pretrain.data.batch import Batch

    model, tokens = model_of(corr_std=0.05), tokens_of(T=16)
    B, T = tokens.shape
    batch = Batch(tokens, tokens.roll(-1, 1), torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.int32),
                  torch.arange(T).expand(B, T))
    model.cfg.eval_k = 4
    with torch.no_grad():
        loss, diag = model(batch, EVAL)
        z, c = model.passes(tokens, batch.positions, None, 4, corrections=3)
    assert set(diag) == {"lhat_max", "lhat_median"}
    # by hand for the first sequence, over t >= K-1 = 3
    ratio = (c[2] - c[1])[0, 3:].norm(dim=-1) / (c[1] - c[0])[0, 3:].norm(dim=-1)
    by_hand = model(Batch(*(x[:1] for x in (batch.tokens, batch.labels, batch.loss_mask, batch.doc_ids,
                                            batch.positions))), EVAL)[1]
    assert by_hand["lhat_max"].item() == pytest.approx(ratio.max().item())
    assert by_hand["lhat_median"].item() == pytest.approx(ratio.median().item())  # over t >= 3 only
    assert 0 < diag["lhat_median"] <= diag["lhat_max"] < float("inf")
    # with two documents per sample, positions within K-2 of the second start are left out too
    docs = torch.tensor([[0] * 8 + [1] * 8]).expand(B, T).int()
    from pretrain.models.crt import contraction

    got = contraction(c, 4, docs)
    ratio = (c[2] - c[1])[0].norm(dim=-1) / (c[1] - c[0])[0].norm(dim=-1)
    keep = torch.tensor([t % 8 >= 3 for t in range(16)])
    assert contraction([x[:1] for x in c], 4, docs[:1])["lhat_median"].item() == pytest.approx(ratio[keep].median().item())
    assert got["lhat_max"] <= diag["lhat_max"] + 1e-12
    assert (c[1] - c[0])[:, :2].abs().max() < 1e-12  # positions t <= K-3 have converged exactly: 0/0


@pytest.mark.parametrize("policy", ["pass", "block"])
def test_recompute_policies_give_the_same_gradients(policy):
    tokens = tokens_of(T=10)

    def grads(recompute):
        model = model_of(dropout=0.1, k_max=3, k_min=0)
        model.train()
        if recompute:
            get_arch("crt").recompute_policies()[policy].apply(model)
        torch.manual_seed(5)  # the same dropout masks; recomputation replays them
        z, _ = model.passes(tokens, torch.arange(10).expand_as(tokens), None, 3)
        model.head.logits(model.norm(z)).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-10, atol=1e-12, msg=name)
    assert get_arch("crt").recompute_policies()["full"] is get_arch("crt").recompute_policies()["pass"]


def test_bad_input_is_refused_in_validate_with_one_sentence():
    cases = [(["model.k_max=2", "model.k_min=3"], "model.k_min 3 must lie in 1..model.k_max"),
             (["model.k_max=0"], "model.k_max must be >= 1"),
             (["model.correction=sum"], "model.correction must be one of"),
             (["model.correction=none"], "model.correction=none is the roformer"),
             (["model.block=llama", "model.dropout=0.1"], "the llama block"),
             (["parallel.pp=2"], "parallel.pp=2 is not supported (each of the K passes runs every block"),
             (["parallel.recompute=layer"], "parallel.recompute=layer: model.arch 'crt' offers full, pass, block"),
             (["model.train_mode=bptt", "data.seq_len=256", "train.micro_batch_seqs=16", "model.d_model=2048",
               "model.n_heads=16"], "would keep about"),
             (["model.train_mode=bptt", "parallel.recompute=pass"], "cannot recompute BPTT"),
             (["model.train_mode=bptt", "model.document_mask=true"], "model.eval_k=-1 evaluates by the recurrence"),
             (["model.train_mode=bptt", "model.dropout=0.1"], "model.train_mode=bptt runs without dropout"),
             (["model.eval_k=-1", "parallel.tp=2", "parallel.sp=true"], "which parallel.sp=true does not allow")]
    for overrides, message in cases:
        with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(").replace(".", r"\.")) as e:
            load_config("crt/tiny", overrides + ["data.train=[x]"], check_data=False)
        assert "\n" not in str(e.value)


def test_the_paper_formula_count():
    cfg = cfg_of(vocab_size=32000, d_model=2048, n_layers=1, n_heads=16)
    assert paper_formula_params(cfg) == 214_958_080  # spec §3.1: D 12C^2 + 8C^2 + 2VC
    roformer = dataclasses.replace(cfg, correction="none", k_max=1, k_min=0, n_layers=6, d_model=1088)
    assert paper_formula_params(roformer) == 154_861_568
    gqa = dataclasses.replace(cfg, n_kv_heads=4)  # k and v of 4 heads of 128 instead of 16
    assert paper_formula_params(gqa) == 214_958_080 - 2 * 2048 * (2048 - 4 * 128)
    assert flops_per_token(gqa, 64) < flops_per_token(cfg, 64)


def test_gqa_crt_caches_kv_heads_converts_and_sizes_bptt():
    """model.n_kv_heads in CRT: the decode state holds the kv heads; a GQA baseline converts into a
    llama-block CRT with the same function, and a mismatch is refused by its field; BPTT's memory
    estimate counts the kv heads."""
    state = model_of(n_kv_heads=2).new_state(3)
    assert all(t.shape == (3, 2, 64, 8) for t in state.k + state.v)

    tokens = tokens_of(T=12)
    scfg = load_config("baseline/tiny", [f"model.vocab_size={V}", f"model.d_model={C}", "model.n_layers=2",
                                         "model.n_heads=4", "model.n_kv_heads=2"], check_data=False).model
    torch.manual_seed(0)
    src = get_arch("baseline").build(scfg).double().eval()
    with torch.no_grad():
        want = src.logits(tokens)
    llama = dict(block="llama", tie_embeddings=True, norm_eps=scfg.norm_eps)
    model = _converted("baseline", scfg, src, n_kv_heads=2, **llama)
    torch.testing.assert_close(parallel(model, tokens, 3), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(streamed(model, tokens), want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="model.n_kv_heads=2 into a CRT with model.n_kv_heads=0: set it to 2"):
        convert("baseline", scfg, src.state_dict(), cfg_of(**llama))
    mha = dataclasses.replace(scfg, n_kv_heads=0)
    torch.manual_seed(0)
    convert("baseline", mha, get_arch("baseline").build(mha).state_dict(), cfg_of(n_kv_heads=4, **llama))  # 0 = 4

    bptt = ["model.train_mode=bptt", "data.seq_len=256", "train.micro_batch_seqs=16", "model.d_model=2048",
            "model.n_heads=16", "data.train=[x]"]
    with pytest.raises((ConfigError, ValueError), match="would keep about 32.1 GB"):
        load_config("crt/tiny", bptt, check_data=False)
    load_config("crt/tiny", bptt + ["model.n_kv_heads=1"], check_data=False)  # 2 x 128 + 16 per key: ~2.1 GB


def test_a_short_training_run_logs_K_and_the_contraction_and_its_loss_falls(tmp_path):
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import write_markov_corpus

    import test_registry

    corpus = write_markov_corpus(tmp_path / "markov")
    over = test_registry.run_overrides(tmp_path, corpus, **{"train.max_steps": 30, "train.eval_every": 15,
                                                             "model.k_max": 4, "model.k_min": 1})
    cfg = load_config("crt/tiny", over)
    Trainer(cfg, log=lambda *_: None).fit()
    records = read_metrics(str(tmp_path / "run"))
    steps = [r for r in records if "loss" in r]
    # the logged K is the step's draw, the same one every rank and a resumed run make
    assert [r["k"] for r in steps] == pytest.approx([num_passes(cfg.model, StepContext.for_step(cfg.train.seed, r["step"] - 1), 32)
                                                      for r in steps], rel=1e-6)  # a token-weighted mean of K
    assert {round(r["k"]) for r in steps} == {1, 2, 3, 4}
    evals = [r for r in records if "val_loss" in r]
    assert evals and all(0 < r["val_lhat_median"] <= r["val_lhat_max"] for r in evals)
    assert sum(r["loss"] for r in steps[-5:]) < sum(r["loss"] for r in steps[:5])


def test_a_trained_baseline_run_converts_into_a_llama_block_crt_run(tmp_path):
    """checkpoint.init_from with the registry's convert: the CRT run's first loss (at its drawn K >= 2)
    equals the baseline's own on the same batch, since the correction starts at exactly zero."""
    from pretrain.trainer import Trainer
    from trainer_helpers import write_markov_corpus

    import test_registry

    corpus = write_markov_corpus(tmp_path / "markov")

    def run(config, name, steps, *extra):
        over = test_registry.run_overrides(tmp_path, corpus, **{"train.max_steps": steps, "schedule.warmup_steps": 1,
                                                                 "train.run_dir": f"{tmp_path}/{name}"})
        Trainer(load_config(config, over + list(extra)), log=lambda *_: None).fit()
        return [r["loss"] for r in read_metrics(str(tmp_path / name)) if "loss" in r]

    from pretrain.metrics import read_metrics

    dims = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4"]
    run("baseline/tiny", "source", 6, *dims)
    again = run("baseline/tiny", "again", 2, *dims, f"checkpoint.init_from={tmp_path}/source")
    llama = ["model.block=llama", "model.tie_embeddings=true", "model.norm_eps=1e-6", "model.k_min=2"]
    crt = run("crt/tiny", "crt", 2, *dims, *llama, f"checkpoint.init_from={tmp_path}/source")
    assert crt[0] == pytest.approx(again[0], rel=1e-6)
    with pytest.raises((ConfigError, ValueError), match="model.d_model=64 into a CRT with model.d_model=32"):
        load_config("crt/tiny", test_registry.run_overrides(tmp_path, corpus, **{"train.run_dir": f"{tmp_path}/x"})
                    + ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", *llama,
                       f"checkpoint.init_from={tmp_path}/source"])


def _layout_body(rank, world_size, tmp, corpus, extra):
    from trainer_helpers import train_run

    return train_run(tmp, corpus, "layout", 3, ["train.compile=false"] + extra,
                     arch_config="crt/tiny")[1]


@pytest.mark.slow
@pytest.mark.parametrize("policy, layout", [
    ("none", ["model.k_max=2", "model.k_min=1"]),  # DDP: a K=1 step still gives the correction a gradient
    ("none", ["model.k_max=2", "model.k_min=1", "parallel.data_parallel=deepspeed", "parallel.zero_stage=3"]),
    ("pass", ["parallel.data_parallel=deepspeed", "parallel.zero_stage=2"]),
    ("block", ["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"]),
    ("pass", ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]),
    ("block", ["parallel.tp=2", "parallel.sp=true"]),
])
def test_recompute_policies_under_parallel_layouts_equal_one_process(policy, layout, tmp_path):
    """The shared blocks run K times and are recomputed K times: gradients are still reduced once
    (non-reentrant checkpointing); every layout equals one process without
    recompute."""
    import numpy as np

    from distributed import run_ranks
    from trainer_helpers import step_losses, train_run, write_markov_corpus

    pytest.importorskip("megatron.core", reason="these layouts need megatron-core")
    corpus = write_markov_corpus(tmp_path / "markov")
    tmp = str(tmp_path)
    same_model = [o for o in layout if o.startswith("model.")]
    _, single = train_run(tmp, corpus, "single", 3, ["train.compile=false"] + same_model, arch_config="crt/tiny")
    extra = layout + [f"parallel.recompute={policy}"]
    params = run_ranks(_layout_body, 2, args=(tmp, corpus, extra), env={"DS_ACCELERATOR": "cpu"}, timeout=600)[0]
    got, want = step_losses(f"{tmp}/layout"), step_losses(f"{tmp}/single")
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(want, rel=1e-5)
    for k in single:
        np.testing.assert_allclose(params[k], single[k], rtol=0, atol=2e-5, err_msg=k)


def test_under_a_whole_model_torch_compile_the_recurrence_runs_eager():
    """`recurrence` and `num_passes` are disabled for dynamo lazily (torch._disable_dynamo, so that importing
    the module does not import dynamo): compiling the whole model still runs the token loop eagerly, with
    the eager values."""
    torch._dynamo.reset()
    model, tokens = model_of(), tokens_of(T=7)
    eager = parallel(model, tokens, -1)  # eval_k=-1: the exact logits, by the recurrence
    seen = []
    trunk_forward = model.trunk.forward
    model.trunk.forward = lambda *a, **k: (seen.append(torch.compiler.is_compiling()), trunk_forward(*a, **k))[1]
    compiled = torch.compile(model.logits, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), eager, rtol=0, atol=1e-12)
    assert len(seen) == 7 and not any(seen), seen  # one eager trunk call per token, none traced
    torch._dynamo.reset()


def test_importing_the_trainer_and_every_architecture_leaves_dynamo_unimported():
    """A process that does not compile never pays dynamo's import (about 1 s of CPU at every start)."""
    code = ("import sys, pretrain.trainer, pretrain.cli; from pretrain.models import all_archs; all_archs(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_compile_compiles_one_pass_so_every_K_shares_its_graphs():
    torch._dynamo.reset()
    model, tokens = model_of(k_max=6, k_min=1), tokens_of(T=12)
    eager = {K: parallel(model, tokens, K) for K in range(1, 7)}
    model.compile(backend="eager")
    torch._dynamo.utils.counters.clear()
    for K in range(1, 7):
        torch.testing.assert_close(parallel(model, tokens, K), eager[K], rtol=0, atol=1e-12)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < frames <= 4, frames  # the trunk and the correction, not a forward per K
    torch._dynamo.reset()
