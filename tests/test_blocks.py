"""The shared blocks (pretrain/models/blocks.py): RoPE tables in the model's dtype (float64 in float64),
every block option through the decoder skeleton (streaming decode equal to the parallel forward in
float64: QK-norm, ALiBi, no positions, LayerNorm, GELU, biases, GQA), cross-attention, and the old
fused-qkv checkpoints."""
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from kernels.attention import causal, reference
from pretrain.models import blocks, get_arch
from pretrain.models.decoder import Decoder, DecoderConfig


def tiny(**fields):
    values = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=40)
    return get_arch("baseline").config_cls(**{**values, **fields})


def test_rope_tables_are_float64_in_a_float64_model():
    model = get_arch("baseline").build(tiny()).double()
    dh, T = 8, 40
    freqs = 1.0 / 10000.0 ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None]
    assert model.rope.cos.dtype == torch.float64
    torch.testing.assert_close(model.rope.cos, angles.cos(), rtol=0, atol=1e-15)
    torch.testing.assert_close(model.rope.sin, angles.sin(), rtol=0, atol=1e-15)
    # float32 tables are the float64 values rounded once (what the golden curves were recorded with),
    # and a float64 model cast back gets exactly those again
    back = model.float()
    assert torch.equal(back.rope.cos, angles.cos().float()) and torch.equal(back.rope.sin, angles.sin().float())
    assert torch.equal(get_arch("baseline").build(tiny()).rope.cos, angles.cos().float())


@dataclass
class OptionsConfig(DecoderConfig):
    """A decoder whose blocks take arbitrary options (a test-only config, not registered)."""

    arch: str = "baseline"
    overrides: tuple = ()

    def block_options(self, depth):
        return replace(super().block_options(depth), **dict(self.overrides))


class Stack(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(blocks.Block(cfg.block_options(cfg.n_layers)) for _ in range(cfg.n_layers))

    def applications(self):
        return list(self.blocks)


OPTIONS = {
    "alibi+qk_head": dict(positions="alibi", qk_norm="head"),
    "alibi+qk_full+layernorm+gelu": dict(positions="alibi", qk_norm="full", norm="layer", mlp="gelu", bias=True),
    "nope+gqa": dict(positions="none", kv_heads=2),
    "rope+qk_full": dict(qk_norm="full", kv_heads=2),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_every_block_option_decodes_exactly(name):
    fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=40)
    cfg = OptionsConfig(**fields, overrides=tuple(OPTIONS[name].items()))
    torch.manual_seed(0)
    model = Stack(cfg).double().eval()
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(tokens)
        state = model.new_state(2)
        pieces = [model.step(tokens[:, :3], state)[0]] + [model.step(tokens[:, t:t + 1], state)[0] for t in range(3, 11)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)
    names = set(model.state_dict())
    if "qk" in name:
        assert "blocks.0.attn.q_norm.weight" in names and "blocks.0.attn.k_norm.weight" in names
    if "alibi" in name or "nope" in name:
        assert model.rope is None


def test_cross_attention_reads_given_keys_and_values():
    o = blocks.BlockOptions(d_model=16, n_heads=4, kv_heads=2, ffn=32, positions="none")
    torch.manual_seed(0)
    att = blocks.Attention(o, cross=True).double()
    assert not hasattr(att, "kv")
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
    got = att(x, blocks.Attend(causal()), kv=(k, v))
    q = att.q(x).unflatten(-1, (4, 4)).transpose(1, 2)
    want = att.proj(reference.attention(q, k, v, causal()).transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bad_options_are_one_sentence():
    with pytest.raises(ValueError, match="block option qk_norm must be one of none, head, full, got 'both'"):
        blocks.Attention(blocks.BlockOptions(d_model=16, n_heads=4, kv_heads=4, ffn=32, qk_norm="both"))
    with pytest.raises(ValueError, match="must be even for RoPE"):
        get_arch("baseline").build(tiny(d_model=36, n_heads=4))


def test_fused_qkv_checkpoints_are_split():
    cfg = tiny()
    state = get_arch("baseline").build(cfg).state_dict()
    old = {k: v for k, v in state.items() if ".attn.q." not in k and ".attn.kv." not in k}
    for i in range(2):
        old[f"blocks.{i}.attn.qkv.weight"] = torch.cat([state[f"blocks.{i}.attn.q.weight"],
                                                       state[f"blocks.{i}.attn.kv.weight"]])
    upgraded = blocks.upgrade_attention_state(old, cfg)
    assert sorted(upgraded) == sorted(state) and all(torch.equal(upgraded[k], state[k]) for k in state)


def test_the_truncated_normal_init_is_the_same_on_every_torch():
    """parallel/layers.trunc_normal_ (the mitchell and lecun inits): inside the bounds, spread like a
    truncated normal, and, since it does not call nn.init.trunc_normal_ (whose method changed between torch
    2.11 and 2.13, moving RT's and GPN's golden curves), the same draws wherever torch's normal_ is. Where
    torch's own is this same rejection method (2.13), it equals it draw for draw."""
    from parallel.layers import trunc_normal_

    def draw(fill):
        torch.manual_seed(3)
        return fill(torch.empty(256, 96)), torch.rand(1)  # and what the generator gives next

    ours, after = draw(lambda w: trunc_normal_(w, 0.02, 2.0))
    assert ours.abs().max() <= 0.04 and ((ours.abs() > 0.038).float().mean() > 0)  # fills up to the bound
    assert abs(ours.std().item() / 0.02 - 0.880) < 0.02  # a normal truncated at 2 sigma has std 0.880 sigma
    torch.manual_seed(3)
    plain = torch.empty(256, 96).normal_(0.0, 0.02)
    inside = plain.abs() <= 0.04
    assert torch.equal(ours[inside], plain[inside])  # first draws kept, only those outside drawn again
    if tuple(int(n) for n in torch.__version__.split(".")[:2]) == (2, 13):  # the torch CI pins
        theirs, their_after = draw(lambda w: nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04))
        assert torch.equal(ours, theirs) and torch.equal(after, their_after)
