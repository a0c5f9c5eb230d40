"""Recompute policies of both kinds (parallel/recompute.py's Recompute): one that wraps modules in
activation checkpointing, and one that configures the model to recompute by itself. The test
architecture here is a small recurrent net whose `configure` policy sets a segment length its own
time loop reads: it then checkpoints the loop every S steps (what a recurrent architecture that
recomputes by time segments does), which no list of modules to wrap can express. parallelize applies
either kind; `pretrain info` lists both; validation accepts both."""
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from parallel.apply import parallelize
from parallel.engine import EngineSettings
from parallel.mesh import teardown_layout
from parallel.recompute import Recompute, as_policy
from pretrain.cli import main
from pretrain.config import ConfigError, load_config
from pretrain.models import get_arch, registry
from pretrain.models.base import EVAL, ModelConfig, StepContext

T, SEGMENT = 12, 4


@dataclass
class SegmentedConfig(ModelConfig):
    arch: str = "test_segmented"
    d_model: int = 8


class Segmented(nn.Module):
    """h_t = tanh(cell(h_{t-1}) + embed(x_t)), logits_t = head(h_t). `segment` (0: none) is the flag its
    `configure` policy sets: the time loop then runs in checkpointed segments of that many steps,
    keeping only each segment's first state."""

    def __init__(self, cfg: SegmentedConfig):
        super().__init__()
        cfg.validate()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.cell = nn.Linear(cfg.d_model, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.segment = 0
        self.segments_run = 0  # calls of _run: forward and recomputation

    def _run(self, h, xs):
        self.segments_run += 1
        outs = []
        for t in range(xs.shape[1]):
            h = torch.tanh(self.cell(h) + xs[:, t])
            outs.append(h)
        return h, torch.stack(outs, 1)

    def forward(self, batch, ctx=EVAL):
        xs = self.embed(batch.tokens)
        h, pieces = xs.new_zeros(xs.shape[0], xs.shape[2]), []
        length = self.segment or xs.shape[1]
        for s in range(0, xs.shape[1], length):
            if self.segment and torch.is_grad_enabled():
                h, out = checkpoint(self._run, h, xs[:, s:s + length], use_reentrant=False)
            else:
                h, out = self._run(h, xs[:, s:s + length])
            pieces.append(out)
        logits = self.head(torch.cat(pieces, 1))
        losses = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
        mask = batch.loss_mask.flatten().to(losses.dtype)
        return (losses * mask).sum() / mask.sum(), {}


def set_segment(length: int, model: Segmented) -> None:
    model.segment = length


SPEC = registry.ArchSpec(
    name="test_segmented", config_cls=SegmentedConfig, build=Segmented,
    flops_per_token=lambda cfg, seq_len, ctx=None: 6.0 * (cfg.d_model * cfg.d_model + 2 * cfg.vocab_size * cfg.d_model),
    flops_formula="6 (d^2 + 2 V d)",
    # segments: the model checkpoints its own time loop (the recommended one, so also `full`);
    # cell: the cell wrapped from outside, recomputed at every step
    recompute_units={"segments": Recompute(configure=partial(set_segment, SEGMENT)),
                     "cell": lambda model: [model.cell]})


@pytest.fixture
def segmented(monkeypatch, tmp_path):
    """The test architecture, registered for this test only (the registry-wide tests do not see it);
    its run config's path."""
    get_arch("baseline")  # discovery first, so the registry is complete before the patch
    monkeypatch.setitem(registry._REGISTRY, SPEC.name, SPEC)
    path = tmp_path / "segmented.yaml"
    path.write_text("model:\n  arch: test_segmented\n  vocab_size: 16\n  max_seq_len: 32\n  d_model: 8\n"
                    "data:\n  seq_len: 12\n")
    return str(path)


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (3, T), generator=g)
    return SimpleNamespace(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(3, T, dtype=torch.bool))


def grads(model) -> dict:
    model.zero_grad()
    model(batch(), StepContext())[0].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_policy_is_one_of_two_kinds():
    with pytest.raises(ValueError, match="exactly one of wrap="):
        Recompute()
    with pytest.raises(ValueError, match="exactly one of wrap="):
        Recompute(wrap=list, configure=list)
    units = lambda model: []  # noqa: E731
    assert as_policy(units) == Recompute(wrap=units) and as_policy(units).kind == "wrap"
    policies = SPEC.recompute_policies()
    assert list(policies) == ["full", "segments", "cell"] and policies["full"] is policies["segments"]
    assert policies["segments"].kind == "configure" and policies["cell"].kind == "wrap"
    assert get_arch("baseline").recompute_policies()["full"].kind == "wrap"  # a bare function: wrap, as before


@pytest.mark.parametrize("policy", ["segments", "cell"])
def test_parallelize_applies_either_kind_and_the_gradients_do_not_change(segmented, policy):
    cfg = load_config(segmented, [f"parallel.recompute={policy}"], check_data=False)

    def build():
        torch.manual_seed(0)
        return SPEC.build(cfg.model).double()

    plain = build()
    want = grads(plain)
    assert plain.segments_run == 1  # the whole loop at once, nothing recomputed
    try:
        engine = parallelize(build, EngineSettings.from_run(cfg), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             SPEC.recompute_policies()[cfg.parallel.recompute])
        model = engine.model
        got = grads(model)
    finally:
        teardown_layout()
    if policy == "segments":  # the flag is set, and the loop ran as T / S segments, each recomputed once
        assert model.segment == SEGMENT and model.segments_run == 2 * T // SEGMENT
        assert not getattr(model.cell, "_recompute_wrapped", False)
    else:
        assert model.segment == 0 and model.cell._recompute_wrapped
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-14, msg=name)


def test_info_and_validation_accept_both_kinds(segmented, capsys):
    for policy in ("none", "full", "segments", "cell"):
        assert load_config(segmented, [f"parallel.recompute={policy}"], check_data=False).parallel.recompute == policy
    with pytest.raises(ConfigError, match="parallel.recompute=pass: model.arch 'test_segmented' offers full, "
                                          "segments, cell"):
        load_config(segmented, ["parallel.recompute=pass"], check_data=False)
    assert main(["info", segmented]) == 0
    out = capsys.readouterr().out
    assert ("activation recompute (parallel.recompute): none, full (the model's own), segments (the model's own), "
            "cell") in out
