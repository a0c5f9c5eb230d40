"""No architecture reads device data on the host in its training forward or backward: on a GPU each such
read (.item(), bool(tensor), a boolean-mask index, nonzero) stalls the host until the device catches up,
breaks a torch.compile graph and fails a CUDA graph capture. The trainer's one sync a step is its own
(pretrain/trainer.py, _step_or_skip). Checked on the meta device, where device tensors hold no data: a
dispatch mode names every such op on a meta tensor (host-side draws on CPU tensors, CRT's K, are allowed)."""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.captured import host_read
from pretrain.config import load_config
from pretrain.data.batch import Batch
from pretrain.models.base import StepContext
from pretrain.models.registry import meta_model

ROOT_MARK = "/pretrain/"


class HostReads(TorchDispatchMode):
    """Records ops that read a meta (device) tensor's data on the host, with where the model called them."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reads = host_read(func, args, kwargs) is not None
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if reads and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in leaves):
            frames = [f for f in traceback.extract_stack() if ROOT_MARK in f.filename or "/kernels/" in f.filename]
            self.found.append(f"{func.name()} at " + " < ".join(f"{f.filename.rsplit('/', 2)[-2]}/"
                                                                  f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                                                  for f in frames[::-1][:3]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config, overrides", [
    ("baseline/tiny", ["model.document_mask=true"]), ("sps/tiny", []), ("cart/tiny", ["model.document_mask=true"]),
    ("crt/tiny", ["model.document_mask=true"]), ("rt/tiny", []), ("gpn/tiny", []), ("gpn/tiny", ["model.mem_heads=0"]),
], ids=["baseline", "sps", "cart", "crt", "rt", "gpn-m", "gpn"])
def test_the_training_forward_and_backward_read_no_device_data_on_the_host(config, overrides):
    cfg = load_config(config, overrides, check_data=False)
    model = meta_model(cfg.model).train()
    B, T, meta = 2, cfg.data.seq_len, torch.device("meta")
    tokens = torch.zeros(B, T, dtype=torch.long, device=meta)
    doc_ids = torch.zeros(B, T, dtype=torch.int32, device=meta)
    batch = Batch(tokens, tokens, torch.ones(B, T, dtype=torch.bool, device=meta), doc_ids,
                  torch.arange(T, device=meta).expand(B, T))
    reads = HostReads()
    try:
        with reads, torch.compiler.set_stance("force_eager"):
            loss = model(batch, StepContext.for_step(1, 0))[0]
            loss.backward()
    except (RuntimeError, NotImplementedError):  # a meta tensor's read fails after it is recorded: say where
        if not reads.found:
            raise
    assert reads.found == [], reads.found
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the backward ran through


def test_a_host_read_is_named_where_the_model_makes_it():
    reads = HostReads()
    x = torch.zeros(4, device="meta")
    with reads, pytest.raises((RuntimeError, NotImplementedError)):
        x.sum().item()  # on meta it then fails: the record is made first
    assert len(reads.found) == 1 and reads.found[0].startswith("aten::_local_scalar_dense at ")
