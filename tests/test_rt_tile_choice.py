"""The RT tile's measured choice (kernels/rt_prefill: ops rt_tile_update and rt_tile_grads). On CUDA the
"tiled" path runs each tile shape on the faster of the PyTorch tile and the Triton tile, measured on the
shape's first call; on a CPU nothing is measured and the PyTorch tile runs, as before. Here the choice runs on
the CPU: the key and the Triton tile opened to it (Triton's interpreter), and a fake clock on which the
Triton tile is the faster for tiles of at most two keys only. The layer then takes each tile from the path
its shape chose, and equals the PyTorch tile's layer, forward and every gradient."""
import pytest
import torch

from kernels import registry
from kernels.rt_prefill import GRADS, MEASURED_OPS, UPDATE, _grads_inputs, _update_inputs, tile_fields, tiled
from kernels.triton_support import HAVE_TRITON, interpreting

from pretrain.models.rt import LayerView

import test_rt

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1) to run the Triton tile on a CPU")


@pytest.fixture
def opened(monkeypatch):
    """Both tile ops measured on the CPU, on a fake clock: (the path that ran last, its keys) -> seconds."""
    ran = []

    def timer(run):
        run()
        path, keys = ran[-1]
        return {"triton": 1.0, "torch": 2.0}[path] if keys <= 2 else {"triton": 2.0, "torch": 1.0}[path]

    was = registry.measuring()
    registry.measuring(True)
    registry.reset_choices()
    for op, inputs in ((UPDATE, _update_inputs), (GRADS, _grads_inputs)):
        for name, path in list(op.paths.items()):
            def fn(qs, k, *rest, _fn=path.fn, _name=name):
                ran.append((_name, k.shape[2]))
                return _fn(qs, k, *rest)
            monkeypatch.setitem(op.paths, name, registry.Path(name, fn, None, path.priority, True, None))
        monkeypatch.setattr(op, "_automatic", sorted(op.paths.values(), key=lambda p: -p.priority))
        monkeypatch.setattr(op, "measured", registry.Measured(tile_fields, inputs, timer=timer))
    yield ran
    registry.reset_choices()
    registry.measuring(was)


def test_each_tile_shape_runs_on_the_path_it_measured_faster_and_the_layer_is_unchanged(opened):
    model = test_rt.model_of(dtype=torch.float32, d_model=32, n_heads=2, positions="alibi")
    view = LayerView(model.blocks[0], None, 0)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for ops in (None, MEASURED_OPS):  # the PyTorch tile alone, then the measured choice
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        z = tiled.prefill(xi, view, 1, ops=ops)
        z.pow(2).sum().backward()
        results.append([z.detach(), xi.grad, *(p.grad for p in model.blocks[0].parameters())])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for op in ("rt_tile_update", "rt_tile_grads"):
        chosen = {c.key[3]: c.path for c in registry.choices()[op]}  # keys per tile -> path
        assert chosen == {n: "triton" if n <= 2 else "torch" for n in (1, 2, 4, 8)}, (op, chosen)
    opened.clear()  # measured once per shape: a second step runs each tile on its chosen path, measuring nothing
    xi = x.clone().requires_grad_()
    tiled.prefill(xi, view, 1, ops=MEASURED_OPS).pow(2).sum().backward()
    assert {path for path, keys in opened if keys <= 2} == {"triton"}, opened
    assert {path for path, keys in opened if keys > 2} == {"torch"}, opened
    assert len(opened) == 2 * 15  # 15 tiles of N = 16, each updated in the forward and differentiated once


def test_on_a_cpu_the_tiled_path_runs_the_pytorch_tile_unmeasured():
    """Unopened, a CPU call has no key: no measurement, the PyTorch tile (no CPU test or golden curve moves)."""
    registry.reset_choices()
    model = test_rt.model_of(dtype=torch.float32, d_model=32, n_heads=2)
    view = LayerView(model.blocks[0], None, 0)
    x = torch.randn(2, 8, 32)
    from kernels.rt_prefill import rt_prefill

    torch.testing.assert_close(rt_prefill(x, view, 1), tiled.prefill(x, view, 1), rtol=0, atol=0)
    assert not registry.choices().get("rt_tile_update") and not registry.choices().get("rt_tile_grads")
    assert UPDATE.pick(*_update_inputs((1, 2, 4, 4, 16, torch.float32, None, True, "cpu", False))[0]).name == "torch"
