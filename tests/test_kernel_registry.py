"""kernels/registry.py: an op with two registered paths is dispatched by capability and priority,
forced (in code and by PRETRAIN_KERNELS), refused when a forced path cannot serve the call, and
reported per op, compiled or not."""
import os
import subprocess
import sys

import pytest
import torch

from kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def op():
    """A test op: `fast` serves float32 only (priority 10), `plain` serves anything."""
    name = "test_scale"
    registry._OPS.pop(name, None)
    o = registry.op(name)
    o.register("fast", lambda x: x * 2.0, capable=lambda x: x.dtype == torch.float32, priority=10)
    o.register("plain", lambda x: x + x)
    registry.reset_paths_used()
    yield o
    registry._OPS.pop(name, None)
    registry._used.pop(name, None)


def test_dispatch_by_capability_and_priority(op):
    assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert registry.paths_used()["test_scale"] == ["fast"]
    op(torch.ones(2, dtype=torch.float64))  # fast cannot serve float64: the next capable path does
    assert registry.paths_used()["test_scale"] == ["fast", "plain"]
    registry.reset_paths_used()
    assert "test_scale" not in registry.paths_used()


def test_forced_path_runs_and_an_incapable_forced_path_is_refused(op):
    registry.force("test_scale", "plain")
    op(torch.ones(2))
    assert registry.paths_used()["test_scale"] == ["plain"]
    registry.force("test_scale", "fast")
    with pytest.raises(ValueError, match="the test_scale path 'fast' .* cannot serve this call"):
        op(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="'nope' is not a test_scale path; choose one of fast, plain"):
        registry.force("test_scale", "nope")
    with pytest.raises(ValueError, match="'missing' is not a kernel op"):
        registry.force("missing", "fast")
    registry.force("test_scale", None)
    op(torch.ones(2))
    assert registry.paths_used()["test_scale"] == ["fast", "plain"]
    with pytest.raises(ValueError, match="already has a path named 'fast'"):
        op.register("fast", lambda x: x)


def test_reported_under_torch_compile(op):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: op(x) + 1, fullgraph=True, backend="aot_eager")
    assert compiled(torch.ones(3)).tolist() == [3.0] * 3
    assert registry.paths_used()["test_scale"] == ["fast"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(torch.ones(3))  # recorded at trace time (registry._note_used): no retrace at the second call
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert registry.paths_used()["test_scale"] == ["fast"]


def run(code, **env):
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT, **env},
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout.strip(), out.stderr.strip().splitlines()[-1:] or [""]


def test_environment_forces_per_op_and_bad_values_are_one_sentence():
    code = ("import torch, kernels, kernels.attention as a; x = torch.randn(1, 1, 3, 2); "
            "a.attention(x, x, x, a.causal()); print(kernels.describe_paths_used())")
    assert run(code, PRETRAIN_KERNELS="attention=reference")[:2] == (0, "attention reference")
    assert run(code, PRETRAIN_KERNELS="")[:2] == (0, "attention sdpa")
    rc, _, err = run(code, PRETRAIN_KERNELS="attention=cudnn")
    assert rc == 1 and "PRETRAIN_KERNELS='cudnn' is not an attention path; choose one of flash_attn, triton, flex, sdpa" in err[0]
    rc, _, err = run(code, PRETRAIN_KERNELS="attention=triton", TRITON_INTERPRET="0")  # a GPU kernel on the CPU
    assert rc == 1 and "the attention path 'triton' (forced by PRETRAIN_KERNELS) cannot serve this call" in err[0]
    rc, _, err = run(code, PRETRAIN_KERNELS="attention")
    assert rc == 1 and "each entry must be op=path" in err[0]


def test_a_refused_forced_path_says_why_when_it_can(op):
    op.register("picky", lambda x: x, refusal=lambda x: None if x.dim() == 1 else "it takes vectors only", auto=False)
    registry.force("test_scale", "picky")
    assert op(torch.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(registry.PathRefused, match="'picky' .* cannot serve this call: it takes vectors only; unset"):
        op(torch.ones(2, 2))
    assert registry.forced()["test_scale"] == "picky"
    registry.force("test_scale", None)
    assert "test_scale" not in registry.forced()
    assert op(torch.ones(2, 2)).shape == (2, 2)  # unforced, refusal is only a capability check


def test_the_probe_refuses_a_forced_path_before_training_and_passes_one_that_serves():
    """pretrain/kernel_probe.py: the model's training forward on fake tensors (no memory, no compute)."""
    import kernels.attention as attn
    from pretrain.kernel_probe import check_forced_paths
    from pretrain.models import get_arch

    cfg = get_arch("baseline").config_cls(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                                          document_mask=True)
    cpu = torch.device("cpu")
    check_forced_paths(cfg, 64, cpu, torch.float32, None)  # nothing forced: nothing to probe
    try:
        attn.use_path("flash_attn")
        with pytest.raises(registry.PathRefused, match="before training model.arch=baseline on cpu: the attention "
                           "path 'flash_attn' .* the flash_attn package is not installed"):
            check_forced_paths(cfg, 64, cpu, torch.float32, None)
        attn.use_path("reference")
        attn.reset_paths_used()
        check_forced_paths(cfg, 64, cpu, torch.float32, None)
        assert attn.paths_used() == {"reference"}  # the forward reached attention and it served
    finally:
        attn.use_path(None)
