"""AdamW, its parameter groups, a stateless learning-rate schedule and gradient clipping.

The schedule is a pure function of the step number (`lr_at`), applied with `set_lr` before
each optimizer step: resuming needs only the step, never a scheduler state dict.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from parallel.grads import clip_grad_norm, set_lr  # noqa: F401  (applied by the engines)

SCHEDULE_KINDS = ("wsd", "cosine", "constant")


@dataclass
class OptimConfig:
    """AdamW hyper-parameters; `grad_clip` 0 disables clipping, `fused` None picks automatically."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    fused: bool | None = None

    def validate(self) -> None:
        """Raise ValueError with one sentence naming the first bad field."""
        if not (0 < self.lr < math.inf):
            raise ValueError(f"optim.lr must be positive and finite, got {self.lr}")
        if not (0 <= self.min_lr <= self.lr):
            raise ValueError(f"optim.min_lr must be between 0 and optim.lr ({self.lr}), got {self.min_lr}")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not (0 <= beta < 1):
                raise ValueError(f"optim.{name} must be in [0, 1), got {beta}")
        if not (0 < self.eps < math.inf):
            raise ValueError(f"optim.eps must be positive and finite, got {self.eps}")
        if not (0 <= self.weight_decay < math.inf):
            raise ValueError(f"optim.weight_decay must be non-negative and finite, got {self.weight_decay}")
        if not (0 <= self.grad_clip < math.inf):
            raise ValueError(f"optim.grad_clip must be non-negative and finite (0 disables), got {self.grad_clip}")
        if self.fused not in (None, True, False):
            raise ValueError(f"optim.fused must be true, false or null, got {self.fused!r}")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then wsd, cosine or constant (see `lr_at`)."""

    kind: str = "wsd"
    warmup_steps: int = 100
    decay_fraction: float = 0.1

    def validate(self, total_steps: int) -> None:
        """Raise ValueError with one sentence naming the first bad field."""
        if self.kind not in SCHEDULE_KINDS:
            valid = ", ".join(repr(k) for k in SCHEDULE_KINDS)
            raise ValueError(f"schedule.kind must be one of {valid}, got {self.kind!r}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        w = self.warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or not (0 <= w < total_steps):
            raise ValueError(f"schedule.warmup_steps must be an integer in [0, total_steps={total_steps}), got {w!r}")
        if not (0 < self.decay_fraction <= 1):
            raise ValueError(f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}")


def lr_at(step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate for optimizer step `step` (counted from 0) of a `total_steps`-step run.

    With W = warmup_steps, L = total_steps - 1 (the last step), lr and min_lr from `optim`:

    * warmup, step < W:  lr * (step + 1) / W  (never 0, reaches lr at step W - 1)
    * constant:          lr
    * cosine:            min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,  p = (step - W) / (L - W)
                         (lr at step W, min_lr at step L; p = 1 when W == L)
    * wsd:               lr until the decay phase, then min_lr + (lr - min_lr) * (1 - p),
                         p = (step - D + 1) / (L + 1 - D), D = L + 1 - max(1, round(decay_fraction
                         * total_steps)) clamped to >= W: the last D steps decay, the first of them
                         already below lr, the last exactly min_lr.

    Steps past L keep the final value (min_lr, or lr for constant) so an over-long run stays sane.
    Interpolations are written as `min_lr + (lr - min_lr) * x` so that x = 0 gives min_lr exactly.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    lr, min_lr, warmup, last = optim.lr, optim.min_lr, schedule.warmup_steps, total_steps - 1
    if step < warmup:
        return lr * ((step + 1) / warmup)  # (step+1)/warmup first, so step W-1 gives exactly lr
    step = min(step, last)
    if schedule.kind == "constant":
        return lr
    if schedule.kind == "cosine":
        p = 1.0 if last <= warmup else (step - warmup) / (last - warmup)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if schedule.kind == "wsd":
        decay_start = max(warmup, total_steps - max(1, round(schedule.decay_fraction * total_steps)))
        if step < decay_start:
            return lr
        p = (step - decay_start + 1) / (total_steps - decay_start)
        return min_lr + (lr - min_lr) * (1.0 - p)
    valid = ", ".join(repr(k) for k in SCHEDULE_KINDS)
    raise ValueError(f"schedule.kind must be one of {valid}, got {schedule.kind!r}")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: [decayed matrices and embeddings (ndim >= 2), undecayed vectors].

    Decaying norm gains and biases only pulls them toward 0 and hurts, so they are left alone.
    `model.parameters()` yields a tied (shared) parameter once, so each lands in exactly one group;
    its order is kept so the optimizer state layout is deterministic. Frozen parameters are skipped.
    Both groups are always returned (possibly empty) so group 0 / group 1 mean the same thing in
    every checkpoint. Extra keys (e.g. parameter names) would survive a state_dict round trip, but
    are left out to keep the groups plain.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to optimize")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _fused_devices() -> frozenset[str]:
    """Device types with fused AdamW kernels in this torch (a private torch helper, hence guarded)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return frozenset({"cuda"})
    return frozenset(_get_fused_kernels_supported_devices())


def fused_unsupported_reason(params: Iterable[torch.Tensor]) -> str | None:
    """Why fused AdamW cannot run on `params`, or None if it can (torch only checks at the first step)."""
    devices = _fused_devices()
    for p in params:
        if p.device.type not in devices:
            return f"this torch has no fused AdamW kernel for {p.device.type} tensors (only {sorted(devices)})"
        if not torch.is_floating_point(p):
            return f"fused AdamW needs floating-point parameters, got {p.dtype}"
    return None


def kernel_flags(optim: OptimConfig, params: Iterable[torch.Tensor]) -> dict:
    """AdamW's `fused`/`foreach` flags for `params`: the fused kernel when available (or forced by
    `optim.fused`), else foreach; never the per-parameter loop."""
    reason = fused_unsupported_reason(params)
    if optim.fused and reason is not None:
        raise ValueError(f"optim.fused=true cannot be honoured: {reason}")
    fused = reason is None if optim.fused is None else optim.fused
    return {"fused": fused, "foreach": None if fused else True}


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)` with the flags of `kernel_flags`.

    The learning rate starts at `optim.lr`; the trainer overrides it with `set_lr` every step.
    """
    optim.validate()
    groups = param_groups(model, optim.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        **kernel_flags(optim, (p for g in groups for p in g["params"])),
    )
