"""GPN+M's fused memory step in Triton (kernels/delta_memory/triton_step.py, issue 37) against the definition,
reference.step: forward values and every gradient at odd shapes, through a chain of steps (the backward
through M), with bf16 inputs; how the "triton" path of delta_memory_step is picked and refused; and a tiny
GPN+M whose loss and gradients are the same on either path. On a CPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py); the path serves CPU calls only when forced."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs Triton (its interpreter runs the memory step's kernels on a CPU)")

from kernels import registry
from kernels.delta_memory import STEP, memory_step, reference

DEVICE = "cpu" if triton.knobs.runtime.interpret else "cuda" if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs Triton's interpreter (TRITON_INTERPRET=1 before triton "
                                "is imported) or a CUDA device to run the Triton kernels")
TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32, sums in another order than torch's bmm


def triton_step():
    from kernels.delta_memory import triton_step as module

    return module


def inputs(B, H, dk, dv, dtype=torch.float32, seed=0, T=None):
    """(M, k, v, beta, alpha, q) as the model makes them: unit keys, beta and alpha in (0, 1); M fp32. With T:
    k, v, beta, alpha, q carry a time dimension after B (one per step)."""
    g = torch.Generator().manual_seed(seed)
    t = () if T is None else (T,)
    M = torch.randn(B, H, dk, dv, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, *t, H, dk, generator=g), dim=-1)
    v, q = torch.randn(B, *t, H, dv, generator=g), torch.randn(B, *t, H, dk, generator=g)
    beta, alpha = torch.rand(B, *t, H, generator=g), 0.5 + 0.5 * torch.rand(B, *t, H, generator=g)
    return [M.to(DEVICE)] + [x.to(DEVICE, dtype) for x in (k, v, beta, alpha, q)]


def leaves(ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def grads_of(run, args, seed=5):
    """(outputs, gradients of every arg) of a random linear function of run(*args)'s outputs."""
    args = leaves(args)
    outs = run(*args)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, args)


NAMES = ("M", "k", "v", "beta", "alpha", "q")


@pytest.fixture(params=[None, 2048, 4096, 8192], ids=["default", "tile2048", "tile4096", "tile8192"])
def tile(request):
    """Each block size a GPU may measure and pick (the paths of delta_memory_blocks_forward and _backward),
    and the defaults."""
    from kernels.delta_memory import BLOCKS, TILES

    assert request.param is None or request.param in TILES
    for op in BLOCKS.values():
        op.force(None if request.param is None else str(request.param))
    yield request.param
    for op in BLOCKS.values():
        op.force(None)


@pytest.mark.parametrize("shape", [(3, 2, 5, 7), (2, 3, 32, 48), (1, 2, 40, 200)],
                         ids=["odd", "larger", "column-blocks"])
def test_one_step_and_all_its_gradients_equal_the_reference(shape, tile):
    """Odd sizes (masked blocks), and d_k x d_v past one block of columns (the backward's partial sums over
    column blocks, up to 7 of them at the smallest block size), at every block size."""
    args = inputs(*shape)
    want_out, want = grads_of(reference.step, args)
    got_out, got = grads_of(triton_step().step, args)
    for name, g, w in zip(("M_t", "o"), got_out, want_out):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"d{name}: {m}")
    assert got_out[0].is_contiguous() and got_out[1].is_contiguous()


def chain(step):
    """Steps with the memory fed back; returns every read and the last memory."""
    def run(M, k, v, beta, alpha, q):
        reads = []
        for t in range(k.shape[1]):
            M, o = step(M, k[:, t], v[:, t], beta[:, t], alpha[:, t], q[:, t])
            reads.append(o)
        return torch.stack(reads, 1), M
    return run


def test_a_chain_of_steps_backpropagates_through_the_memory():
    args = inputs(2, 3, 6, 9, T=4, seed=1)  # strided per-step slices of [B, T, H, ...] inputs, as in a loop
    want_out, want = grads_of(chain(reference.step), args)
    got_out, got = grads_of(chain(triton_step().step), args)
    for g, w in zip(got_out, want_out):
        torch.testing.assert_close(g, w, **TOL)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_bf16_inputs_with_an_fp32_state():
    """k, v, beta, alpha, q in bf16 (widened to fp32 on load): the reference's values on the widened inputs,
    M_t and o in M's dtype, each gradient in its input's dtype."""
    args = inputs(2, 2, 5, 7, dtype=torch.bfloat16, seed=2)
    want_out, want = grads_of(reference.step, [t.float() for t in args])
    got_out, got = grads_of(triton_step().step, args)
    assert [o.dtype for o in got_out] == [torch.float32] * 2
    assert [g.dtype for g in got] == [t.dtype for t in args]
    for g, w in zip(got_out, want_out):
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(got[0], want[0], **TOL)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2)  # rounded to bf16 once


@pytest.fixture
def forced_triton():
    registry.force("delta_memory_step", "triton")
    try:
        yield
    finally:
        registry.force("delta_memory_step", None)


def test_a_forced_triton_path_serves_memory_step(forced_triton):
    args = inputs(2, 3, 5, 7, seed=3)
    registry.reset_paths_used()
    M, o = memory_step(*args)
    assert registry.paths_used()["delta_memory_step"] == ["triton"]
    want_M, want_o = reference.step(*args)
    torch.testing.assert_close(M, want_M, **TOL)
    torch.testing.assert_close(o, want_o, **TOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's rule: on CUDA the Triton step is automatic")
def test_an_unforced_cpu_call_stays_on_the_reference():
    args = inputs(2, 3, 5, 7, seed=3)
    registry.reset_paths_used()
    memory_step(*args)
    assert registry.paths_used()["delta_memory_step"] == ["reference"]
    assert "only when forced" in STEP.paths["triton"].refusal(*args)


def test_a_forced_triton_path_refuses_a_float64_state_saying_why(forced_triton):
    args = [t.double() for t in inputs(2, 3, 5, 7)]
    with pytest.raises(registry.PathRefused, match="float32 state.*torch.float64"):
        memory_step(*args)


# -- a tiny GPN+M on either path ---------------------------------------------------------------------------
def tiny_gpn_loss_and_grads(path, compiled=False):
    from pretrain.data.batch import collate
    from pretrain.models.gpn import GPN, GPNConfig

    torch.manual_seed(0)
    model = GPN(GPNConfig(vocab_size=61, d_emb=16, d_state=24, d_ffn=32, mem_heads=3, d_key=5, d_value=7,
                          n_layers=2, segment=3)).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the zero-initialised matrices off zero, so every path carries gradient
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.1)
    raw = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2)).numpy()
    batch = collate((raw, raw * 0), eod_id=None).to(DEVICE)
    registry.force("delta_memory_step", path)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counters outlive dynamo.reset
    if compiled:  # train.compile: GPN compiles its step (GPN.compile), the memory op inside it
        torch._dynamo.reset()
        model.compile(backend="inductor")
    try:
        registry.reset_paths_used()
        loss, _ = model(batch)
        loss.backward()
        assert registry.paths_used()["delta_memory_step"] == [path]
        if compiled:  # the step did compile (a graph break would leave it eager and this test empty)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    finally:
        registry.force("delta_memory_step", None)
        torch._dynamo.reset()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_tiny_gpn_m_trains_alike_on_the_triton_step():
    want_loss, want = tiny_gpn_loss_and_grads("reference")
    got_loss, got = tiny_gpn_loss_and_grads("triton")
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_compiled_tiny_gpn_m_equals_eager_through_the_triton_step():
    """Inductor runs the custom ops through their fake functions (sizes and strides) and calls the real ones;
    issue 34's attention ops failed exactly there, so the memory op gets the same check."""
    want_loss, want = tiny_gpn_loss_and_grads("triton")
    got_loss, got = tiny_gpn_loss_and_grads("triton", compiled=True)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_the_measured_choice_keys_cuda_calls_only_and_builds_valid_stand_ins():
    """On CUDA the step's first call per shape times both paths (kernels/registry.py's measured choice); a
    CPU call has no key, so it keeps the static priority. The stand-ins are valid memory-step inputs."""
    from kernels.delta_memory import STEP, _step_inputs, _step_key

    assert STEP.measured is not None
    assert _step_key(*[a.cpu() for a in inputs(2, 3, 5, 7)]) is None
    (M, k, v, beta, alpha, q), kwargs = _step_inputs((2, 3, 5, 7, torch.float32, torch.bfloat16, True, "cpu"))
    assert not kwargs and M.shape == (2, 3, 5, 7) and M.dtype == torch.float32 and k.dtype == torch.bfloat16
    assert all(t.requires_grad for t in (M, k, v, beta, alpha, q))
    torch.testing.assert_close(k.float().norm(dim=-1), torch.ones(2, 3), atol=1e-2, rtol=0)
    assert 0 < beta.min() and beta.max() < 1 and 0 < alpha.min() and alpha.max() < 1
    out, read = reference.step(M, k.float(), v.float(), beta.float(), alpha.float(), q.float())
    assert out.shape == M.shape and read.shape == (2, 3, 7)


def test_the_block_sizes_are_measured_choices_on_cuda_only_with_valid_stand_ins():
    """The forward's and the backward's block sizes are paths of two measured ops (kept across a resume with
    the other measured choices): the defaults by priority, a CPU call unmeasured, and the stand-ins of a key
    valid launches whose outputs are the reference's."""
    from kernels.delta_memory import BLOCKS, DEFAULT_TILE, TILES, _blocks_inputs, _blocks_key

    args = inputs(2, 3, 5, 7)
    for kind, op in BLOCKS.items():
        assert op.measured is not None and set(op.paths) == {str(t) for t in TILES}
        assert op.pick(*args, *args[:2]).name == str(DEFAULT_TILE[kind])  # by priority where unmeasured
        assert _blocks_key(*[a.cpu() for a in args]) is None
    key = (2, 3, 5, 7, torch.float32, torch.float32, DEVICE)
    (M, k, v, beta, alpha, q, Mt, o), _ = _blocks_inputs("forward", key)
    for tile in TILES:
        BLOCKS["forward"].paths[str(tile)].fn(M, k, v, beta, alpha, q, Mt, o)
        want = reference.step(M, k, v, beta, alpha, q)
        torch.testing.assert_close(Mt, want[0], **TOL)
        torch.testing.assert_close(o, want[1], **TOL)
    stand_ins, _ = _blocks_inputs("backward", key)
    ins, (dMt, do), outs = stand_ins[:6], stand_ins[6:8], stand_ins[8:]
    leaf = leaves(ins)
    Mt_ref, o_ref = reference.step(*leaf)
    want = torch.autograd.grad((Mt_ref, o_ref), leaf, (dMt, do))
    for tile in TILES:
        BLOCKS["backward"].paths[str(tile)].fn(*ins, dMt, do, *outs)
        for name, g, w in zip(NAMES, outs, want):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name, tile=tile: f"d{name} at {tile}: {m}")
