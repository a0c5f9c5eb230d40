"""What megatron-core needs to run on a CPU-only torch build (gloo), applied narrowly.

megatron-core assumes CUDA in a few places (see shared/design/CPU_NOTES.md, section 1c). Two kinds of
workaround, applied only when no GPU is present:

* `install()` (once, at import of a megatron facade): replaces the torch.cuda functions that
  megatron calls unconditionally (current_device, synchronize, streams, the CUDA RNG state) and
  megatron's own CUDA-RNG helpers. On a CPU-only build these functions would raise, so nothing that
  works today changes; our model and trainer never call them.
* `scoped()`: a context entered only around megatron-core calls that build tensors with a hard-coded
  device="cuda" (its optimizer's grad norm and clipping, its DDP buffers) or dispatch on
  `tensor.type()`. It rewrites those two things while inside and is a no-op with a GPU, so the
  trainer's forward and backward never run under a TorchFunctionMode.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def needed() -> bool:
    return not torch.cuda.is_available()


class _NoStream:
    """Stands in for torch.cuda streams: megatron's DDP waits on them around gradient syncs."""

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass


def install() -> None:
    """Patch the torch.cuda calls megatron makes unconditionally (CPU-only machines; idempotent)."""
    global _installed
    if _installed or not needed():
        return
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.default_stream = lambda *a, **k: _NoStream()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # not torch.manual_seed: it calls torch.cuda.manual_seed_all, which would recurse if patched too
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _installed = True


class _CudaToCpu(TorchFunctionMode):
    """Tensor factories called with device="cuda" get the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


_plain_type = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    # megatron's optimizers accept only 'torch.cuda.*Tensor' parameters
    if dtype is None:
        name = _plain_type(self)
        if name in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    return _plain_type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def scoped():
    """Run a megatron-core call that hard-codes CUDA tensors; a no-op when a GPU is present."""
    if not needed():
        yield
        return
    install()
    torch.Tensor.type = _cuda_named_type
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.Tensor.type = _plain_type
