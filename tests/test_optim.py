"""Learning-rate schedules, config validation, parameter groups, AdamW construction and clipping."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrain import optim as optim_mod
from pretrain.optim import (
    OptimConfig,
    ScheduleConfig,
    build_optimizer,
    clip_grad_norm,
    fused_unsupported_reason,
    lr_at,
    lr_at_tokens,
    param_groups,
    set_lr,
)

OPT = OptimConfig(lr=1e-3, min_lr=1e-4)


def schedule(kind, total, warmup=10, decay_fraction=0.1):
    cfg = ScheduleConfig(kind=kind, warmup_steps=warmup, decay_fraction=decay_fraction)
    cfg.validate(total)
    return [lr_at(s, total, OPT, cfg) for s in range(total)]


@pytest.mark.parametrize("kind", ["wsd", "cosine", "constant"])
def test_warmup_starts_nonzero_and_is_linear(kind):
    lrs = schedule(kind, 100, warmup=10)
    assert lrs[0] == pytest.approx(OPT.lr / 10) and lrs[0] > 0
    assert lrs[:10] == pytest.approx([OPT.lr * (s + 1) / 10 for s in range(10)])
    assert lrs[9] == OPT.lr and lrs[10] == OPT.lr  # warmup ends exactly at lr, the next step starts there


def test_wsd_plateau_then_linear_decay_to_min_lr_at_the_last_step():
    lrs = schedule("wsd", 100, warmup=10, decay_fraction=0.2)  # decay over steps 80..99
    assert all(lr == OPT.lr for lr in lrs[9:80])
    decay = lrs[80:]
    assert decay[0] < OPT.lr
    assert decay[-1] == OPT.min_lr  # exactly, not approximately
    diffs = [a - b for a, b in zip(decay, decay[1:])]
    assert diffs == pytest.approx([(OPT.lr - OPT.min_lr) / 20] * 19)  # linear
    assert lr_at(150, 100, OPT, ScheduleConfig("wsd", 10, 0.2)) == OPT.min_lr  # past the end: stays


def test_wsd_decay_never_overlaps_warmup():
    lrs = schedule("wsd", 20, warmup=15, decay_fraction=1.0)
    assert lrs[14] == OPT.lr
    assert all(a > b for a, b in zip(lrs[14:], lrs[15:])) and lrs[-1] == OPT.min_lr


def test_cosine_monotone_after_warmup_and_ends_at_min_lr():
    lrs = schedule("cosine", 100, warmup=10)
    after = lrs[10:]
    assert after[0] == OPT.lr and after[-1] == OPT.min_lr
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lrs[10 + 89 // 2] == pytest.approx((OPT.lr + OPT.min_lr) / 2, rel=0.02)  # halfway point
    assert schedule("cosine", 11, warmup=10)[-1] == OPT.min_lr  # a single post-warmup step


def test_constant_and_no_warmup():
    assert schedule("constant", 50, warmup=5)[5:] == [OPT.lr] * 45
    assert schedule("constant", 5, warmup=0) == [OPT.lr] * 5
    assert schedule("cosine", 5, warmup=0)[0] == OPT.lr


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["wsd", "cosine", "constant"]),
    total=st.integers(1, 400),
    warmup_frac=st.floats(0, 0.99),
    decay_fraction=st.floats(0.01, 1.0),
)
def test_schedule_properties(kind, total, warmup_frac, decay_fraction):
    warmup = int(warmup_frac * total)
    lrs = schedule(kind, total, warmup, decay_fraction)
    assert all(0 < lr <= OPT.lr for lr in lrs)
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))  # then never rises
    if kind != "constant" and warmup < total:
        assert lrs[-1] == OPT.min_lr


def test_resumed_schedule_equals_uninterrupted_and_set_lr_reaches_every_group():
    cfg, total = ScheduleConfig("wsd", 10, 0.3), 60
    uninterrupted = [lr_at(s, total, OPT, cfg) for s in range(total)]
    resumed = [lr_at(s, total, OPT, ScheduleConfig("wsd", 10, 0.3)) for s in range(37, total)]
    assert resumed == uninterrupted[37:]

    opt = build_optimizer(TiedModel(), OPT)
    assert len(opt.param_groups) == 2
    set_lr(opt, resumed[0])
    assert [g["lr"] for g in opt.param_groups] == [uninterrupted[37]] * 2


def test_set_lr_keeps_a_tensor_lr_in_place():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(1e-3))
    lr_tensor = opt.param_groups[0]["lr"]
    set_lr(opt, 5e-4)
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(5e-4)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": 0.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"min_lr": 1.0}, "min_lr"),  # above lr
        ({"min_lr": -1e-5}, "min_lr"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"fused": "yes"}, "fused"),
    ],
)
def test_optim_validation_names_the_field_in_one_line(changes, field):
    with pytest.raises(ValueError) as err:
        OptimConfig(**changes).validate()
    msg = str(err.value)
    assert msg.startswith(f"optim.{field} ") and "\n" not in msg
    assert repr(next(iter(changes.values()))) in msg or str(next(iter(changes.values()))) in msg


@pytest.mark.parametrize(
    "changes, total, field",
    [
        ({"kind": "linear"}, 100, "kind"),
        ({"warmup_steps": -1}, 100, "warmup_steps"),
        ({"warmup_steps": 100}, 100, "warmup_steps"),
        ({"warmup_steps": 2.5}, 100, "warmup_steps"),
        ({"decay_fraction": 0.0}, 1000, "decay_fraction"),
        ({"decay_fraction": 1.5}, 1000, "decay_fraction"),
    ],
)
def test_schedule_validation_names_the_field_in_one_line(changes, total, field):
    with pytest.raises(ValueError) as err:
        ScheduleConfig(**changes).validate(total)
    msg = str(err.value)
    assert msg.startswith(f"schedule.{field} ") and "\n" not in msg


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'wsd', 'cosine', 'constant', got 'linear'"):
        ScheduleConfig(kind="linear").validate(100)
    with pytest.raises(ValueError, match="schedule.kind"):
        lr_at(50, 100, OPT, ScheduleConfig(kind="linear", warmup_steps=0))
    OptimConfig().validate()
    ScheduleConfig().validate(1000)


class TiedModel(torch.nn.Module):
    """An embedding tied to the output head, a bias-free Linear, a biased Linear, a norm, a frozen buffer-like param."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.mix = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4, bias=False)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)

    def forward(self, ids):
        return self.head(self.norm(self.mix(self.proj(self.embed(ids)))))


def test_param_groups_split_matrices_and_vectors_each_once():
    model = TiedModel()
    decay, no_decay = param_groups(model, 0.1)
    assert set(decay) == {"params", "weight_decay"} and decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0
    ids = lambda ps: [id(p) for p in ps]  # noqa: E731 (tensors compare elementwise, so compare ids)
    assert ids(decay["params"]) == ids([model.embed.weight, model.proj.weight, model.mix.weight])
    assert ids(no_decay["params"]) == ids([model.mix.bias, model.norm.weight])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(ids(decay["params"] + no_decay["params"])) == sorted(ids(trainable))
    assert len(set(ids(decay["params"] + no_decay["params"]))) == len(trainable)


def test_param_groups_refuses_a_fully_frozen_model():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model, 0.1)


def train_step(fused):
    torch.manual_seed(0)
    model = TiedModel()
    opt = build_optimizer(model, OptimConfig(fused=fused))
    before = model.embed.weight.detach().clone()
    model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum().backward()
    clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    assert not torch.equal(before, model.embed.weight)
    return opt, model


def test_build_optimizer_auto_picks_fused_on_cpu_when_available():
    opt, _ = train_step(None)
    expect_fused = fused_unsupported_reason([torch.zeros(1)]) is None
    assert all(g["fused"] is expect_fused for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["eps"] == 1e-8


def test_build_optimizer_fused_true_matches_foreach():
    reason = fused_unsupported_reason([torch.zeros(1)])
    if reason is not None:
        pytest.skip(f"fused=True needs the missing capability: {reason}")
    fused_opt, fused_model = train_step(True)
    foreach_opt, foreach_model = train_step(False)
    assert fused_opt.param_groups[0]["fused"] and foreach_opt.param_groups[0]["foreach"]
    for a, b in zip(fused_model.parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b)


def test_fused_falls_back_or_refuses_without_kernels(monkeypatch):
    monkeypatch.setattr(optim_mod, "_fused_devices", lambda: frozenset({"cuda"}))
    opt = build_optimizer(TiedModel(), OptimConfig(fused=None))
    assert not opt.param_groups[0]["fused"] and opt.param_groups[0]["foreach"]
    with pytest.raises(ValueError, match=r"^optim\.fused=true cannot be honoured: .*no fused AdamW kernel for cpu"):
        build_optimizer(TiedModel(), OptimConfig(fused=True))


def with_grads(*shapes, scale=1.0, dtype=torch.float32):
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype) * scale
    return params


def manual_norm(params):
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


def test_clip_grad_norm_reports_the_norm_and_clips():
    params = with_grads((3, 4), (5,), (2, 2), scale=10.0)
    params.append(torch.nn.Parameter(torch.ones(3)))  # no grad: ignored
    expected = manual_norm(params)
    assert expected > 1.0
    norm = clip_grad_norm(params, 1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(expected, rel=1e-6)
    assert manual_norm(params) == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norm_leaves_small_or_unclipped_grads_alone():
    params = with_grads((3, 4), (5,), scale=0.01)
    grads = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(manual_norm(params), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))

    params = with_grads((3, 4), (5,), scale=10.0)
    grads = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 0.0)  # 0 disables clipping but still measures
    assert norm.item() == pytest.approx(manual_norm(params), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def test_clip_grad_norm_edge_cases():
    norm = clip_grad_norm(with_grads((8,), dtype=torch.bfloat16), 0.0)
    assert norm.dtype == torch.float32
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(with_grads((2,)), -1.0)


# The SPS paper's T10 recipe (spec numbers): WSD counted in tokens seen, 393,216 tokens per step.
T10 = OptimConfig(lr=6e-4, min_lr=6e-5)
T10_SCHEDULE = ScheduleConfig(kind="wsd_tokens", warmup_tokens=50_000_000, decay_tokens=2_000_000_000,
                              total_tokens=20_000_000_000)
T10_TOKENS_PER_STEP = 393_216
T10_STEPS = 50_863  # ceil(20e9 / 393216)


def t10_lr(step):
    return lr_at(step, T10_STEPS, T10, T10_SCHEDULE, tokens_per_step=T10_TOKENS_PER_STEP)


def t10_lr_at_tokens(tokens):
    return lr_at_tokens(tokens, T10_SCHEDULE.total_tokens, T10, T10_SCHEDULE)


def test_wsd_tokens_t10_recipe_numbers():
    T10_SCHEDULE.validate(T10_STEPS, T10_TOKENS_PER_STEP)
    assert math.ceil(20e9 / T10_TOKENS_PER_STEP) == T10_STEPS
    assert t10_lr(1000) == 6e-4
    assert t10_lr_at_tokens(19_000_000_000) == pytest.approx(3.3e-4, rel=1e-12)
    assert t10_lr_at_tokens(20_000_000_000) == 6e-5 and t10_lr_at_tokens(25_000_000_000) == 6e-5  # exactly
    assert t10_lr(T10_STEPS) == 6e-5 and t10_lr(T10_STEPS + 100) == 6e-5  # past the end: stays at min_lr
    # the last update, step 50,862, sees 19,999,752,192 tokens
    assert t10_lr(T10_STEPS - 1) == pytest.approx(6e-5 + 5.4e-4 * 247_808 / 2e9, rel=1e-9)
    assert t10_lr(T10_STEPS - 1) == pytest.approx(6.0067e-5, rel=1e-5)
    # the decay starts after 18e9 tokens: step 45,776 (17,999,855,616 tokens) is the last at the peak
    assert 45_776 * T10_TOKENS_PER_STEP == 17_999_855_616
    assert t10_lr(45_776) == 6e-4 and t10_lr_at_tokens(18_000_000_000) == 6e-4
    assert t10_lr(45_777) < 6e-4
    assert t10_lr(45_777) == pytest.approx(6e-5 + 5.4e-4 * 1_999_751_168 / 2e9, rel=1e-9)
    assert t10_lr(45_777) == pytest.approx(5.9993e-4, rel=1e-5)


def test_wsd_tokens_warmup_from_zero_then_plateau_then_linear_decay():
    assert t10_lr(0) == 0.0  # tokens seen at step 0: none
    warmup = [t10_lr(s) for s in range(128)]  # 50e6 / 393216 = 127.2: steps 0..127 are in warmup
    assert warmup == pytest.approx([6e-4 * s * T10_TOKENS_PER_STEP / 50e6 for s in range(128)], rel=1e-12)
    assert all(a < b for a, b in zip(warmup, warmup[1:])) and warmup[-1] < 6e-4
    assert t10_lr(128) == 6e-4 and t10_lr_at_tokens(50_000_000) == 6e-4
    assert t10_lr_at_tokens(25_000_000) == pytest.approx(3e-4, rel=1e-12)
    decay = [t10_lr(s) for s in range(45_777, T10_STEPS)]
    diffs = [a - b for a, b in zip(decay, decay[1:])]
    assert diffs == pytest.approx([5.4e-4 * T10_TOKENS_PER_STEP / 2e9] * len(diffs), rel=1e-6)  # linear
    assert all(6e-5 < lr < 6e-4 for lr in decay)


def test_wsd_tokens_without_total_tokens_ends_at_max_steps_and_resumes():
    cfg = ScheduleConfig(kind="wsd_tokens", warmup_tokens=10 * 64, decay_tokens=20 * 64)  # total: 100 x 64
    cfg.validate(100, 64)
    lrs = [lr_at(s, 100, OPT, cfg, tokens_per_step=64) for s in range(100)]
    assert lrs[0] == 0.0 and lrs[10] == OPT.lr and lrs[80] == OPT.lr and lrs[81] < OPT.lr
    assert lrs[99] == pytest.approx(OPT.min_lr + (OPT.lr - OPT.min_lr) / 20, rel=1e-12)
    assert lr_at(100, 100, OPT, cfg, tokens_per_step=64) == OPT.min_lr
    resumed = [lr_at(s, 100, OPT, ScheduleConfig(**vars(cfg)), tokens_per_step=64) for s in range(37, 100)]
    assert resumed == lrs[37:]  # a pure function of the step


def test_wsd_tokens_needs_tokens_per_step():
    with pytest.raises(ValueError, match="^tokens_per_step .* with schedule.kind=wsd_tokens, got None$"):
        lr_at(5, T10_STEPS, T10, T10_SCHEDULE)
    with pytest.raises(ValueError, match="^tokens_per_step .* with schedule.kind=wsd_tokens, got None$"):
        T10_SCHEDULE.validate(T10_STEPS)
    assert lr_at(5, 100, OPT, ScheduleConfig("wsd", 10, 0.2), tokens_per_step=64) == lr_at(
        5, 100, OPT, ScheduleConfig("wsd", 10, 0.2))  # the step kinds ignore it


@pytest.mark.parametrize(
    "changes, steps, field, says",
    [
        ({"decay_tokens": 0}, T10_STEPS, "schedule.decay_tokens", "must be positive"),
        ({"warmup_tokens": -1}, T10_STEPS, "schedule.warmup_tokens", "non-negative integer"),
        ({"total_tokens": -5}, T10_STEPS, "schedule.total_tokens", "non-negative integer"),
        ({"warmup_tokens": 1.5e7}, T10_STEPS, "schedule.warmup_tokens", "non-negative integer"),
        ({"warmup_tokens": 18_000_000_001}, T10_STEPS, "schedule.warmup_tokens + schedule.decay_tokens",
         "must not exceed the 20000000000 total tokens (schedule.total_tokens)"),
        ({"total_tokens": 0, "decay_tokens": 200 * T10_TOKENS_PER_STEP}, 100,
         "schedule.warmup_tokens + schedule.decay_tokens", "train.max_steps x tokens per step = 100 x 393216"),
        ({}, 50_862, "train.max_steps", "= 50863 with schedule.kind=wsd_tokens, got 50862; set train.max_steps=50863"),
        ({}, 50_864, "train.max_steps", "got 50864; set train.max_steps=50863"),
    ],
)
def test_wsd_tokens_validation_names_the_field_in_one_line(changes, steps, field, says):
    cfg = ScheduleConfig(**{**vars(T10_SCHEDULE), **changes})
    with pytest.raises(ValueError) as err:
        cfg.validate(steps, T10_TOKENS_PER_STEP)
    msg = str(err.value)
    assert msg.startswith(f"{field} ") and says in msg and "\n" not in msg


@pytest.mark.parametrize("field", ["warmup_tokens", "decay_tokens", "total_tokens"])
def test_token_fields_are_refused_with_the_step_kinds(field):
    with pytest.raises(ValueError, match=f"^schedule.{field} is used by schedule.kind=wsd_tokens only"):
        ScheduleConfig(kind="wsd", **{field: 1000}).validate(100, 64)


# OLMo's CosWithWarmup, the RT paper's schedule: warmup from warmup_start x lr, cosine to min_lr at T.
def warmup_cosine(total, warmup, start=0.1, optim=OPT):
    cfg = ScheduleConfig(kind="warmup_cosine", warmup_steps=warmup, warmup_start=start)
    cfg.validate(total)
    return [lr_at(s, total, optim, cfg) for s in range(total)], cfg


def test_warmup_cosine_exact_values():
    lrs, cfg = warmup_cosine(1000, 400)  # W = 400, cosine over 600 steps
    lr, min_lr = OPT.lr, OPT.min_lr
    assert lrs[0] == 0.1 * lr  # exactly
    assert lrs[200] == pytest.approx(0.55 * lr, rel=1e-15)
    assert lrs[:400] == pytest.approx([lr * (0.1 + 0.9 * s / 400) for s in range(400)], rel=1e-15)  # linear
    assert all(a < b for a, b in zip(lrs[:401], lrs[1:401])) and lrs[399] < lr
    assert lrs[400] == lr  # exactly: the peak, reached at step W
    assert lrs[700] == pytest.approx(min_lr + (lr - min_lr) / 2, rel=1e-14)  # midway through the cosine
    assert lrs[400:] == pytest.approx(
        [min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (s - 400) / 600)) / 2 for s in range(400, 1000)], rel=1e-13)
    assert all(a > b for a, b in zip(lrs[400:], lrs[401:]))  # strictly decays after W
    # the last executed step, T - 1, is one cosine step short of min_lr
    assert lrs[-1] > min_lr and lrs[-1] == pytest.approx(min_lr + (lr - min_lr) * math.sin(math.pi / 1200) ** 2,
                                                         rel=1e-12)
    assert lr_at(1000, 1000, OPT, cfg) == min_lr and lr_at(5000, 1000, OPT, cfg) == min_lr  # past the end: exactly


def test_warmup_cosine_rt_300m_recipe_numbers():
    rt = OptimConfig(lr=3e-3, min_lr=3e-4)
    cfg = ScheduleConfig(kind="warmup_cosine", warmup_steps=10_000, warmup_start=0.1)
    cfg.validate(25_000)
    lr = lambda s: lr_at(s, 25_000, rt, cfg)  # noqa: E731
    assert lr(0) == 0.1 * 3e-3 and lr(0) == pytest.approx(3e-4, rel=1e-15)
    assert lr(1) == pytest.approx(3e-3 * (0.1 + 0.9 / 10_000), rel=1e-15)
    assert lr(5_000) == pytest.approx(1.65e-3, rel=1e-15)
    assert lr(9_999) == pytest.approx(3e-3 - 2.7e-3 / 10_000, rel=1e-14) and lr(10_000) == 3e-3
    assert lr(17_500) == pytest.approx(1.65e-3, rel=1e-14)  # halfway through the 15,000 cosine steps
    assert lr(20_000) == pytest.approx(3e-4 + 2.7e-3 * (1 + math.cos(math.pi * 2 / 3)) / 2, rel=1e-14)
    assert lr(20_000) == pytest.approx(9.75e-4, rel=1e-13)
    assert lr(24_999) == pytest.approx(3e-4 + 2.96088e-11, rel=1e-12) and lr(24_999) > 3e-4
    assert lr(25_000) == 3e-4 and lr(30_000) == 3e-4


def test_warmup_cosine_resumes_and_edge_cases():
    lrs, cfg = warmup_cosine(60, 24)
    assert [lr_at(s, 60, OPT, ScheduleConfig(**vars(cfg))) for s in range(37, 60)] == lrs[37:]  # pure in the step
    assert warmup_cosine(10, 0)[0][0] == OPT.lr  # no warmup: starts at the peak
    assert warmup_cosine(10, 4, start=0.0)[0][0] == 0.0  # OLMo-core's default: warmup from 0
    assert warmup_cosine(10, 4, start=1.0)[0][:5] == [OPT.lr] * 5  # no ramp
    one = warmup_cosine(10, 9)[0]  # a single post-warmup step: the peak, then min_lr past the end
    assert one[9] == OPT.lr and lr_at(10, 10, OPT, ScheduleConfig("warmup_cosine", 9, warmup_start=0.1)) == OPT.min_lr


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 400), warmup_frac=st.floats(0, 0.99), start=st.floats(0, 1),
       min_frac=st.floats(0, 1), lr=st.floats(1e-6, 1e-1))
def test_warmup_cosine_properties(total, warmup_frac, start, min_frac, lr):
    optim = OptimConfig(lr=lr, min_lr=lr * min_frac)
    warmup = int(warmup_frac * total)
    lrs, cfg = warmup_cosine(total, warmup, start, optim)
    assert all(optim.min_lr <= x <= lr for x in lrs[warmup:]) and all(0 <= x <= lr for x in lrs)
    assert lrs[0] == (lr * start if warmup else lr)
    assert all(a <= b for a, b in zip(lrs[: warmup + 1], lrs[1 : warmup + 1]))  # warmup rises to the peak
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))  # then never rises
    assert lr_at(total, total, optim, cfg) == optim.min_lr


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"warmup_start": 1.5}, "schedule.warmup_start must be a fraction of optim.lr in [0, 1] with "
                                "schedule.kind=warmup_cosine, got 1.5"),
        ({"warmup_start": -0.1}, "got -0.1"),
        ({"warmup_start": math.nan}, "got nan"),
        ({"warmup_start": True}, "got True"),
        ({"warmup_steps": 100}, "schedule.warmup_steps must be an integer in [0, total_steps=100)"),
        ({"kind": "cosine"}, "schedule.warmup_start is used by schedule.kind=warmup_cosine only; set it to 0 with "
                             "schedule.kind=cosine, got 0.1"),
        ({"kind": "wsd"}, "schedule.warmup_start is used by schedule.kind=warmup_cosine only"),
        ({"kind": "constant"}, "schedule.warmup_start is used by schedule.kind=warmup_cosine only"),
        ({"kind": "wsd_tokens", "decay_tokens": 640}, "schedule.warmup_start is used by schedule.kind=warmup_cosine"),
    ],
)
def test_warmup_cosine_validation_names_the_field_in_one_line(changes, says):
    cfg = ScheduleConfig(**{"kind": "warmup_cosine", "warmup_steps": 40, "warmup_start": 0.1, **changes})
    with pytest.raises(ValueError) as err:
        cfg.validate(100, 64)
    msg = str(err.value)
    assert msg.startswith("schedule.warmup_") and says in msg and "\n" not in msg
