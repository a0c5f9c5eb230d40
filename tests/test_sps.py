"""SPS's own mechanism (spec-001 §6 T1-T12 and §8): the mask against Eq. 5, no future leakage, window
enforcement, exact gradient routing, cached decode, the de-interleaved layout against the interleaved
definition, documents, the variant identities, the loss bookkeeping, bad input.

Shapes follow spec §6: vocab 64, eos 63, pad 62, <predict> 61, d 32, 2 heads, 2 layers, FFN 96.
T10 (the token-counted schedule) is in tests/test_optim.py; the registry-wide tests
(tests/test_registry.py, tests/test_layout_matrix.py: TP2 and TP2+SP with the SPS mask, T12) cover the rest.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, load_config
from pretrain.data.batch import collate
from pretrain.models import count_parameters, get_arch
from pretrain.models.baseline import BaselineConfig, TransformerPP
from pretrain.models.sps import SPS, VARIANTS, SPSConfig, flops_per_token
from trainer_helpers import write_markov_corpus

V, EOS, PAD, PREDICT = 64, 63, 62, 61
PICTURE = """\
1 0 0 0 0 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0 0 0 0 0
1 1 1 0 0 0 0 0 0 0 0 0
1 1 1 1 0 0 0 0 0 0 0 0
1 1 1 1 1 0 0 0 0 0 0 0
1 1 1 1 1 1 0 0 0 0 0 0
1 0 1 1 1 1 1 0 0 0 0 0
1 0 1 1 1 1 1 1 0 0 0 0
1 0 1 0 1 1 1 1 1 0 0 0
1 0 1 0 1 1 1 1 1 1 0 0
1 0 1 0 1 0 1 1 1 1 1 0
1 0 1 0 1 0 1 1 1 1 1 1"""  # spec §2.3: T = 6, w = 2, rows queries, columns keys, x0 r0 x1 r1 ...


def cfg_of(**kw) -> SPSConfig:
    values = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=2, ffn_hidden=96, max_seq_len=64, sps_window=2,
                  predict_id=PREDICT, eos_id=EOS)
    values.update(kw)
    return SPSConfig(**values)


def model_of(seed=0, dtype=torch.float32, **kw) -> SPS:
    torch.manual_seed(seed)
    return SPS(cfg_of(**kw)).to(dtype).eval()


def tokens_of(B=2, T=16, seed=1):
    return torch.randint(0, 60, (B, T), generator=torch.Generator().manual_seed(seed))


def allowed_keys(i: int, kind: int, T: int, w: int | None, persistent: int | None) -> set:
    """Eq. 5 written out (and its parity flip): the (token, kind) keys query (i, kind) sees."""
    keys = set()
    for k in range(T):
        for kk in (0, 1):
            if 2 * k + kk > 2 * i + kind:
                continue
            if w is None or kk == persistent or i - k <= w:
                keys.add((k, kk))
    return keys


def interleaved_matrix(model: SPS, T: int, doc_ids=None) -> torch.Tensor:
    return model.slot_mask(T, doc_ids, interleaved=True).evaluate(1, 1, 2 * T, 2 * T)[0, 0]


# -- T1: the mask ----------------------------------------------------------------------------------
def test_T1_the_mask_is_the_spec_picture_and_eq5_for_every_variant_and_window():
    picture = torch.tensor([[int(c) for c in row.split()] for row in PICTURE.splitlines()], dtype=torch.bool)
    assert torch.equal(interleaved_matrix(model_of(sps_window=2), 6), picture)
    T = 7
    for variant, (persistent, _) in VARIANTS.items():
        for w in (0, 1, 3, T, 100):
            m = interleaved_matrix(model_of(variant=variant, sps_window=w), T)
            for q in range(2 * T):
                got = {(k // 2, k % 2) for k in range(2 * T) if m[q, k]}
                want = allowed_keys(q // 2, q % 2, T, None if persistent is None else w, persistent)
                assert got == want, (variant, w, q)
            if w >= T or persistent is None:
                assert torch.equal(m, torch.ones(2 * T, 2 * T, dtype=torch.bool).tril())


def test_T1_the_de_interleaved_mask_is_the_interleaved_one_permuted():
    T, doc = 9, torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    for variant in VARIANTS:
        model = model_of(variant=variant, sps_window=2)
        inter = interleaved_matrix(model, T, doc)
        de = model.slot_mask(T, doc).evaluate(1, 1, 2 * T, 2 * T)[0, 0]
        # de-interleaved slot s holds token s % T of kind s // T, interleaved slot 2 (s % T) + s // T
        perm = torch.tensor([2 * (s % T) + s // T for s in range(2 * T)])
        assert torch.equal(de, inter[perm][:, perm])


def test_each_variants_empty_tile_report_never_drops_a_visible_pair():
    for variant in VARIANTS:
        for T, block, doc in ((13, 4, None), (16, 8, torch.tensor([[0] * 5 + [1] * 11]))):
            model = model_of(variant=variant, sps_window=3)
            mask = model.slot_mask(T, doc)
            empty = mask.empty_tiles(2 * T, 2 * T, block, block)[0, 0]
            # an independent enumeration (Eq. 5 and documents) of every pair
            persistent, w = VARIANTS[variant][0], 3
            for q in range(2 * T):
                for k in range(2 * T):
                    qi, qk, ki, kk = q % T, q // T, k % T, k // T
                    same = doc is None or doc[0, qi] == doc[0, ki]
                    if same and (ki, kk) in allowed_keys(qi, qk, T, None if persistent is None else w, persistent):
                        assert not empty[q // block, k // block], (variant, q, k)
            assert empty.any()  # the layout leaves tiles to skip


# -- T2, T3, T4: causality, the window, gradient routing ----------------------------------------------
def test_T2_a_later_token_leaves_every_earlier_logit_bit_identical():
    model, tokens = model_of(), tokens_of(T=16)
    j = 8
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 7) % 60
    with torch.no_grad():
        a, b = model.logits(tokens), model.logits(changed)
    assert torch.equal(a[:, :j], b[:, :j])
    assert (a[:, j:] - b[:, j:]).abs().amax(-1).min() > 0


def _trunk_all_slots(model, tokens, noise_at=None, seed=0):
    """Every slot's last hidden state [B, 2T, d]; noise_at: a slot whose embedding is replaced by noise."""
    T = tokens.shape[1]
    slots = model.slots(tokens)
    positions = torch.arange(T).repeat(2).expand(tokens.shape[0], 2 * T)
    handle = None
    if noise_at is not None:
        def hook(module, args, out):
            out = out.clone()
            out[:, noise_at] = torch.randn(out[:, noise_at].shape, generator=torch.Generator().manual_seed(seed))
            return out
        handle = model.embed.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model.body(slots, positions, model.slot_mask(T, None))
    finally:
        if handle:
            handle.remove()


@pytest.mark.parametrize("w", [0, 2])
def test_T3_a_windowed_slot_reaches_no_query_past_the_window(w):
    T, k = 12, 3
    model, tokens = model_of(n_layers=1, sps_window=w), tokens_of(T=T)
    clean = _trunk_all_slots(model, tokens)
    noisy = _trunk_all_slots(model, tokens, noise_at=T + k)  # ρ_k in the de-interleaved layout
    for s in range(2 * T):
        tok, kind = s % T, s // T
        if tok - k > w or (kind == 0 and tok <= k):  # out of the window, or x_k and earlier (causal)
            assert torch.equal(clean[:, s], noisy[:, s]), s
    assert not torch.equal(clean[:, T + k], noisy[:, T + k])
    # the attention probability from every query out of the window to ρ_k is exactly 0: the mask says so
    mask = model.slot_mask(T, None).evaluate(1, 1, 2 * T, 2 * T)[0, 0]
    assert not any(mask[q, T + k] for q in range(2 * T) if q % T - k > w)


def _grad_of_losses_wrt_embeddings(model, tokens):
    """[T, 2T] norms: row j = |d loss_j / d embedding of each slot| (loss_j read at the read-out slot j)."""
    T = tokens.shape[1]
    kept = {}

    def hook(module, args, out):
        kept["e"] = out
        out.retain_grad()
        return out

    handle = model.embed.register_forward_hook(hook)
    try:
        positions = torch.arange(T).expand_as(tokens)
        logits = model.head.logits(model.hidden(tokens, positions, None))
    finally:
        handle.remove()
    targets = torch.roll(tokens, -1, 1)
    rows = []
    for j in range(T):
        model.zero_grad()
        kept["e"].grad = None
        F.cross_entropy(logits[0, j], targets[0, j]).backward(retain_graph=True)
        rows.append(kept["e"].grad[0].norm(dim=-1))
    return torch.stack(rows)


def test_T4_at_w0_the_predict_stream_is_a_pure_read_out():
    T = 10
    g = _grad_of_losses_wrt_embeddings(model_of(n_layers=3, sps_window=0, dtype=torch.float64), tokens_of(1, T))
    for j in range(T):
        for i in range(T):
            assert (g[j, T + i] == 0) == (i != j), (j, i)  # ρ_i feeds only its own loss


@pytest.mark.parametrize("layers", [1, 2])
def test_T4_a_predict_slot_feeds_w_later_losses_at_one_layer_and_all_through_two(layers):
    T, w = 12, 2
    g = _grad_of_losses_wrt_embeddings(model_of(n_layers=layers, sps_window=w, dtype=torch.float64), tokens_of(1, T))
    for i in range(T):
        later = [j for j in range(i + w + 1, T)]
        if layers == 1:
            assert all(g[j, T + i] == 0 for j in later), i
            assert all(g[j, T + i] > 0 for j in range(i, min(T, i + w + 1))), i  # spec §8.1: exactly w later
        elif later:
            assert any(g[j, T + i] > 0 for j in later), i  # through the persistent x_{i+1..i+w}


# -- T5: decode -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("w", [0, 1, 3, 40])
def test_T5_cached_decode_equals_the_full_forward(variant, w):
    model, tokens = model_of(variant=variant, sps_window=w), tokens_of(T=20)
    with torch.no_grad():
        full = model.logits(tokens)
        for prefill in (1, 7):  # token by token from the first; a chunk, then one by one
            state = model.new_state(2)
            pieces = [model.step(tokens[:, :prefill], state)[0]]
            pieces += [model.step(tokens[:, t:t + 1], state)[0] for t in range(prefill, 20)]
            torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


def test_T5_greedy_generation_is_the_argmax_of_the_full_forward():
    from pretrain.generate import generate

    model = model_of(sps_window=1)
    spec = get_arch("sps")
    prompt = tokens_of(1, 4)[0].tolist()
    out = generate(model, spec, [prompt], 10, temperature=0)[0]
    seq = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model.logits(seq[:, :-1])
        logits[..., PREDICT] = float("-inf")  # never sampled (an untrained model favours it)
        again = logits.argmax(-1)[0, len(prompt) - 1:]
    assert again.tolist() == out


def test_predict_is_never_sampled_even_when_the_model_prefers_it():
    from pretrain.generate import generate

    model = model_of()
    with torch.no_grad():
        model.embed.weight[PREDICT] = model.norm.weight.sign() * 50  # the tied head now favours <predict>
        assert (model.logits(tokens_of(1, 4)).argmax(-1) == PREDICT).any()
    for temperature in (0, 1.0):
        out = generate(model, get_arch("sps"), [tokens_of(1, 4)[0].tolist()], 12, temperature=temperature, seed=1)
        assert PREDICT not in out[0]


def test_pad_is_never_sampled_and_eos_is_where_pad_doubles_as_eos():
    """Spec §2.4/§2.6: sampling suppresses pad with <predict>; a tokenizer whose pad is its EOS keeps EOS."""
    from pretrain.generate import generate

    model, spec, prompt = model_of(), get_arch("sps"), tokens_of(1, 4)[0].tolist()
    favour = model.norm.weight.detach().sign() * 50  # an embedding row the tied head then prefers
    with torch.no_grad():
        model.embed.weight[EOS] = favour
    for temperature in (0, 1.0):  # EOS is sampled (and ends the row), pad id distinct or the same
        for pad_id in (PAD, EOS):
            assert generate(model, spec, [prompt], 6, temperature=temperature, seed=1, eos_id=EOS,
                            pad_id=pad_id)[0] == [EOS]
    with torch.no_grad():
        model.embed.weight[EOS] = 0.0
        model.embed.weight[PAD] = favour
    for temperature in (0, 1.0):
        out = generate(model, spec, [prompt], 6, temperature=temperature, seed=1, eos_id=EOS, pad_id=PAD)[0]
        assert len(out) == 6 and PAD not in out
        # without the tokenizer's pad id, pad is what it samples
        assert generate(model, spec, [prompt], 1, temperature=temperature, seed=1, eos_id=EOS)[0] == [PAD]


# -- T6: the layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_T6_the_de_interleaved_layout_equals_the_interleaved_definition(variant):
    model, tokens = model_of(variant=variant, sps_window=3), tokens_of(T=17)
    T, B = tokens.shape[1], tokens.shape[0]
    doc = torch.tensor([[0] * 6 + [1] * 11, [0] * 17])
    inter = torch.stack([tokens, torch.full_like(tokens, PREDICT)], 2).flatten(1)  # x_1, ρ_1, x_2, ...
    positions = torch.arange(T).repeat_interleave(2).expand(B, 2 * T)
    with torch.no_grad():
        h = model.body(inter, positions, model.slot_mask(T, doc, interleaved=True))
        want = model.head.logits(model.norm(h[:, model.cfg.readout::2]))
        got = model.head.logits(model.hidden(tokens, torch.arange(T).expand(B, T), doc))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- T7: documents ----------------------------------------------------------------------------------
def test_T7_documents_are_isolated_in_training_and_in_decode():
    model = model_of(sps_window=2)
    a, b = tokens_of(1, 7, seed=3), tokens_of(1, 9, seed=4)
    packed = torch.cat([a, torch.tensor([[EOS]]), b], 1)
    with torch.no_grad():
        alone = model.logits(b)
        together = model.logits(packed)[:, 8:]
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
        state = model.new_state(1)  # decode: the cache after EOS behaves as a fresh start
        streamed = [model.step(packed[:, t:t + 1], state)[0] for t in range(packed.shape[1])]
        torch.testing.assert_close(torch.cat(streamed[8:], 1), alone, rtol=0, atol=1e-5)


def test_T7_finite_poison_in_another_documents_keys_and_values_leaves_outputs_bit_identical():
    model = model_of(sps_window=2)
    tokens = torch.cat([tokens_of(1, 7, seed=3), torch.tensor([[EOS]]), tokens_of(1, 9, seed=4)], 1)
    T = tokens.shape[1]
    doc = torch.tensor([[0] * 8 + [1] * 9])
    doc_a = torch.tensor([s % T < 8 for s in range(2 * T)])
    handles = []

    def poison(module, args, out):
        out = out.clone()
        out[:, doc_a] += 1e4 * torch.randn(out[:, doc_a].shape, generator=torch.Generator().manual_seed(0))
        return out

    def run():
        with torch.no_grad():
            return model.hidden(tokens, torch.arange(T)[None], doc)[:, 8:]

    clean = run()
    handles = [blk.attn.kv.register_forward_hook(poison) for blk in model.blocks]
    try:
        poisoned = run()
    finally:
        for hd in handles:
            hd.remove()
    assert torch.equal(clean, poisoned)


# -- T8 and §8: variant identities --------------------------------------------------------------------
def _logits(model, tokens):
    with torch.no_grad():
        return model.logits(tokens)


def test_T8_variant_identities():
    T, tokens = 12, tokens_of(T=12)
    two_x = _logits(model_of(variant="2x_memory"), tokens)
    assert torch.equal(_logits(model_of(variant="sps", sps_window=T), tokens), two_x)
    assert torch.equal(_logits(model_of(variant="delayed_state", sps_window=T), tokens), two_x)
    # Reverse SPS is Delayed State read at the x slots
    delayed, reverse = model_of(variant="delayed_state", sps_window=2), model_of(variant="reverse_sps", sps_window=2)
    positions = torch.arange(T).expand(2, T)
    with torch.no_grad():
        h = delayed.body(delayed.slots(tokens), positions.repeat(1, 2), delayed.slot_mask(T, None))
        torch.testing.assert_close(reverse.head.logits(reverse.norm(h[:, :T])), _logits(reverse, tokens), rtol=0, atol=0)
    assert not torch.equal(_logits(reverse, tokens), _logits(delayed, tokens))


def test_section8_at_w0_the_x_stream_is_standard():
    cfg = cfg_of(sps_window=0, document_mask=False)
    torch.manual_seed(0)
    sps = SPS(cfg).double().eval()
    base = TransformerPP(BaselineConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(BaselineConfig)
                                           if f.name != "arch"})).double().eval()
    base.load_state_dict(sps.state_dict())  # the same parameter names: SPS adds none
    tokens, T = tokens_of(T=15), 15
    positions = torch.arange(T).expand(2, T)
    with torch.no_grad():
        x_stream = sps.body(sps.slots(tokens), positions.repeat(1, 2), sps.slot_mask(T, None))[:, :T]
        standard = base.body(tokens, positions, base.mask(None))
    torch.testing.assert_close(x_stream, standard, rtol=0, atol=1e-12)


# -- T9: loss bookkeeping, counts, FLOPs ------------------------------------------------------------------
def test_T9_the_loss_is_the_mean_over_valid_predict_slots_and_the_head_sees_T_rows():
    model = model_of(sps_window=2)
    raw = torch.cat([tokens_of(2, 9, seed=5), torch.full((2, 1), EOS), tokens_of(2, 6, seed=6),
                     torch.full((2, 1), PAD), tokens_of(2, 3, seed=7)], 1)  # [2, 20]: a pad target, then input
    doc = (raw == EOS).long().cumsum(1) - (raw == EOS).long()
    batch = collate((raw.numpy(), doc.numpy()), eod_id=EOS, pad_id=PAD)
    seen = []
    head_loss = model.head.loss
    model.head.loss = lambda h, *a, **k: seen.append(h.shape) or head_loss(h, *a, **k)
    with torch.no_grad():
        loss, _ = model(batch)
    assert seen == [torch.Size([2, 19, 32])]  # T rows, not 2T
    with torch.no_grad():
        logits = model.head.logits(model.hidden(batch.tokens, batch.positions, batch.doc_ids))
    # spec §2.4: valid = (idx != PAD) & (idx != EOS), and §8 point 2: no pad target either
    valid = (batch.tokens != PAD) & (batch.tokens != EOS) & (batch.labels != PAD)
    assert torch.equal(batch.loss_mask, valid)  # EOS and pad inputs and pad targets out, the EOS target kept
    assert bool(batch.loss_mask[:, 8].all()) and batch.labels[0, 8] == EOS
    assert batch.tokens[0, 16] == PAD and not batch.loss_mask[:, 16].any()  # a pad input, a real target
    want = F.cross_entropy(logits[valid], batch.labels[valid])
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert not (batch.labels == PREDICT).any()


def test_T9_the_paper_parameter_counts():
    for (d, L, H), count in zip([(512, 8, 8), (768, 12, 12), (1024, 24, 16), (1280, 36, 20), (1600, 48, 25)],
                                [53_027_328, 130_665_216, 378_717_184, 831_253_760, 1_678_081_600]):
        with torch.device("meta"):
            model = SPS(SPSConfig(vocab_size=50304, d_model=d, n_layers=L, n_heads=H, max_seq_len=4096))
        assert count_parameters(model)["total"] == count == 50304 * d + L * (13 * d * d + 2 * d) + d


def test_flops_count_two_slots_per_block_and_the_head_once():
    cfg = cfg_of()
    base = get_arch("baseline").flops_per_token(BaselineConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2,
                                                               ffn_hidden=96), 16)
    head = 6 * V * 32
    attention_std = 12 * 2 * 32 * 16
    blocks_std = base - head - attention_std
    assert flops_per_token(cfg, 16) == 2 * blocks_std + head + 4 * attention_std


# -- bad input ----------------------------------------------------------------------------------------
def test_bad_input_is_refused_in_validate_with_one_sentence(tmp_path):
    from trainer_helpers import write_word_tokenizer

    tok = write_word_tokenizer(tmp_path / "tok.json")  # <predict> at 4, eos 2
    no_predict = tmp_path / "nopredict.json"
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "a": 4}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])
    t.save(str(no_predict))
    base = ["model.vocab_size=64", "data.train=[]", "train.name=x"]
    cases = [
        (["model.sps_window=-1"], "model.sps_window must be >= 0"),
        (["model.variant=sideways"], "model.variant must be one of sps, delayed_state, reverse_sps, 2x_memory"),
        ([f"data.tokenizer={no_predict}"], "has no <predict> token"),
        ([f"data.tokenizer={tok}", "model.predict_id=5"], "model.predict_id 5 is not data.tokenizer's <predict> id 4"),
        (["model.predict_id=64"], "model.predict_id 64 must be a token id below model.vocab_size 64"),
        (["model.predict_id=2"], "model.predict_id and model.eos_id are both 2"),
        (["model.window=8"], "set model.window=0"),
    ]
    for extra, message in cases:
        with pytest.raises((ConfigError, ValueError)) as e:
            load_config("sps/tiny", base + extra, check_data=False)
        assert message in str(e.value) and "\n" not in str(e.value), (extra, str(e.value))


def test_data_holding_the_predict_id_is_refused_before_training(tmp_path):
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides

    corpus = write_markov_corpus(tmp_path / "markov")  # ids 5..63 and 2: model.predict_id=7 collides
    over = tiny_overrides(tmp_path, corpus, **{"model.predict_id": 7, "model.n_heads": 2})
    with pytest.raises(ValueError, match="holds token id 7 .* which the model reserves for <predict>"):
        Trainer(load_config("sps/tiny", over), log=lambda *_: None)


def test_a_short_training_run_falls(tmp_path):
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides

    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"model.n_heads": 2, "train.max_steps": 48, "train.eval_every": 0,
                                               "checkpoint.every": 0, "optim.lr": 1e-2})
    Trainer(load_config("sps/tiny", over), log=lambda *_: None).fit()
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    # slower than Standard at this size: a <predict> slot first has to find its own token by attention
    assert losses[-1] < losses[0] - 0.4, losses
