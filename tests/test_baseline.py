"""Transformer++ baseline: exact parameter counts, streaming decode equal to the parallel forward,
document masking, the loss, and grouped-query attention (model.n_kv_heads) in one process and under
tensor parallelism."""
import pytest
import torch

from pretrain.data import collate
from pretrain.models import count_parameters, get_arch

SPEC = get_arch("baseline")
SPS_SCALES = {  # spec-001 Table 1: (d, layers, heads) -> parameters with vocab 50,304, tied
    "XS": ((512, 8, 8), 53_027_328),
    "S": ((768, 12, 12), 130_665_216),
    "M": ((1024, 24, 16), 378_717_184),
    "L": ((1280, 36, 20), 831_253_760),
    "XL": ((1600, 48, 25), 1_678_081_600),
}


def tiny(**kw):
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    return SPEC.config_cls(**{**base, **kw})


@pytest.mark.parametrize("scale", list(SPS_SCALES))
def test_parameter_counts_match_the_sps_paper(scale):
    (d, L, H), expected = SPS_SCALES[scale]
    cfg = SPEC.config_cls(vocab_size=50304, d_model=d, n_layers=L, n_heads=H)
    with torch.device("meta"):
        model = SPEC.build(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected
    counts = count_parameters(model)
    assert counts["total"] == expected == counts["embedding"] + counts["non_embedding"]
    assert counts["embedding"] == 50304 * d
    assert counts["non_embedding"] == L * (13 * d * d + 2 * d) + d  # spec-001's closed form


def test_untied_head_counts_as_embedding():
    cfg = tiny(tie_embeddings=False)
    counts = count_parameters(SPEC.build(cfg))
    assert counts["embedding"] == 2 * 97 * 32
    assert counts["total"] == counts["embedding"] + count_parameters(SPEC.build(tiny()))["non_embedding"]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_cached_decode_equals_full_forward(dtype, tol):
    torch.manual_seed(0)
    model = SPEC.build(tiny()).to(dtype).eval()
    tokens = torch.randint(0, 97, (3, 19))
    with torch.no_grad():
        positions = torch.arange(19).expand(3, 19)
        full = model.head.logits(model.hidden(tokens, positions))
        state = SPEC.new_state(model, 3)
        pieces = [SPEC.step(model, tokens[:, :7], state)[0]]  # a prompt, then one token at a time
        for t in range(7, 19):
            pieces.append(SPEC.step(model, tokens[:, t : t + 1], state)[0])
    streamed = torch.cat(pieces, dim=1)
    assert streamed.shape == full.shape
    torch.testing.assert_close(streamed.double(), full.double(), rtol=0, atol=tol)


def test_document_mask_isolates_documents():
    torch.manual_seed(1)
    model = SPEC.build(tiny(document_mask=True)).double().eval()
    a, b = torch.randint(3, 97, (1, 9)), torch.randint(3, 97, (1, 8))
    tokens = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 9 + [1] * 8])
    positions = torch.cat([torch.arange(9), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model.hidden(tokens, positions, doc_ids)
        alone = model.hidden(b, torch.arange(8)[None])
        unmasked = model.hidden(tokens, positions)
    torch.testing.assert_close(packed[:, 9:], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(unmasked[:, 9:], alone)


def test_loss_is_masked_mean_cross_entropy():
    torch.manual_seed(2)
    model = SPEC.build(tiny()).double()
    samples = torch.randint(3, 97, (2, 12)).numpy()
    samples[0, 5] = 2  # an EOD inside the first sample
    doc_ids = (samples == 2).cumsum(1) - (samples == 2)
    batch = collate((samples, doc_ids.astype("int32")), eod_id=2)
    loss, diagnostics = model(batch)
    logits = model.head.logits(model.hidden(batch.tokens, batch.positions))
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    mask = batch.loss_mask.flatten()
    assert mask.sum() == 21  # 22 targets, one after the EOD masked
    torch.testing.assert_close(loss, per_token[mask].mean())
    assert diagnostics == {}


def test_bf16_forward_and_backward_run_on_cpu():
    torch.manual_seed(3)
    model = SPEC.build(tiny())
    samples = torch.randint(3, 97, (2, 17)).numpy()
    batch = collate((samples, torch.zeros(2, 17, dtype=torch.int32).numpy()), eod_id=None)
    ref, _ = model(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(batch)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    "kw, message",
    [(dict(d_model=30), "not divisible by model.n_heads"), (dict(n_layers=0), "model.n_layers must be positive"),
     (dict(d_model=36, n_heads=12), "must be even for RoPE"),
     (dict(n_kv_heads=3), "model.n_kv_heads 3 must divide model.n_heads 4"),
     (dict(n_kv_heads=8), "model.n_kv_heads 8 must divide model.n_heads 4"),
     (dict(n_kv_heads=-2), "model.n_kv_heads -2 must divide model.n_heads 4"),
     (dict(document_mask=True, eos_id=97), "model.eos_id 97 must be a token id below model.vocab_size 97")],
)
def test_bad_model_config_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw).validate()


def test_document_masks_need_the_tokenizers_eos(tmp_path):
    """Inference reads documents off the tokens by model.eos_id: with model.document_mask it must be the
    tokenizer's EOS (checked when the run's config is validated, as SPS checks its ids)."""
    from pretrain.config import load_config
    from trainer_helpers import write_word_tokenizer

    over = ["model.vocab_size=64", "data.train=[]", f"data.tokenizer={write_word_tokenizer(tmp_path / 't.json')}"]
    with pytest.raises(ValueError, match=r"model.eos_id 5 is not data.tokenizer's end-of-document id 2; set model.eos_id=2$"):
        load_config("baseline/tiny", over + ["model.document_mask=true", "model.eos_id=5"], check_data=False)
    assert load_config("baseline/tiny", over + ["model.document_mask=true"], check_data=False).model.eos_id == 2
    assert load_config("baseline/tiny", over + ["model.eos_id=5"], check_data=False)  # no documents: not read


def test_generation_past_max_seq_len_is_refused():
    model = SPEC.build(tiny(max_seq_len=8)).eval()
    state = SPEC.new_state(model, 1)
    with torch.no_grad(), pytest.raises(ValueError, match="exceed model.max_seq_len 8"):
        SPEC.step(model, torch.zeros(1, 9, dtype=torch.long), state)


def test_sliding_window_limits_attention_and_decode_follows_it():
    """model.window: streaming decode equals the parallel forward, and a token outside every
    position's window (reached only through layers) does not change the first layer's view: with one
    layer, the last position's logits ignore tokens more than `window` back, which full attention sees."""
    torch.manual_seed(2)
    model = SPEC.build(tiny(window=4, n_layers=1)).double().eval()
    tokens = torch.randint(0, 97, (2, 15))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 97  # 9 positions before the last: outside a window of 4
    with torch.no_grad():
        full = SPEC.logits(model, tokens)
        state = SPEC.new_state(model, 2)
        streamed = torch.cat([SPEC.step(model, tokens[:, :6], state)[0]]
                             + [SPEC.step(model, tokens[:, t : t + 1], state)[0] for t in range(6, 15)], dim=1)
        torch.testing.assert_close(streamed, full, rtol=0, atol=1e-10)
        torch.testing.assert_close(SPEC.logits(model, changed)[:, -1], full[:, -1], rtol=0, atol=1e-12)
        unwindowed = SPEC.build(tiny(n_layers=1)).double().eval()
        unwindowed.load_state_dict(model.state_dict())
        assert not torch.allclose(SPEC.logits(unwindowed, changed)[:, -1], SPEC.logits(unwindowed, tokens)[:, -1])
    with pytest.raises(ValueError, match="model.window must be >= 0"):
        tiny(window=-1).validate()


# --- grouped-query attention: model.n_kv_heads key/value heads shared by the n_heads query heads ---


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_gqa_cached_decode_equals_full_forward(n_kv_heads):
    torch.manual_seed(4)
    model = SPEC.build(tiny(n_kv_heads=n_kv_heads)).double().eval()
    tokens = torch.randint(0, 97, (3, 19))
    with torch.no_grad():
        full = SPEC.logits(model, tokens)
        state = SPEC.new_state(model, 3)
        pieces = [SPEC.step(model, tokens[:, :7], state)[0]]
        for t in range(7, 19):
            pieces.append(SPEC.step(model, tokens[:, t : t + 1], state)[0])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)
    # the cache holds the kv heads only: GQA's decode memory saving
    assert all(t.shape == (3, n_kv_heads, 64, 8) for t in state.k + state.v)


def test_gqa_changes_the_model():
    """Fewer kv heads give another function (not a relabelled MHA); n_kv_heads = n_heads is the
    default model itself (same draws, same names, same outputs)."""
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    outs = {}
    for kv in (0, 4, 2):
        torch.manual_seed(5)
        model = SPEC.build(tiny(n_kv_heads=kv)).double().eval()
        with torch.no_grad():
            outs[kv] = (model.state_dict(), SPEC.logits(model, tokens))
    assert outs[0][0].keys() == outs[4][0].keys()
    assert all(torch.equal(outs[0][0][k], outs[4][0][k]) for k in outs[0][0])
    assert torch.equal(outs[0][1], outs[4][1])
    assert not torch.allclose(outs[2][1], outs[0][1])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_gqa_parameter_count_and_flops(n_kv_heads):
    d, L, head_dim = 32, 2, 8
    model = SPEC.build(tiny(n_kv_heads=n_kv_heads))
    attn = model.blocks[0].attn
    assert attn.q.weight.shape == (d, d) and attn.kv.weight.shape == (2 * n_kv_heads * head_dim, d)
    assert {k for k in model.state_dict() if k.startswith("blocks.0.attn.")} == {
        "blocks.0.attn.q.weight", "blocks.0.attn.kv.weight", "blocks.0.attn.proj.weight"}
    mha = count_parameters(SPEC.build(tiny()))["total"]
    fewer = L * 2 * d * (4 - n_kv_heads) * head_dim  # k and v lose (4 - n_kv_heads) heads of d x head_dim
    assert count_parameters(model)["total"] == mha - fewer
    flops = SPEC.flops_per_token(tiny(n_kv_heads=n_kv_heads), 16)
    assert flops == SPEC.flops_per_token(tiny(), 16) - 6.0 * fewer  # matmul weights only: the head is tied
    assert "2 d d_kv" in SPEC.flops_formula and "n_kv_heads" in SPEC.flops_formula


def test_tensor_parallelism_must_divide_the_kv_heads():
    from pretrain.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="parallel.tp=2 does not divide model.n_kv_heads = 1"):
        load_config("baseline/tiny", ["parallel.tp=2", "model.n_kv_heads=1"], check_data=False)
    assert load_config("baseline/tiny", ["parallel.tp=2", "model.n_kv_heads=2"], check_data=False).model.kv_heads == 2
    assert SPEC.tp_dims(tiny())["model.n_kv_heads"] == 4  # 0: as many as n_heads


def _gqa_model_and_batch():
    """A tiny GQA model (4 query heads, 2 kv heads) from seed 0, in float64, and a fixed packed batch."""
    torch.manual_seed(0)
    model = SPEC.build(tiny(vocab_size=96, n_kv_heads=2, document_mask=True)).double()  # TP2 splits the vocabulary
    samples = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(1)).numpy()
    samples[1, 6] = 2  # an EOD: two documents in the second row
    doc_ids = (samples == 2).cumsum(1) - (samples == 2)
    return model, collate((samples, doc_ids.astype("int32")), eod_id=2)


def _tp_loss_and_grads(rank, world_size):
    import parallel.mesh as mesh
    from parallel.engine import gather_full
    from parallel.layers import is_tensor_parallel
    from pretrain.config import ParallelConfig

    mesh.setup_layout(ParallelConfig(tp=world_size))
    try:
        model, batch = _gqa_model_and_batch()
        kv = model.blocks[0].attn.kv.weight
        local_kv_heads = kv.shape[0] // (2 * 8)
        loss, _ = model(batch)
        loss.backward()
        grads = {n: gather_full(p.grad, p) if is_tensor_parallel(p) else p.grad for n, p in model.named_parameters()}
        return loss.item(), {n: g.numpy() for n, g in grads.items()}, local_kv_heads
    finally:
        mesh.teardown_layout()


def test_gqa_under_tensor_parallelism_equals_one_process():
    """TP2 splits the 2 kv heads (one per rank, k and v each) with the 4 query heads (two per rank):
    the loss and every gradient, gathered, equal one process's."""
    pytest.importorskip("megatron.core", reason="tensor parallelism needs megatron-core")
    from distributed import run_ranks

    model, batch = _gqa_model_and_batch()
    loss, _ = model(batch)
    loss.backward()
    want = {n: p.grad.numpy() for n, p in model.named_parameters()}
    results = run_ranks(_tp_loss_and_grads, 2, env={"DS_ACCELERATOR": "cpu"}, timeout=300)
    for tp_loss, grads, local_kv_heads in results:
        assert local_kv_heads == 1
        # float64 everywhere but megatron's head, which makes float32 logits: ~1e-8 differences
        assert tp_loss == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(torch.from_numpy(grads[name]), torch.from_numpy(g), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")
