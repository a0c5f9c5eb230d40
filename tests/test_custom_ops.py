"""Every torch custom op the project registers, checked by torch.library.opcheck on a CPU, and the
compiled model that runs them equal to eager (issue 34: a fake function that disagreed with its real
one about strides crashed compiled training on an H100).

* The ops are found, not listed: every module under kernels/ is imported and the `pretrain::` namespace
  read off the dispatcher; the sources are also scanned for custom_op("pretrain::...") so an op in a
  module that failed to import is not missed. Each op needs sample inputs in SAMPLES (a new op without
  them fails here), over contiguous and permuted ([B, H, T, D] views of [B, T, H, D]) inputs, fp32 and
  bf16. The Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py).
* A tiny document-masked baseline, compiled by inductor through the forced "triton" attention path,
  gives eager's loss and gradients.
"""
import importlib
import os
import pkgutil
import re

import pytest
import torch

import kernels

triton = pytest.importorskip("triton", reason="needs Triton (its interpreter runs the kernels on a CPU)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "pretrain"
# where the kernels run: the CPU under the interpreter (CI; conftest.py sets it before triton is imported), else CUDA
DEVICE = "cpu" if triton.knobs.runtime.interpret else "cuda" if torch.cuda.is_available() else None
needs_device = pytest.mark.skipif(DEVICE is None, reason="needs Triton's interpreter (TRITON_INTERPRET=1 before "
                                  "triton is imported) or a CUDA device to run the Triton kernels")


def registered_ops() -> list[str]:
    """The custom ops of our namespace, after importing every kernels module."""
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        importlib.import_module(info.name)
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{NAMESPACE}::"))


def declared_ops() -> set[str]:
    """custom_op("pretrain::...") names written anywhere in the project's packages."""
    found = set()
    for package in ("kernels", "pretrain", "parallel"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name)) as f:
                        found.update(re.findall(rf"""custom_op\(\s*["']({NAMESPACE}::\w+)["']""", f.read()))
    return found


def qkv(layout, dtype, B=2, H=4, H_kv=2, T=20, D=16, requires_grad=False):
    """q [B, H, T, D] and k, v [B, H_kv, T, D], contiguous or as the models pass them (permuted views)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for heads in (H, H_kv, H_kv):
        if layout == "permuted":
            t = torch.randn(B, T, heads, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
        else:
            t = torch.randn(B, heads, T, D, generator=g).to(DEVICE, dtype)
        out.append(t.requires_grad_(requires_grad))
    return out


def lists(B=2, T=20):
    """The tile lists of a causal document mask (partial, full and empty tiles at 16 x 16)."""
    from kernels.attention import masks
    from kernels.attention.runs import tile_lists

    doc_ids = torch.tensor([[0] * 3 + [1] * 9 + [2] * 8, [0] * 17 + [1] * 3], device=DEVICE)[:B, :T]
    return tile_lists(masks.causal() & masks.document(doc_ids), B, T, T, 0, 16, 16, DEVICE).tensors()


def forward_sample(layout, dtype):
    q, k, v = qkv(layout, dtype, requires_grad=True)
    return (q, k, v, *lists(), 0.25, 16, 16)


def backward_sample(layout, dtype):
    q, k, v = qkv(layout, dtype)
    tiles = lists()
    out, lse = torch.ops.pretrain.block_sparse_attention(q, k, v, *tiles, 0.25, 16, 16)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    if layout == "permuted":  # the cotangent in the layout autograd hands it over in
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
    return (do, q, k, v, out, lse, *tiles, 0.25, 16, 16)


def memory_inputs(layout, dtype, B=2, H=3, dk=5, dv=7, requires_grad=False):
    """GPN+M's step inputs (M, k, v, beta, alpha, q): the state M stays fp32 (the model keeps it so under
    bf16), the others in dtype; "permuted": strided views, M's last dimension included."""
    g = torch.Generator().manual_seed(2)
    shapes = {"contiguous": [(B, H, dk, dv), (B, H, dk), (B, H, dv), (B, H), (B, H), (B, H, dk)],
              "permuted": [(B, H, dv, dk), (B, dk, H), (H, B, dv), (H, B), (H, B), (B, dk, H)]}[layout]
    views = {"contiguous": [lambda t: t] * 6,
             "permuted": [lambda t: t.transpose(-1, -2), lambda t: t.transpose(1, 2), lambda t: t.transpose(0, 1),
                          lambda t: t.t(), lambda t: t.t(), lambda t: t.transpose(1, 2)]}[layout]
    out = []
    for i, (shape, view) in enumerate(zip(shapes, views)):
        t = torch.randn(shape, generator=g)
        if i in (3, 4):  # beta, alpha in (0, 1)
            t = torch.sigmoid(t)
        out.append(view(t.to(DEVICE, torch.float32 if i == 0 else dtype)).requires_grad_(requires_grad))
    return out


def memory_forward_sample(layout, dtype):
    return tuple(memory_inputs(layout, dtype, requires_grad=True))


def memory_backward_sample(layout, dtype):
    M, *rest = memory_inputs(layout, dtype)
    g = torch.Generator().manual_seed(3)
    B, H, _, dv = M.shape
    dMt, do = torch.randn(M.shape, generator=g).to(DEVICE), torch.randn(B, H, dv, generator=g).to(DEVICE)
    if layout == "permuted":
        dMt = dMt.transpose(-1, -2).contiguous().transpose(-1, -2)
    return (dMt, do, M, *rest)


SAMPLES = {  # op -> (layout, dtype) -> its positional arguments
    "pretrain::block_sparse_attention": forward_sample,
    "pretrain::block_sparse_attention_backward": backward_sample,
    "pretrain::delta_memory_step": memory_forward_sample,
    "pretrain::delta_memory_step_backward": memory_backward_sample,
}
OPS = registered_ops()


def test_every_registered_custom_op_has_samples_here():
    assert OPS, "no pretrain:: custom op registered: did the kernels modules stop importing?"
    assert declared_ops() <= set(OPS), "an op is declared in the sources but was not registered by importing kernels/"
    missing = set(OPS) - set(SAMPLES)
    assert not missing, f"add sample inputs to SAMPLES for {sorted(missing)} so opcheck covers them"


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, layout, dtype):
    """All of opcheck's utilities (schema, autograd registration, fake tensor with strides compared, AOT
    dispatch with dynamic shapes); the fake check is the one that catches issue 34's crash."""
    if name not in SAMPLES:
        pytest.skip(f"{name} has no sample inputs (test_every_registered_custom_op_has_samples_here fails)")
    op = getattr(getattr(torch.ops, NAMESPACE), name.split("::")[1]).default
    args = SAMPLES[name](layout, dtype)
    torch.library.opcheck(op, args)


@needs_device
def test_outputs_follow_their_inputs_layout():
    """dq, dk, dv and out in their input's layout (no copy after a permuted view), lse contiguous."""
    do, q, k, v, out, lse, *rest = backward_sample("permuted", torch.float32)
    assert out.stride() == q.stride() and lse.is_contiguous()
    dq, dk, dv = torch.ops.pretrain.block_sparse_attention_backward(do, q, k, v, out, lse, *rest)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


# -- the model, compiled through the forced Triton path ------------------------------------------------
def tiny_document_model_and_batch(n_layers=1):
    from pretrain.data import collate
    from pretrain.models import get_arch

    spec = get_arch("baseline")
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(vocab_size=97, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                       max_seq_len=64, document_mask=True))
    samples = torch.randint(3, 97, (2, 41), generator=torch.Generator().manual_seed(0)).numpy()
    samples[0, [5, 6, 20]] = 2  # documents, one of a single token
    samples[1, 30] = 2
    doc_ids = (samples == 2).cumsum(1) - (samples == 2)
    return model, collate((samples, doc_ids.astype("int32")), eod_id=2)


def loss_and_grads(model, batch, run=None):
    model.zero_grad(set_to_none=True)
    loss, _ = (model if run is None else run)(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_device
def test_compiled_document_masked_model_equals_eager_through_the_triton_path():
    """Issue 34's CPU reproduction: before the fakes agreed with the real ops, inductor's stride check
    failed at the first backward ("expected size 4==4, stride 512==16 at dim=1"). fp32 throughout."""
    import kernels.attention as attn

    model, batch = tiny_document_model_and_batch()
    model, batch = model.to(DEVICE), batch.to(DEVICE)
    attn.use_path("triton")
    try:
        attn.reset_paths_used()
        want_loss, want = loss_and_grads(model, batch)
        torch._dynamo.reset()
        got_loss, got = loss_and_grads(model, batch, torch.compile(model, backend="inductor"))
    finally:
        attn.use_path(None)
        torch._dynamo.reset()
    assert attn.paths_used() == {"triton"}
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@needs_device
def test_a_compiled_model_builds_the_masks_tile_lists_once_not_per_layer():
    """Under a whole-model compile the mask is made inside the graph and caches its views there (masks.py,
    Mask.cached): the tile lists' scans and sorts appear once for three layers (they appeared once per layer,
    12 copies at baseline/s for inductor to compile on a GPU), and the compiled run equals the eager one."""
    import collections

    import kernels.attention as attn

    model, batch = tiny_document_model_and_batch(n_layers=3)
    model, batch = model.to(DEVICE), batch.to(DEVICE)
    ops = collections.Counter()

    def counting(gm, inputs):
        ops.update(str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                   if n.op in ("call_function", "call_method"))
        return gm.forward

    attn.use_path("triton")
    try:
        want_loss, want = loss_and_grads(model, batch)
        torch._dynamo.reset()
        got_loss, got = loss_and_grads(model, batch, torch.compile(model, backend=counting, fullgraph=True))
    finally:
        attn.use_path(None)
        torch._dynamo.reset()
    assert ops["block_sparse_attention.default"] == 3, ops
    # document_bounds' one cummax and cummin; the forward's and the backward's partial and full lists: 4 sorts
    assert (ops["cummax"], ops["cummin"], ops["argsort"]) == (1, 1, 4), ops
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
