"""Measured choices in kernels/registry.py, on the CPU with fake paths and a fake clock: the fastest path
wins per key, keys choose apart, a key is measured once, a raising path is dropped with its reason, a
forced path, a single capable path and measuring(False) bypass it, the report names the choice and the
timings, and under torch.compile the choice is made at trace time on real tensors. The attention op's
key and stand-ins (kernels/attention/measured.py), and that CPU attention calls never measure."""
import os
import subprocess
import sys
import time

import pytest
import torch

from kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MS = 1e-3


class Clock:
    """A fake clock: a path's call advances it by that path's cost for the input's length."""

    def __init__(self):
        self.now, self.timed, self.seen = 0.0, [], []

    def timer(self, run):
        self.timed.append(run)
        t0 = self.now
        run()
        return self.now - t0


@pytest.fixture
def clock():
    return Clock()


def make_op(clock, costs, name="test_measured", priorities=(30, 20, 10), raises=()):
    """Paths a, b, c (priorities as given): each multiplies by its own factor and advances the clock by
    costs[path](n) for an input of length n; a path in `raises` raises on the measurement's inputs."""
    registry._OPS.pop(name, None)
    o = registry.op(name)
    factors = {"a": 2.0, "b": 3.0, "c": 4.0}
    for (path, f), prio in zip(factors.items(), priorities):
        def fn(x, path=path, f=f):
            clock.seen.append((path, x))
            if path in raises and x.requires_grad:  # the measurement's inputs (the caller's here need no grad)
                raise RuntimeError(f"{path} cannot run this\nsecond line")
            clock.now += costs[path](x.shape[0])
            return x * f
        o.register(path, fn, priority=prio)

    def inputs(key):
        return (torch.randn(key[1], requires_grad=True),), {}

    o.measure_with(registry.Measured(key=lambda x: ("len", x.shape[0]), inputs=inputs, timer=clock.timer,
                                     describe=lambda k: f"n={k[1]}"))
    registry.reset_paths_used()
    return o


@pytest.fixture(autouse=True)
def clean():
    was = registry.measuring()
    registry.measuring(True)  # whatever PRETRAIN_KERNELS_MEASURE says
    registry.reset_choices()
    yield
    for name in ("test_measured", "test_measured_2"):
        registry._OPS.pop(name, None)
        registry._used.pop(name, None)
    registry.reset_choices()
    registry.measuring(was)


def test_the_fastest_path_wins_per_key_and_each_key_is_measured_once(clock):
    # a is fast on short inputs, b on long ones; c is never fastest
    op = make_op(clock, {"a": lambda n: n * MS, "b": lambda n: 40 * MS, "c": lambda n: 100 * MS})
    x = torch.ones(8)
    assert op(x).tolist() == [2.0] * 8  # a: 8 ms
    assert len(clock.timed) == 3  # every capable path timed once
    assert op(torch.ones(100))[0] == 3.0  # b: 40 ms against a's 100
    assert len(clock.timed) == 6
    for n in (8, 100, 8):
        op(torch.ones(n))
    assert len(clock.timed) == 6  # cached: no key measured twice
    assert registry.paths_used()["test_measured"] == ["a", "b"]
    made = {c.key: c for c in registry.choices()["test_measured"]}
    assert made[("len", 8)].path == "a" and made[("len", 100)].path == "b"
    assert made[("len", 100)].seconds == pytest.approx({"a": 0.1, "b": 0.04, "c": 0.1})


def test_measured_on_fresh_inputs_never_the_callers(clock):
    op = make_op(clock, {"a": lambda n: 2 * MS, "b": lambda n: 1 * MS, "c": lambda n: 3 * MS})
    x = torch.ones(4)
    op(x)
    measured = [t for path, t in clock.seen[:-1]]  # the last call is the dispatch itself
    assert len(measured) == 3 and all(t is not x and t.requires_grad for t in measured)
    assert clock.seen[-1] == ("b", x)


def test_near_ties_keep_the_priority_order(clock):
    # b is 2% faster than a: within registry.MARGIN, so the higher-priority a keeps the key
    op = make_op(clock, {"a": lambda n: 10.0 * MS, "b": lambda n: 9.8 * MS, "c": lambda n: 5 * MS},
                 priorities=(30, 20, 10))
    op.paths["c"] = registry.Path("c", op.paths["c"].fn, lambda x: False, 10, True)  # c cannot serve
    op._automatic = [op.paths["a"], op.paths["b"], op.paths["c"]]
    op(torch.ones(3))
    assert registry.paths_used()["test_measured"] == ["a"]


def test_a_raising_path_is_dropped_with_its_reason(clock):
    op = make_op(clock, {"a": lambda n: 1 * MS, "b": lambda n: 5 * MS, "c": lambda n: 9 * MS}, raises={"a"})
    assert op(torch.ones(2)).tolist() == [3.0, 3.0]  # a raised while measured: b is the fastest left
    (choice,) = registry.choices()["test_measured"]
    assert choice.dropped == {"a": "RuntimeError: a cannot run this"} and set(choice.seconds) == {"b", "c"}
    assert "dropped a (RuntimeError: a cannot run this)" in str(choice)


def test_every_path_raising_falls_back_to_priority(clock):
    op = make_op(clock, {p: (lambda n: MS) for p in "abc"}, raises={"a", "b", "c"})
    assert op(torch.ones(2))[0] == 2.0  # a, by priority
    (choice,) = registry.choices()["test_measured"]
    assert choice.path == "a" and not choice.seconds and len(choice.dropped) == 3


def test_forced_single_capable_and_switched_off_calls_are_not_measured(clock):
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 1 * MS, "c": lambda n: 5 * MS})
    registry.force("test_measured", "c")
    assert op(torch.ones(2))[0] == 4.0 and not clock.timed
    registry.force("test_measured", None)
    registry.measuring(False)
    assert op(torch.ones(2))[0] == 2.0 and not clock.timed  # static priority: a
    registry.measuring(True)
    op2 = registry.op("test_measured_2")
    op2.register("only", lambda x: x + 1, priority=5)
    op2.register("never", lambda x: x, capable=lambda x: False, priority=9)
    op2.measure_with(registry.Measured(lambda x: "k", lambda k: ((torch.ones(1),), {}), timer=clock.timer))
    assert op2(torch.ones(1))[0] == 2.0 and not clock.timed  # one capable path: nothing to choose
    assert "test_measured_2" not in registry.choices()


def test_a_key_of_none_goes_by_priority(clock):
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 1 * MS, "c": lambda n: 5 * MS})
    op.measure_with(registry.Measured(lambda x: None, lambda k: None, timer=clock.timer))
    assert op(torch.ones(2))[0] == 2.0 and not clock.timed


def test_not_measured_under_fake_tensors_nor_cached(clock):
    """A forward on fake tensors (pretrain/kernel_probe.py's) goes by priority and leaves the key open."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 1 * MS, "c": lambda n: 5 * MS})
    with FakeTensorMode() as mode:
        op(mode.from_tensor(torch.ones(2)))
    assert not clock.timed and "test_measured" not in registry.choices()
    assert registry.paths_used()["test_measured"] == ["a"]
    op(torch.ones(2))
    assert len(clock.timed) == 3  # measured at the first real call


def test_the_report_names_the_choice_and_the_timings(clock):
    op = make_op(clock, {"a": lambda n: 3.4 * MS, "b": lambda n: 2.1 * MS, "c": lambda n: 5 * MS})
    op(torch.ones(5))
    assert registry.describe_choices() == ("test_measured [n=5]: b (2.10 ms fwd+bwd) over a (3.40 ms), "
                                           "c (5.00 ms)")
    line = registry.describe_paths_used()
    assert line.endswith("test_measured b; measured test_measured [n=5]: b (2.10 ms fwd+bwd) over a (3.40 ms), "
                         "c (5.00 ms)")
    registry.reset_paths_used()  # an op that did not run since the reset is not reported
    assert "measured" not in registry.describe_paths_used()


def test_the_report_says_how_long_a_slow_measurement_took(clock, monkeypatch):
    """A measurement's own wall time (on a GPU: Triton's JIT, FlexAttention's compile) lands in a run's
    first step; the report says it once it reaches TOOK_SAID_S, so a slow start is explained in the log."""
    def slow(n):
        time.sleep(0.02)
        return 1 * MS

    op = make_op(clock, {"a": lambda n: 3.4 * MS, "b": slow, "c": lambda n: 5 * MS})
    op(torch.ones(5))
    choice = registry.choices()["test_measured"][0]
    assert choice.took_s >= 0.02  # b's sleep ran inside the measurement
    monkeypatch.setattr(registry, "TOOK_SAID_S", choice.took_s + 1)
    assert "measuring took" not in str(choice)  # under the threshold: not said
    monkeypatch.setattr(registry, "TOOK_SAID_S", 0.01)
    assert str(choice).endswith(f"; measuring took {choice.took_s:.0f} s")


def test_chosen_at_trace_time_under_torch_compile(clock):
    """dynamo runs registry._choose for real at trace time (an assume_constant_result function of
    Python values): real tensors, nothing measured in the graph, the chosen path traced."""
    torch._dynamo.reset()
    op = make_op(clock, {"a": lambda n: 5 * MS, "b": lambda n: 1 * MS, "c": lambda n: 3 * MS})
    compiled = torch.compile(lambda x: op(x) + 1, fullgraph=True, backend="aot_eager")
    assert compiled(torch.ones(3)).tolist() == [4.0] * 3  # b
    from torch._subclasses.fake_tensor import is_fake
    measured = [t for _, t in clock.seen if t.requires_grad]
    assert len(measured) == 3 and not any(is_fake(t) for t in measured)
    assert len(clock.timed) == 3
    compiled(torch.ones(3))
    compiled(torch.full((3,), 2.0))
    assert len(clock.timed) == 3 and registry.paths_used()["test_measured"] == ["b"]
    assert torch._dynamo.assume_constant_result(lambda: 0)._dynamo_marked_constant is True  # what _choose carries
    assert registry._choose._dynamo_marked_constant is True


def test_a_candidate_that_compiles_is_measured_inside_the_models_compile():
    """FlexAttention is itself torch.compile'd: measured at trace time (forward and backward), its lazily
    compiled backward wrote into the enclosing compile's metrics record and that compile then failed
    ("Metric(s) {'is_forward'} have already been set"). The measurement now keeps dynamo's bookkeeping
    apart, and notes the timers its compile added (pretrain/compile_report.py subtracts them)."""
    registry._OPS.pop("test_measured", None)
    op = registry.op("test_measured")
    inner = torch.compile(lambda x: torch.sin(x) * 2, backend="aot_eager")
    op.register("compiled", lambda x: inner(x), priority=20)
    op.register("plain", lambda x: torch.sin(x) * 2, priority=10)
    op.measure_with(registry.Measured(key=lambda x: ("n", x.shape[0]),
                                      inputs=lambda key: ((torch.randn(key[1], requires_grad=True),), {})))
    torch._dynamo.reset()
    before = dict(registry.nested_compile_s)
    x = torch.randn(8, requires_grad=True)
    torch.compile(lambda x: op(x).tanh(), backend="aot_eager")(x).sum().backward()
    (choice,) = registry.choices()["test_measured"]
    assert set(choice.seconds) == {"compiled", "plain"} and choice.traced
    torch.testing.assert_close(x.grad, torch.cos(x) * 2 * (1 - torch.tanh(torch.sin(x) * 2) ** 2))
    assert registry.nested_compile_s.get("_compile.compile_inner", 0) > before.get("_compile.compile_inner", 0)


def test_what_ran_is_recorded_without_a_guard_under_torch_compile():
    """paths_used is recorded at trace time (registry._note_used, a constant to dynamo, as _choose is). Traced as
    code, the set's contents became a guard that failed at the second call: every compiled model compiled twice."""
    torch._dynamo.reset()
    registry._OPS.pop("test_measured", None)
    op = registry.op("test_measured")
    op.register("a", lambda x: x * 2.0, priority=20)
    op.register("b", lambda x: x * 3.0, priority=10, capable=lambda x: x.shape[0] > 5)
    registry.reset_paths_used()
    compiled = torch.compile(lambda x: op(x) + 1, backend="eager")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counters outlive dynamo.reset
    for value in (1.0, 2.0, 3.0):
        compiled(torch.full((3,), value))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert registry.paths_used()["test_measured"] == ["a"]
    assert registry._note_used._dynamo_marked_constant is True
    torch._dynamo.reset()


def test_the_switch_is_read_from_the_environment(monkeypatch):
    code = "from kernels import registry; print(registry.measuring())"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT, "PRETRAIN_KERNELS_MEASURE": "0"})
    assert out.stdout.strip() == "False", out.stderr[-300:]
    for value, want in (("off", False), ("no", False), ("", True), ("1", True)):
        monkeypatch.setenv("PRETRAIN_KERNELS_MEASURE", value)
        assert registry._env_measure() is want


# -- the attention op ------------------------------------------------------------------------------------

def test_attention_calls_on_a_cpu_never_measure(monkeypatch):
    import kernels.attention as attn
    from kernels.attention import masks, measured

    def refuse(run):
        raise AssertionError("a CPU call was measured")

    monkeypatch.setattr(attn.OP, "measured", registry.Measured(measured.key, measured.inputs, timer=refuse))
    # FlexAttention keeps its capability check but runs SDPA here (its CPU compile takes 20 s)
    flex = attn.OP.paths["flex"]
    monkeypatch.setitem(attn.OP.paths, "flex", registry.Path("flex", attn.sdpa.attention, flex.capable,
                                                             flex.priority, True, flex.refusal))
    monkeypatch.setattr(attn.OP, "_automatic", [attn.OP.paths[p.name] for p in attn.OP._automatic])
    T = 1024  # long enough for FlexAttention's CPU forward: two capable paths without a backward
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    doc_ids = torch.arange(T).div(300, rounding_mode="floor")[None]
    attn.reset_paths_used()
    with torch.no_grad():
        attn.attention(q, k, v, masks.decoder_mask(doc_ids))
    attn.attention(*(t[:, :, :64].requires_grad_() for t in (q, k, v)), masks.decoder_mask(doc_ids[:, :64]))
    assert attn.paths_used() == {"flex", "sdpa"}  # the static choices of today
    assert measured.key(q, k, v, masks.decoder_mask(doc_ids)) is None
    assert "attention" not in registry.choices()


def test_attention_keys_bucket_the_shape_and_name_the_mask_kind():
    from kernels.attention import masks, measured

    q, k, v = torch.randn(3, 8, 100, 16, requires_grad=True), torch.randn(3, 2, 100, 16), torch.randn(3, 2, 100, 16)
    doc_ids = torch.zeros(3, 100, dtype=torch.long)
    key = measured.shape_key(q, k, v, masks.decoder_mask(doc_ids, 16))
    assert key == ((("&", ("&", ("Causal",), ("Document",)), ("Window", 16))), 4, 8, 2, 128, 128, 16, torch.float32,
                   True, "cpu")
    assert measured.describe(key) == "causal & document & window(16), B4 H8/2 128x128 d16 float32, fwd+bwd"
    with torch.no_grad():
        assert measured.shape_key(q, k, v, masks.decoder_mask(doc_ids))[-2] is False
    assert measured.shape_key(q, k, v, masks.decoder_mask(doc_ids, 500))[0] == ("&", ("Causal",), ("Document",))
    # not measured: a decode offset, ALiBi, dropout, a mask of unknown kind
    assert measured.shape_key(q, k, v, masks.causal(), 5) is None
    assert measured.shape_key(q, k, v, masks.causal(), 0, None, 0.1) is None
    assert measured.shape_key(q, k, v, masks.causal(), alibi_slopes=torch.ones(8)) is None
    assert measured.shape_key(q, k, v, masks.causal() | masks.prefix(torch.ones(3, dtype=torch.long))) is None


def test_attention_stand_ins_are_the_same_kind_on_fresh_tensors():
    from kernels.attention import masks, measured, reference

    doc_ids = torch.zeros(2, 40, dtype=torch.long)
    key = measured.shape_key(*(torch.randn(2, 4, 2048, 8, requires_grad=True) for _ in range(3)),
                             masks.decoder_mask(doc_ids, 300))
    (q, k, v, mask, offset), kwargs = measured.inputs(key)
    assert q.shape == k.shape == (2, 4, 2048, 8) and q.requires_grad and not kwargs and offset == 0
    assert q.stride()[1] == 8  # the models' layout: a [B, T, H, Dh] tensor seen as [B, H, T, Dh]
    assert measured.kind(mask) == key[0]
    ids = measured.doc_ids(1, 2048, "cpu")[0]
    want = masks.decoder_mask(ids[None], 300).dense(1, 1, 2048, 2048)
    assert torch.equal(mask.dense(2, 4, 2048, 2048), want.expand(2, 1, 2048, 2048))
    assert ids[1023] == 0 and ids[1024] == 1  # documents of DOC_TOKENS tokens
    # the sdpa path runs forward and backward on them (what the registry times)
    run, backward = registry._fwd_bwd(reference.attention, (q[:, :, :64], k[:, :, :64], v[:, :, :64],
                                                            masks.causal(), 0), {})
    assert backward and run().shape == (2, 4, 64, 8)


def test_the_sps_training_mask_has_a_stand_in():
    from kernels.attention import measured
    from pretrain.models import get_arch

    cfg = get_arch("sps").config_cls(vocab_size=97, d_model=32, n_layers=1, n_heads=4, max_seq_len=64,
                                     sps_window=5, predict_id=4, eos_id=2)
    model = get_arch("sps").build(cfg)
    T = 64
    docs = measured.doc_ids(2, T, "cpu")
    real = model.slot_mask(T, docs)
    kind = measured.kind(real)
    assert kind == ("SlotMask", cfg.persistent, 5, True, real.name)
    stand_in = measured.stand_in(kind, 2, 2 * T, 2 * T, torch.device("cpu"))
    assert torch.equal(stand_in.dense(2, 1, 2 * T, 2 * T), real.dense(2, 1, 2 * T, 2 * T))
    assert measured.kind(model.slot_mask(T, docs, interleaved=True)) is None  # no closed runs: not measured


@pytest.mark.parametrize("dynamic", [False, True])
def test_attention_measured_end_to_end_on_a_cpu_eager_and_compiled(dynamic):
    """The attention key, stand-ins and the default timer on real paths (SDPA and the reference, both
    automatic here), with the CUDA check left out: dynamo computes the key of a mask built inside the
    compiled function (fullgraph) and the choice is made at trace time; symbolic sizes are not measured."""
    import kernels.attention as attn
    from kernels.attention import masks, measured, reference

    registry._OPS.pop("test_measured", None)
    op = registry.op("test_measured")
    op.register("sdpa", attn.sdpa.attention, priority=10)
    op.register("reference", reference.attention, priority=5)
    op.measure_with(registry.Measured(measured.shape_key, measured.inputs, describe=measured.describe))
    B, H, T, Dh = 2, 2, 64, 8
    q, k, v = (torch.randn(B, H, T, Dh, requires_grad=True) for _ in range(3))
    doc_ids = torch.arange(T).div(20, rounding_mode="floor").expand(B, T)

    def fn(q, k, v, doc_ids):
        return op(q, k, v, masks.decoder_mask(doc_ids, 16), 0)

    torch._dynamo.reset()
    if dynamic:  # what a recompile on a new batch or length does (the head counts never change)
        for t in (q, k, v, doc_ids):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, t.dim() - 2 if t.dim() == 4 else 1)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, doc_ids)
    torch.testing.assert_close(out, reference.attention(q, k, v, masks.decoder_mask(doc_ids, 16)))
    out.sum().backward()
    made = registry.choices().get("test_measured", [])
    if dynamic:
        assert not made and registry.paths_used()["test_measured"] == ["sdpa"]  # by priority
        return
    (choice,) = made
    assert set(choice.seconds) == {"sdpa", "reference"} and choice.backward
    assert choice.where == "causal & document & window(16), B2 H2/2 64x64 d8 float32, fwd+bwd"
    assert registry.paths_used()["test_measured"] == [choice.path]
    fn(q, k, v, doc_ids)  # eager: the same key, already chosen
    assert len(registry.choices()["test_measured"]) == 1


# -- on CUDA: the measured attention path is never slower than SDPA with the dense mask ------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device: attention paths are measured only on CUDA")


def _docs(B, T, g):
    """Packed documents of random lengths (a few hundred to two thousand tokens), as data would give."""
    lengths = torch.randint(200, 2000, (B, T // 200 + 1), generator=g)
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), row)[:T] for row in lengths]).cuda()


def _fwd_bwd_seconds(fn, leaves):
    run, _ = registry._fwd_bwd(fn, tuple(leaves), {})
    return registry.wall_time(run, warmup=3, reps=10)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mask_kind", ["document", "sps"])
def test_the_measured_path_is_never_slower_than_sdpa_with_the_dense_mask_on_cuda(mask_kind):
    """The baseline's and SPS's shapes (d 768: 12 heads of 64; bf16; fwd + bwd): the recorded timings
    put the choice within MARGIN of SDPA's, and timing the real call (its own documents, not the
    stand-in's) agrees within 10%."""
    import kernels.attention as attn
    from kernels.attention import masks
    from pretrain.models.sps import VARIANTS, SlotMask, slot_tables

    g = torch.Generator().manual_seed(0)
    B, H, Dh = 2, 12, 64
    if mask_kind == "document":
        T = 4096
        mask = masks.decoder_mask(_docs(B, T, g))
    else:
        T = 4096  # slots: 2,048 tokens
        tok, kind = slot_tables(T // 2, "cuda")
        d = _docs(B, T // 2, g).repeat(1, 2)
        mask = SlotMask(tok, kind, tok, kind, VARIANTS["sps"][0], 64, d, d, tokens=T // 2)
    leaves = [torch.randn(B, T, H, Dh, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
              for _ in range(3)]
    registry.reset_choices()
    attn.use_path(None)
    attn.reset_paths_used()
    out = attn.attention(*leaves, mask)
    (choice,) = registry.choices()["attention"]
    print(choice)
    assert "sdpa" in choice.seconds and choice.backward and attn.paths_used() == {choice.path}
    assert choice.seconds[choice.path] <= choice.seconds["sdpa"] * (1 + registry.MARGIN)
    try:
        attn.use_path("sdpa")
        want = attn.attention(*leaves, mask)
        dense = _fwd_bwd_seconds(lambda q, k, v: attn.attention(q, k, v, mask), leaves)
    finally:
        attn.use_path(None)
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)
    auto = _fwd_bwd_seconds(lambda q, k, v: attn.attention(q, k, v, mask), leaves)
    assert auto <= 1.1 * dense, f"{choice.path} {auto * 1e3:.2f} ms against sdpa's {dense * 1e3:.2f} ms"


@pytest.mark.gpu
@cuda
def test_the_choice_is_made_at_trace_time_under_torch_compile_on_cuda():
    import kernels.attention as attn
    from kernels.attention import masks

    torch._dynamo.reset()
    registry.reset_choices()
    attn.use_path(None)
    g = torch.Generator().manual_seed(1)
    B, H, T, Dh = 2, 4, 2048, 64
    doc_ids = _docs(B, T, g)
    q, k, v = (torch.randn(B, H, T, Dh, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def fn(q, k, v, doc_ids):
        return attn.attention(q, k, v, masks.decoder_mask(doc_ids))

    attn.reset_paths_used()
    out = torch.compile(fn, fullgraph=True)(q, k, v, doc_ids)
    out.sum().backward()
    (choice,) = registry.choices()["attention"]
    assert attn.paths_used() == {choice.path} and len(choice.seconds) >= 2
    torch.testing.assert_close(out.float(), fn(q, k, v, doc_ids).float(), rtol=3e-2, atol=3e-2)
    assert len(registry.choices()["attention"]) == 1  # the eager call shares the compiled call's choice
