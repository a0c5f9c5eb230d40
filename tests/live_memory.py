"""The peak of live tensor memory over a piece of code, on any device (the CPU has no allocator
statistics): every storage an op creates is counted from its creation until Python frees it
(storages keep their Python object, so a weak reference to it sees the free).

    with LiveBytes() as live:
        loss.backward()
    live.peak   # bytes above what was alive before, at the worst moment

    step_peak(model, tokens, bf16)   # the same over one training forward and backward of a registry model

LiveBytes(where=True).where names the code running at the peak (file:function:line).
"""
from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LiveBytes(TorchDispatchMode):
    def __init__(self, exclude=(), where: bool = False):
        """exclude: tensors whose storages are never counted (parameters and their gradients: an op that
        returns one of them, a detach or an in-place add, makes nothing new). where: keep, in `where`, the
        innermost frame of this repository's code (file:function:line) running when the peak was reached."""
        super().__init__()
        self.live = self.peak = 0
        self.where = "" if where else None
        self._refs: dict[int, weakref.ref] = {}
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._refs and key not in self._exclude and storage.nbytes():
                    size = storage.nbytes()
                    self.live += size
                    if self.live > self.peak:
                        self.peak = self.live
                        if self.where is not None:
                            self.where = _frame()
                    self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        return out

    def _free(self, key: int, size: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= size


def _frame() -> str:
    """The innermost frame of this repository's code (not this file, not an installed package), as
    path:function:line."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_ROOT + os.sep) and "site-packages" not in path and path != __file__:
            return f"{os.path.relpath(path, _ROOT)}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "?"


def step_peak(model, tokens: torch.Tensor, bf16: bool = False, where: list | None = None) -> int:
    """LiveBytes' peak over one training forward and backward of a registry model on tokens [B, T] (each row
    one document, the next token its target), under CPU bf16 autocast when `bf16`. The model's parameters and
    the gradients they already hold are left out (the planner counts them apart; a backward that adds into a
    gradient makes nothing new)."""
    from pretrain.data.batch import Batch
    from pretrain.models.base import StepContext

    B, T = tokens.shape
    batch = Batch(tokens, torch.roll(tokens, -1, 1), torch.ones(B, T, dtype=torch.bool),
                  torch.zeros(B, T, dtype=torch.int32), torch.arange(T).expand(B, T))
    params = list(model.parameters())
    with LiveBytes([*params, *(p.grad for p in params if p.grad is not None)], where=where is not None) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch, StepContext.for_step(0, 0))[0]
        loss.backward()
    if where is not None:
        where.append(live.where)
    return live.peak
