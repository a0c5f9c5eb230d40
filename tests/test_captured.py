"""Captured regions (kernels/captured.py, issue 37): RT's layers and GPN's segments as functions of
tensors that a CUDA graph replays, checked on the CPU through the emulated backend, which keeps the
real one's static input and output buffers, copies and per-signature graphs (only the replay is a
recomputation instead of a graph launch). The graphed == eager check on a GPU carries the `gpu` marker."""
import sys
from pathlib import Path

import pytest
import torch

from kernels import captured
from pretrain.config import ConfigError, load_config

import test_gpn
import test_rt


@pytest.fixture
def emulated():
    backend = captured.Emulated()
    captured.reset(backend)
    yield backend
    captured.reset(captured.CudaGraphs())


def _loss_and_grads(model, batch, mode, autocast=None):
    """As the trainer runs a step: the forward under autocast (when given), the backward outside it."""
    from contextlib import nullcontext

    model.zero_grad()
    with captured.step(mode, log=lambda *_: None):
        with torch.autocast(autocast[0], autocast[1]) if autocast else nullcontext():
            loss, _ = model(batch)
        loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _assert_same(a, b, tol=1e-12):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=tol)
    for x, y in zip(a[1], b[1]):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=tol)


# -- the regions equal the plain loops (fp64, forward and every gradient) -------------------------------
@pytest.mark.parametrize("kw", [dict(segment=5), dict(segment=4, tbptt=6), dict(segment=7, n_layers=2),
                                dict(segment=5, reset_at_documents=True), dict(segment=5, mem_heads=0, n_layers=1)],
                         ids=["segments", "tbptt", "two-layers", "doc-resets", "bare"])
def test_gpn_segments_as_regions_equal_the_plain_loop(emulated, kw):
    docs = torch.tensor([[0] * 9 + [1] * 13, [0] * 22]).numpy() if kw.get("reset_at_documents") else None
    batch = test_gpn.batch_of(docs=docs)
    model = test_gpn.model_of(**kw)
    model.segment_recompute = True
    eager = _loss_and_grads(model, batch, "off")
    assert emulated.captures == 0
    graphed = _loss_and_grads(model, batch, "on")
    _assert_same(graphed, eager)
    # T = 21 by segments of S: the full ones share one graph per body, the shorter last one (and a cut) its own
    assert emulated.captures >= 2
    again = emulated.captures
    _assert_same(_loss_and_grads(model, batch, "on"), eager)
    assert emulated.captures == again, "a second step captured again instead of replaying"


@pytest.mark.parametrize("positions,leaf", [("alibi", 1), ("rope", 1), ("rope", 4)])
def test_rt_layers_as_regions_equal_the_plain_loop(emulated, positions, leaf):
    model = test_rt.model_of(positions=positions, leaf_block=leaf)
    tokens = torch.randint(0, test_rt.V, (2, 19), generator=torch.Generator().manual_seed(0))
    from pretrain.data.batch import collate

    batch = collate((tokens.numpy(), tokens.numpy() * 0), eod_id=None)
    eager = _loss_and_grads(model, batch, "off")
    graphed = _loss_and_grads(model, batch, "on")
    _assert_same(graphed, eager)
    assert emulated.captures == 2 * model.cfg.n_layers  # a forward and a backward graph per layer
    _loss_and_grads(model, batch, "on")
    assert emulated.captures == 2 * model.cfg.n_layers
    assert "rt_prefill forward 2 graphs" in captured.summary()


def _rt_batch(T=19):
    from pretrain.data.batch import collate

    tokens = torch.randint(0, test_rt.V, (2, T), generator=torch.Generator().manual_seed(0)).numpy()
    return collate((tokens, tokens * 0), eod_id=None)


def test_the_layers_share_one_set_of_static_buffers(emulated):
    """Every layer's graphs read and write the same static buffers (one set per region kind and signature): the
    buffers do not grow with the depth, the graphs do."""
    sizes = []
    for layers in (2, 3):
        captured.reset(emulated)
        _loss_and_grads(test_rt.model_of(n_layers=layers), _rt_batch(), "on")
        sizes.append(len(captured._state.buffers))
        assert len(captured._state.graphs) == 2 * layers
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("arch", ["rt", "gpn"])
def test_regions_under_bf16_autocast_equal_the_plain_loop_and_backward_recomputes_in_bf16(emulated, arch):
    """Under autocast the regions run with the caller's autocast (its weight cache emptied as each starts and
    ends), and the backward, which autograd runs outside the forward's autocast, recomputes under the forward's:
    graphed == eager exactly, and the gradients are those of the bf16 forward, not of an fp32 recomputation."""
    if arch == "rt":
        model, batch = test_rt.model_of(dtype=torch.float32), _rt_batch()
    else:
        model, batch = test_gpn.model_of(dtype=torch.float32, segment=5), test_gpn.batch_of()
        model.segment_recompute = True
    bf16 = ("cpu", torch.bfloat16)
    eager = _loss_and_grads(model, batch, "off", bf16)
    _assert_same(_loss_and_grads(model, batch, "on", bf16), eager, tol=0)
    assert emulated.captures > 0
    fp32 = _loss_and_grads(model, batch, "off")
    assert any((a - b).abs().max() > 0 for a, b in zip(eager[1], fp32[1]) if a is not None)  # bf16 arithmetic ran


def _accumulators(roots) -> set[int]:
    """The leaves whose AccumulateGrad nodes (gradient sinks) are reachable from autograd nodes, by the
    leaf tensor's id: a node's Python wrapper may be made afresh at each access (torch 2.11), so the
    walk keeps every wrapper it met alive (their ids stay unique) and names a sink by its variable."""
    seen, kept, found, stack = set(), [], set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        kept.append(node)
        if id(node) not in seen:
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad":
                found.add(id(node.variable))
            stack += [f for f, _ in node.next_functions if f is not None]
    return found


@pytest.mark.parametrize("arch", ["rt", "rt autograd", "gpn"])
def test_a_captured_backward_reaches_no_gradient_node_of_the_outer_graph(emulated, monkeypatch, arch):
    """A parameter's gradient node is made with the outer autograd graph, on the default stream; a backward
    captured on another stream that differentiated into it would have the engine sync with that stream and
    break the capture on a GPU. Every autograd.grad inside the captured bodies reaches fresh leaves only
    (RT's tiled backward, where its phase 2 runs through autograd, differentiates by aliases of the
    parameters; GPN's segments by detached leaves); RT's own phase 2 (pre_grads, weight_grads) calls none."""
    if arch.startswith("rt"):
        model, batch = test_rt.model_of(n_layers=2), _rt_batch()
        if arch == "rt autograd":  # phase 2 through pre's, kv's and post's autograd graphs, as a layer without them
            from pretrain.models.rt import LayerView
            monkeypatch.setattr(LayerView, "pre_grads", None)
            monkeypatch.setattr(LayerView, "weight_grads", None)
    else:
        model, batch = test_gpn.model_of(segment=5), test_gpn.batch_of()
        model.segment_recompute = True
    inner, grad = [], torch.autograd.grad

    def spy(outputs, *args, **kwargs):
        outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        inner.append(_accumulators([o.grad_fn for o in outs if o.grad_fn is not None]))
        return grad(outputs, *args, **kwargs)

    with captured.step("on", log=lambda *_: None):
        loss, _ = model(batch)
        outer = _accumulators([loss.grad_fn])
        monkeypatch.setattr(torch.autograd, "grad", spy)
        loss.backward()
    assert emulated.captures > 0 and outer
    assert inner == [] if arch == "rt" else inner  # RT's own phase 2: no graph differentiated inside the capture
    assert not set().union(*inner) & outer


def _closure_tensors(fn, seen=None) -> list:
    """Tensors a function's closure holds: directly, in tuples and lists, in a GPN Folded, or through
    the functions it closes over."""
    from pretrain.models.gpn import Folded

    seen = seen if seen is not None else set()
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        items = [cell.cell_contents]
        while items:
            v = items.pop()
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (tuple, list)):
                items += list(v)
            elif isinstance(v, Folded):
                items += [t for t in v.tensors() if t is not None]
            elif callable(v) and hasattr(v, "__closure__"):
                found += _closure_tensors(v, seen)
    return found


def test_gpn_graphs_keep_no_tensor_of_the_step_that_captured_them(emulated):
    """A graph keeps its body for the run; GPN's bodies close over counts and the matrices' shape only, so
    the capturing step's G, states and folded matrices (about 0.4 GB at gpn-m-130m) are freed with it."""
    model, batch = test_gpn.model_of(segment=5), test_gpn.batch_of()
    model.segment_recompute = True
    _loss_and_grads(model, batch, "on")
    graphs = list(captured._state.graphs.values())
    assert graphs and all(g.keep is not None for g in graphs)
    assert [t.shape for g in graphs for t in _closure_tensors(g.keep)] == []


def test_a_region_copies_inputs_in_and_outputs_out_and_recaptures_per_shape(emulated):
    calls = []

    def fn(x, w):
        calls.append(1)
        return x * w, None

    w = torch.tensor(2.0)
    with captured.step("on", log=lambda *_: None):
        first, none = captured.region("double", fn, [torch.ones(3), w])
        second, _ = captured.region("double", fn, [torch.full((3,), 5.0), w])
        assert none is None
        assert emulated.captures == 1
        assert first.tolist() == [2.0] * 3, "a replay overwrote an earlier result: outputs must be copies"
        assert second.tolist() == [10.0] * 3
        captured.region("double", fn, [torch.ones(4), w])  # a new shape: a new graph
        assert emulated.captures == 2
        with torch.no_grad():  # grad mode is part of the key too
            captured.region("double", fn, [torch.ones(4), w])
        assert emulated.captures == 3
    # outside a captured step (evaluation) the function just runs
    n = len(calls)
    captured.region("double", fn, [torch.ones(6), w])
    assert emulated.captures == 3 and len(calls) == n + 1


def test_graphing_is_true_in_a_regions_warm_up_and_capture_only(emulated):
    """captured.graphing(): the code a graph will replay is running (an op measured there times its paths as
    replayed, the RT tile): a region's warm-up and capture, not its replays, not outside a step."""
    seen = []

    def fn(x):
        seen.append(captured.graphing())
        return [x + 1]

    assert not captured.graphing()
    with captured.step("on", log=lambda *_: None):
        captured.region("plus", fn, [torch.ones(2)])  # warm-up, capture (the emulated one runs fn), first replay
        assert seen == [True, True, False], seen
        seen.clear()
        captured.region("plus", fn, [torch.ones(2)])  # a replay (the emulated one reruns the body)
        assert seen == [False], seen
        assert not captured.graphing()
    seen.clear()
    captured.region("plus", fn, [torch.ones(2)])  # outside a step: runs as is
    assert seen == [False]
    emulated.fail = RuntimeError("broken")
    with captured.step("auto", log=lambda *_: None):
        captured.region("other", fn, [torch.ones(3)])  # a capture that fails: the flag is down again after it
    assert not captured.graphing()


def test_the_rt_tile_is_timed_as_replayed_inside_a_captured_region_and_as_launched_elsewhere(monkeypatch):
    from kernels import registry
    from kernels import rt_prefill

    monkeypatch.setattr(captured, "replay_time", lambda run: ("replayed", run()))
    monkeypatch.setattr(registry, "wall_time", lambda run: ("launched", run()))
    assert rt_prefill._tile_timer(lambda: 1) == ("launched", 1)
    monkeypatch.setattr(captured._state, "graphing", True)
    assert rt_prefill._tile_timer(lambda: 2) == ("replayed", 2)
    key = (512, 22, 1, 1, 64, torch.bfloat16, torch.bfloat16, True, "cuda:0", True)
    assert rt_prefill._describe(key).endswith("alibi, timed as replayed in a CUDA graph")
    assert "replayed" not in rt_prefill._describe(key[:-1] + (False,))


def test_replay_time_off_cuda_is_wall_time():
    calls = []
    seconds = captured.replay_time(lambda: calls.append(1))
    assert isinstance(seconds, float) and seconds >= 0 and len(calls) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture CUDA graphs")
def test_replay_time_leaves_the_launches_out_on_cuda():
    """A tiny kernel: launched and synced, its time is the launch's; replayed from a graph, the kernel's alone.
    And the RT tile measured inside a captured step is keyed and described as replayed."""
    from kernels import registry

    x = torch.zeros(1024, device="cuda")
    replayed, launched = captured.replay_time(lambda: x.add_(1)), registry.wall_time(lambda: x.add_(1))
    assert replayed < launched, (replayed, launched)
    captured.reset(captured.CudaGraphs())
    registry.reset_choices()
    model = test_rt.model_of(dtype=torch.float32, d_model=64, n_heads=4).cuda()
    from pretrain.data.batch import collate

    tokens = torch.randint(0, 60, (2, 34), generator=torch.Generator().manual_seed(2)).numpy()
    _loss_and_grads(model, collate((tokens, tokens * 0), eod_id=None).to(torch.device("cuda")), "on",
                    ("cuda", torch.bfloat16))
    made = registry.choices().get("rt_tile_update", [])
    assert made and all(c.key[-1] is True and "replayed" in c.where for c in made), [(c.key, c.where) for c in made]
    captured.reset()
    registry.reset_choices()


def test_an_unchanged_input_is_copied_in_once_and_a_changed_or_new_one_again(emulated):
    """GPN's folded matrices feed every segment of a step: the same tensor, unchanged, is not copied into its
    buffer again; written in place (an optimizer step) or replaced by another tensor, it is."""
    w = torch.tensor([2.0, 3.0])
    with captured.step("on", log=lambda *_: None):
        captured.region("scale", lambda x, w: x * w, [torch.ones(2), w])  # the capture copies both in
        copies = captured._state.copies
        out = captured.region("scale", lambda x, w: x * w, [torch.full((2,), 5.0), w])[0]
        assert out.tolist() == [10.0, 15.0] and captured._state.copies == copies + 1  # x only
        with torch.no_grad():
            w.mul_(10)
        out = captured.region("scale", lambda x, w: x * w, [torch.ones(2), w])[0]
        assert out.tolist() == [20.0, 30.0] and captured._state.copies == copies + 3  # x and the changed w
        out = captured.region("scale", lambda x, w: x * w, [torch.ones(2), torch.tensor([1.0, 1.0])])[0]
        assert out.tolist() == [1.0, 1.0]  # another tensor: copied, although w's record is alive
        out = captured.region("scale", lambda x, w: x * w, [torch.ones(2), w])[0]
        assert out.tolist() == [20.0, 30.0]  # w again after another tensor held its buffer


def test_a_parameter_updated_by_a_fused_optimizer_is_copied_in_again_at_the_next_step(emulated):
    """A fused AdamW writes parameters without bumping their version counters, so an input's copy record
    cannot outlive the step (GPN passes two biases through its folded matrices as inputs)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([w], lr=0.5, fused=True)
    for _ in range(3):
        with captured.step("on", log=lambda *_: None):
            for _ in range(2):  # two segments of one step read it
                out = captured.region("scale", lambda x, w: x * w, [torch.ones(2), w])[0]
                assert out.tolist() == w.detach().tolist()
        version = w._version
        w.grad = torch.ones(2)
        opt.step()
        assert w._version == version  # what the record would have trusted


def test_a_body_that_writes_into_its_input_has_it_copied_at_every_replay(emulated):
    def bump(x):
        x.add_(1)  # writes into its (static) input: a replay leaves the buffer changed
        return x * 2

    x = torch.zeros(3)
    with captured.step("on", log=lambda *_: None):
        for _ in range(4):  # the same tensor, unchanged by the caller, every time
            out = captured.region("bump", bump, [x])[0]
            assert out.tolist() == [2.0] * 3, out
    assert x.tolist() == [0.0] * 3  # the caller's tensor is never written: the buffer is


def test_a_failed_capture_is_said_once_and_runs_eagerly_or_stands_when_forced(emulated):
    emulated.fail = RuntimeError("operation not permitted when stream is capturing")  # an op that syncs
    lines = []
    with captured.step("auto", log=lines.append):
        for _ in range(5):
            out = captured.region(("loop", 1), lambda x: x + 1, [torch.zeros(3)])
            assert out[0].tolist() == [1.0] * 3
    assert len(lines) == 1 and "loop runs eagerly from now on" in lines[0] and "not permitted" in lines[0]
    captured.reset(emulated)
    with captured.step("on", log=lines.append), pytest.raises(RuntimeError, match="cuda_graphs=on: capturing loop"):
        captured.region(("loop", 1), lambda x: x + 1, [torch.zeros(3)])


def test_a_signal_raised_inside_a_capture_is_not_taken_for_a_failed_capture(emulated):
    """A SIGTERM handler's exception (bench_rt_layer's _Ended, a KeyboardInterrupt) raised while a region is
    captured goes through as it is: under "on" it was re-raised as a failed capture, so the benchmark's
    handler missed it and its table was lost (the H200, 2026-11-29)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_rt_layer import _Ended

    def interrupted(x):
        raise _Ended

    for mode in ("on", "auto"):
        captured.reset(emulated)
        with captured.step(mode, log=lambda *_: None), pytest.raises(_Ended):
            captured.region(("loop", 1), interrupted, [torch.zeros(3)])


@pytest.mark.parametrize("body, why", [
    (lambda t: t * float(t.sum().item()), "reads tensor data on the host"),
    (lambda t: t * bool((t > 2).any()), "reads tensor data on the host"),
    (lambda t: t[t > 1].sum() + t, "boolean mask"),
    (lambda t: t.masked_select(t > 1).sum() + t, "depends on tensor data"),
    (lambda t: t.index_put((t > 1,), torch.tensor(0.0)), "boolean mask"),
], ids=["item", "bool", "mask-index", "masked-select", "mask-index-put"])
def test_the_emulated_capture_refuses_what_a_cuda_graph_cannot_hold(emulated, body, why):
    """A host read (a sync) or a data-dependent shape in a region fails its capture on a GPU (the gpu test
    below); the emulated backend refuses the same, so the CPU tests of RT's and GPN's regions (all passing
    through it) would find one: said once, then eager, with the eager result."""
    lines, x = [], torch.arange(4.0)
    with captured.step("auto", log=lines.append):
        for _ in range(3):
            torch.testing.assert_close(captured.region("syncing", body, [x])[0], body(x))
    assert len(lines) == 1 and "syncing runs eagerly from now on" in lines[0] and why in lines[0], lines
    assert "a CUDA graph cannot capture it" in lines[0]


def test_the_emulated_capture_holds_integer_gathers_and_scatters(emulated):
    """The refusal is no wider than a graph's: indexing by integer tensors (an embedding's gather, a
    scatter into a buffer) and repeat_interleave with its length given are captured, not sent eager."""
    def body(t, idx, reps):
        out = t[idx] + t.index_put((idx,), t[:3] * 2)[1:].sum()
        return out + torch.repeat_interleave(t[:2], reps, output_size=3)

    lines, inputs = [], [torch.arange(4.0), torch.tensor([3, 0, 2]), torch.tensor([1, 2])]
    with captured.step("on", log=lines.append):
        for _ in range(3):
            torch.testing.assert_close(captured.region("gathers", body, inputs)[0], body(*inputs))
    assert lines == [] and emulated.captures == 1


# -- the run: a line once, a forced capture refused before any work ----------------------------------------
def test_check_says_what_runs_and_refuses_a_forced_capture_that_cannot_run():
    captured.reset(captured.CudaGraphs())
    cpu = torch.device("cpu")
    what = "RT's per-layer position loops"
    assert captured.check("off", cpu, None) == (None, False)
    assert captured.check("on", cpu, None) == (None, False)  # no loops (the config refuses "on" there)
    line, active = captured.check("auto", cpu, what)
    assert not active and line == f"train.cuda_graphs=auto: the CPU has no CUDA graphs, so {what} run eagerly"
    with pytest.raises(ValueError, match="train.cuda_graphs=on cannot capture: the CPU has no CUDA graphs"):
        captured.check("on", cpu, what)
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, on, off"):
        captured.check("always", cpu, what)
    line, active = captured.check("auto", cpu, None, "parallel.recompute=none differentiates the window")
    assert not active and "nothing to capture (parallel.recompute=none" in line


@pytest.mark.parametrize("arch,over,match", [
    ("baseline/tiny", [], "declares no loop to capture"),
    ("gpn/tiny", ["parallel.recompute=none"], "parallel.recompute=none differentiates the window"),
    ("rt/tiny", ["model.recurrent=false"], "the Transformer rows have no position loop"),
    ("rt/tiny", ["parallel.pp=2", "train.compile=false"], "pipeline stages"),
])
def test_config_refuses_a_forced_capture_that_captures_nothing(arch, over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(arch, ["train.cuda_graphs=on", *over], check_data=False)


def test_config_field_is_checked():
    with pytest.raises(ConfigError, match="train.cuda_graphs must be one of auto, on, off"):
        load_config("rt/tiny", ["train.cuda_graphs=always"], check_data=False)


def _run(tmp_path, arch, mode, steps=4, lines=None):
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov", num_docs=60)
    over = tiny_overrides(tmp_path / mode, corpus, arch=arch.split("/")[0], **{
        "train.max_steps": steps, "train.eval_every": 0, "checkpoint.every": 0, "train.compile": "false",
        "train.cuda_graphs": mode, "train.micro_batch_seqs": 4, "train.global_batch_seqs": 8})
    log = lines.append if lines is not None else (lambda *_: None)
    Trainer(load_config(arch, over), log=log).fit()
    return [r["loss"] for r in read_metrics(str(tmp_path / mode / "run")) if "loss" in r]


def test_auto_on_a_cpu_trains_eagerly_and_says_so_once_per_run(tmp_path):
    lines = []
    _run(tmp_path, "rt/tiny", "auto", lines=lines)
    said = [line for line in lines if "cuda_graphs" in line]
    assert said == ["train.cuda_graphs=auto: the CPU has no CUDA graphs, so RT's per-layer position loops (the tile "
                    "schedule's forward and backward) run eagerly"], said


def test_forced_capture_on_a_cpu_is_one_sentence_before_any_work(tmp_path):
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(tmp_path / "markov", num_docs=20)
    over = tiny_overrides(tmp_path, corpus, arch="rt", **{"train.cuda_graphs": "on"})
    with pytest.raises(ValueError, match=r"^train.cuda_graphs=on cannot capture: the CPU has no CUDA graphs; use"):
        Trainer(load_config("rt/tiny", over), log=lambda *_: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch", ["rt/tiny", "gpn/tiny"])
def test_training_through_the_emulated_graphs_gives_the_eager_losses(tmp_path, emulated, arch):
    """Several optimizer steps and two micro batches a step: the replays read the parameters the optimizer
    updated in place, and the losses are the eager run's."""
    lines = []
    graphed = _run(tmp_path, arch, "on", lines=lines)
    assert emulated.captures > 0
    assert any("are captured as CUDA graphs" in line for line in lines)
    assert any(line.startswith("kernels: ") and "captured: " in line for line in lines)
    eager = _run(tmp_path, arch, "off")
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-6, atol=1e-6)


# -- on a GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture CUDA graphs")
@pytest.mark.parametrize("arch", ["rt", "gpn"])
def test_graphed_equals_eager_on_cuda_in_bf16_and_recaptures_on_a_new_shape(arch):
    captured.reset(captured.CudaGraphs())
    if arch == "rt":
        model = test_rt.model_of(dtype=torch.float32, d_model=64, n_heads=4).cuda()
        T = 33
    else:
        model = test_gpn.model_of(dtype=torch.float32, segment=6).cuda()
        model.segment_recompute = True
        T = 21
    from pretrain.data.batch import collate

    def batch(B):
        tokens = torch.randint(0, 60, (B, T + 1), generator=torch.Generator().manual_seed(B)).numpy()
        return collate((tokens, tokens * 0), eod_id=None).to(torch.device("cuda"))

    def run(mode, b):
        return _loss_and_grads(model, b, mode, ("cuda", torch.bfloat16))

    for B in (2, 3):  # the second batch size is a new shape: captured again
        b = batch(B)
        eager = run("off", b)
        for _ in range(2):
            graphed = run("on", b)
        torch.testing.assert_close(graphed[0], eager[0], rtol=2e-2, atol=2e-2)
        for x, y in zip(graphed[1], eager[1]):
            if x is not None:
                torch.testing.assert_close(x, y, rtol=5e-2, atol=5e-2)
    assert "backward" in captured.summary() and "forward" in captured.summary(), captured.summary()
    assert len(captured._state.graphs) >= 4  # a forward and a backward graph for each batch size
    captured.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture CUDA graphs")
@pytest.mark.parametrize("case", ["rt", "rt triton tile", "rt compiled", "gpn", "gpn triton memory", "gpn compiled"])
def test_replays_read_parameters_updated_in_place_and_equal_eager_in_fp32_on_cuda(case):
    """fp32 without autocast, so a tight tolerance: after a fused AdamW step between steps (in place, no
    version bump), each replay gives the eager result of the new values, on every path a captured body can
    take (the PyTorch and Triton RT tiles, RT's compiled pieces, GPN's reference, Triton and compiled steps)."""
    from kernels import registry
    from pretrain.data.batch import collate

    captured.reset(captured.CudaGraphs())
    forced = {"rt triton tile": "rt_prefill", "gpn triton memory": "delta_memory_step"}.get(case)
    if case.startswith("rt"):
        model, T = test_rt.model_of(dtype=torch.float32, d_model=64, n_heads=4).cuda(), 33
        if case == "rt compiled":
            model.compile()
    else:
        model, T = test_gpn.model_of(dtype=torch.float32, segment=6).cuda(), 21
        model.segment_recompute = True
        if case == "gpn compiled":
            model.compile()
    tokens = torch.randint(0, 60, (2, T + 1), generator=torch.Generator().manual_seed(0)).numpy()
    batch = collate((tokens, tokens * 0), eod_id=None).to(torch.device("cuda"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # the trainer's optimizer on CUDA
    if forced:
        registry.force(forced, "triton")
    try:
        for step in range(3):  # the first captures, the others replay
            graphed = _loss_and_grads(model, batch, "on")
            eager = _loss_and_grads(model, batch, "off")
            torch.testing.assert_close(graphed[0], eager[0], rtol=1e-5, atol=1e-6)
            for x, y in zip(graphed[1], eager[1]):  # compiled steps may fuse differently in the two runs
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)
            opt.step()  # in place, far above the tolerance, and without bumping versions: the next replay reads it
    finally:
        if forced:
            registry.force(forced, None)
    assert captured._state.replays > 0, captured.summary()
    # each graph keeps what it reads by address alive: its captured function, and through it the layer
    assert all(graph.keep is not None for graph in captured._state.graphs.values())
    captured.reset()


def test_the_rt_layer_benchmark_runs_its_table_on_a_cpu():
    """benchmarks/bench_rt_layer.py --dry-run: the GPU session's per-layer table (spec-003 §3.7's shape) at
    tiny shapes through the emulated graph backend."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks/bench_rt_layer.py"), "--dry-run", "--reps", "1",
                           "--profile", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| ours, CUDA graphs, fwd+bwd |" in proc.stdout
    assert "- batch 4: captured: rt_prefill forward 1 graph, rt_prefill backward 1 graph;" in proc.stdout
    # --profile: the layer's operators, captured and eager, its custom forward and backward among them
    # --no-eager: the graphs' rows alone (the refit's), the profile still of both
    graphs = subprocess.run([sys.executable, str(root / "benchmarks/bench_rt_layer.py"), "--dry-run", "--reps", "1",
                             "--no-eager", "--batches", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert graphs.returncode == 0, graphs.stdout[-2000:] + graphs.stderr[-2000:]
    assert "| ours, CUDA graphs, fwd+bwd |" in graphs.stdout and "| ours, eager" not in graphs.stdout
    for mode in ("captured", "eager"):
        table = proc.stdout.split(f"forward and backward at batch 2, {mode}, by operator")[1]
        assert "TiledPrefillBackward" in table.split("###")[0] and "aten::mm" in table.split("###")[0]
        # and summed a position, the forward apart from the backward
        assert f"- forward (batch 2, {mode}): " in table.split("###")[0] and "operators a position" in table
        assert f"- backward (batch 2, {mode}): " in table.split("###")[0]


def test_the_rt_layer_profile_summary_takes_the_backward_as_both_less_the_forward():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_rt_layer import per_position

    forward = {"gemm": (8, 80.0), "norm": (4, 8.0)}
    both = {"gemm": (24, 280.0), "norm": (8, 20.0), "tile_bwd": (4, 40.0)}
    fwd, bwd = per_position(forward, both, positions=4, what="kernels", top=2).splitlines()
    assert fwd.startswith("- forward: 22.0 us and 3.0 kernels a position (0.1 ms, 12 kernels, 4 positions)"), fwd
    assert "gemm 20.0 (2.0x); norm 2.0 (1.0x)" in fwd, fwd
    assert bwd.startswith("- backward: 63.0 us and 6.0 kernels a position"), bwd  # (200 + 12 + 40) / 4, (16 + 4 + 4) / 4
    assert "gemm 50.0 (4.0x); tile_bwd 10.0 (1.0x)" in bwd, bwd


def test_the_rt_layer_benchmark_ended_by_sigterm_prints_the_batches_it_finished():
    """gpu_session.sh gives the layer stage a time limit (`timeout`, SIGTERM): what was measured is printed as
    the table, not lost."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(root / "benchmarks/bench_rt_layer.py"), "--dry-run", "--reps",
                             "1000000"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()  # measuring starts: the handler is in place; batch 2's million reps never end
    proc.send_signal(signal.SIGTERM)
    out = first + proc.stdout.read()
    assert proc.wait(timeout=60) == 0, out[-2000:]
    assert first.startswith("measuring batches 2, 4") and "batch 2: stopped (SIGTERM)" in out, out[-2000:]
    assert "### One RT layer's forward" in out and "| ours, CUDA graphs, fwd+bwd |" in out, out[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture CUDA graphs")
def test_a_capture_broken_by_a_host_sync_falls_back_cleanly_on_cuda():
    """A region that reads a tensor on the host cannot be captured: under auto it is said once and runs
    eagerly, with the thread's stream and the allocator as they were (later work, eager and captured, is right)."""
    captured.reset(captured.CudaGraphs())
    lines, x = [], torch.arange(4.0, device="cuda")

    def syncs(t):
        return t * float(t.sum().item())

    stream = torch.cuda.current_stream()
    with captured.step("auto", log=lines.append):
        for _ in range(3):
            out = captured.region("syncing", syncs, [x])[0]
            torch.testing.assert_close(out, x * 6.0)
        assert torch.cuda.current_stream() == stream
        good = captured.region("fine", lambda t: t + 1, [x])[0]  # the next capture works
        torch.testing.assert_close(good, x + 1)
    assert len(lines) == 1 and "syncing runs eagerly from now on" in lines[0], lines
    assert "fine 1 graph" in captured.summary()
    captured.reset()


def test_regions_run_on_the_meta_device_of_a_dry_run():
    """`pretrain plan --dry-run` builds the model on the meta device, where autocast has no state: the
    regions and the recomputing backwards run there as anywhere."""
    assert captured.autocast_state(torch.device("meta")) == (False, None)
    with captured.autocast_as(torch.device("meta"), (False, None)):
        out = captured.region("meta", lambda t: t * 2, [torch.empty(3, device="meta")])
    assert out[0].device.type == "meta" and out[0].shape == (3,)


@pytest.mark.parametrize("kw", [dict(), dict(d_model=24, n_heads=3, ffn_hidden=40, n_layers=3)], ids=["tiny", "odd"])
def test_rt_captured_bytes_are_the_static_buffers_the_regions_hold(emulated, kw):
    """The planner's term for RT's captured loops (rt.captured_bytes) equals the buffers the regions keep, at
    two batches: on the H200 those 8,583 MiB at 512 x 512 were missing from its estimate."""
    from pretrain.data.batch import collate
    from pretrain.models.rt import captured_bytes

    model = test_rt.model_of(dtype=torch.float32, **kw)
    for B in (1, 3):
        captured.reset(emulated)
        tokens = torch.randint(0, test_rt.V, (B, 19), generator=torch.Generator().manual_seed(B))
        _loss_and_grads(model, collate((tokens.numpy(), tokens.numpy() * 0), eod_id=None), "on")
        held = captured.static_bytes()
        assert held == captured_bytes(model.cfg, 18, B), (B, held)  # 19 tokens: 18 inputs (data.seq_len's)


@pytest.mark.parametrize("kw", [dict(segment=5), dict(segment=4, tbptt=6), dict(segment=8, tbptt=4),
                                dict(segment=7, n_layers=2), dict(segment=5, reset_at_documents=True),
                                dict(segment=5, mem_heads=0, n_layers=1), dict(position0="uniform"), dict(segment=21)],
                         ids=["segments", "tbptt", "one-step-cuts", "two-layers", "doc-resets", "bare", "uniform", "one"])
def test_gpn_captured_bytes_are_the_static_buffers_the_segments_hold(emulated, kw):
    """The planner's term for GPN's captured segments (gpn.captured_bytes) equals the buffers the two bodies keep
    at two batches, the shorter last segment, truncation cuts (a one-step segment at a cut writes no gradient of
    G) and the document resets' keep included: on the H200 they were 2,786 MiB at 128 x 2,048, and the
    formula gives the same at gpn-m-130m's shape (tests/test_plan.py)."""
    from pretrain.models.gpn import captured_bytes, folded_numbers

    model = test_gpn.model_of(dtype=torch.float32, **kw)
    model.segment_recompute = True
    assert sum(t.numel() for t in model.folded().tensors()) == folded_numbers(model.cfg)
    for B in (1, 3):
        captured.reset(emulated)
        docs = torch.tensor([[0] * 9 + [1] * 13] * B).numpy() if kw.get("reset_at_documents") else None
        _loss_and_grads(model, test_gpn.batch_of(B=B, docs=docs), "on")
        held = captured.static_bytes()
        assert held == captured_bytes(model.cfg, 21, B), (B, held)  # 22 tokens: 21 inputs (data.seq_len's)
