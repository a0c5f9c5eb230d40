"""Normalisation ops, dispatched over paths (kernels/registry.py):

    rms_norm(x, weight, eps)           x / rms(x) * weight
    layer_norm(x, weight, bias, eps)   (x - mean) / std * weight (+ bias)

Paths of each:
    "torch"  the formula in float32 (float64 kept), cast back to x's dtype: every device; the models'
             norms have always computed exactly this (parallel/layers.py)
    "apex"   NVIDIA apex's fused CUDA kernels (apex.normalization), picked on a CUDA device when apex
             with its CUDA extension is installed; layer_norm only with a bias (apex's affine kernel
             takes one)
Whether apex is there is looked up once, at import, so a machine without it pays nothing per step and
hears nothing. The PyPI package named `apex` is another project: only a module apex.normalization with
fused_layer_norm counts.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import Tensor

from kernels import registry


def _apex_norms():
    """apex.normalization.fused_layer_norm, or None when apex (NVIDIA's, built with CUDA) is absent."""
    try:
        if importlib.util.find_spec("apex") is None or importlib.util.find_spec("apex.normalization") is None:
            return None
        module = importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception:  # a broken or foreign `apex`: the torch path serves
        return None
    if not all(hasattr(module, f) for f in ("fused_rms_norm_affine", "fused_layer_norm_affine")):
        return None
    return module


APEX = _apex_norms()


def at_least_fp32(x: Tensor) -> Tensor:
    """Norm statistics (and the models' logits) in float32 under bf16, kept in float64 when computed in
    it (the numerical tests compare paths, values and gradients, in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = at_least_fp32(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(x32.dtype)).to(x.dtype)


def layer_norm_torch(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    x32 = at_least_fp32(x)
    b = None if bias is None else bias.to(x32.dtype)
    return torch.nn.functional.layer_norm(x32, x.shape[-1:], weight.to(x32.dtype), b, eps).to(x.dtype)


def rms_norm_apex(x: Tensor, weight: Tensor, eps: float, apex=None) -> Tensor:
    return (apex or APEX).fused_rms_norm_affine(x, weight, x.shape[-1:], eps)


def layer_norm_apex(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, apex=None) -> Tensor:
    return (apex or APEX).fused_layer_norm_affine(x, weight, bias, x.shape[-1:], eps)


def _apex_capable(x: Tensor, *args) -> bool:
    return APEX is not None and x.is_cuda and x.dtype != torch.float64


RMS = registry.op("rms_norm")
RMS.register("apex", rms_norm_apex, _apex_capable, priority=20)
RMS.register("torch", rms_norm_torch, priority=10)
LAYER = registry.op("layer_norm")
LAYER.register("apex", layer_norm_apex, lambda x, w, b, eps: b is not None and _apex_capable(x), priority=20)
LAYER.register("torch", layer_norm_torch, priority=10)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return RMS(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return LAYER(x, weight, bias, eps)
