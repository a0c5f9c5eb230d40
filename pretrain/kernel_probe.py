"""A forced kernel path that cannot serve the model, refused before a run starts (issue 34).

A path forced by PRETRAIN_KERNELS (or in code) is checked by its op's dispatcher at every call
(kernels/registry.py); left to the first training step, the refusal came after the run directory, the
data and the compilation. `check_forced_paths` runs the model's training forward once beforehand, on
fake tensors (torch's FakeTensorMode: shapes, dtypes and devices without memory or compute) on the
run's device, in its parameter and autocast dtypes, with gradients on: every dispatched call sees what
the first step's will, and a forced path that refuses one raises its PathRefused (one sentence naming
the path and why). Any other failure of the fake forward (an op that needs tensor data) ends the probe
without a verdict: the first step still checks every call. Nothing is forced: nothing to probe.
"""
from __future__ import annotations

import torch

from kernels import registry
from pretrain.data.batch import Batch
from pretrain.models.base import EVAL, StepContext
from pretrain.models.registry import get_arch, meta_model


def _fake_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the meta model's parameters and buffers by fake ones on `device` (floating ones in
    `dtype`), in place; a tensor shared by several modules (tied weights) stays shared."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            e = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            made[id(t)] = torch.nn.Parameter(e, t.requires_grad) if param else e
        return made[id(t)]

    for m in model.modules():
        for table, param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t, param)


def check_forced_paths(model_cfg, seq_len: int, device: torch.device, param_dtype: torch.dtype,
                       autocast_dtype: torch.dtype | None, seed: int = 0) -> None:
    """Raise the PathRefused a forced kernel path would raise in the first training step of this
    model on `device` (one sample of seq_len tokens, one document); return quietly otherwise."""
    get_arch(model_cfg.arch)  # its modules imported: their ops created, each with its forced path
    if not registry.forced():
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = meta_model(model_cfg)  # the single-device model: a forced path's checks read no TP split
    model.train()
    # the first step's context; an evaluation's when that one needs data (CRT draws its depth with .item())
    for ctx in (StepContext.for_step(seed, 0), EVAL):
        try:
            # force_eager: a path's own torch.compile (FlexAttention) runs eagerly on the fake tensors
            with FakeTensorMode(), torch.compiler.set_stance("force_eager"), torch.enable_grad():
                _fake_weights(model, device, param_dtype)
                tokens = torch.zeros(1, seq_len, dtype=torch.long, device=device)
                batch = Batch(tokens, tokens, torch.ones_like(tokens, dtype=torch.bool),
                              torch.zeros_like(tokens, dtype=torch.int32), torch.arange(seq_len, device=device)[None])
                with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                    model(batch, ctx)
            return
        except registry.PathRefused as e:
            raise registry.PathRefused(f"before training model.arch={model_cfg.arch} on {device.type}: {e}") from None
        except Exception:  # noqa: BLE001, S112  (no verdict from this forward: the first step checks every call)
            continue
