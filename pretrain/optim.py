"""AdamW, its parameter groups, a stateless learning-rate schedule and gradient clipping.

The schedule is a pure function of the step number (`lr_at`), applied with `set_lr` before
each optimizer step: resuming needs only the step, never a scheduler state dict. The `wsd_tokens`
kind counts tokens seen (step x tokens per step) instead of steps, as the SPS paper's recipe does;
`warmup_cosine` is OLMo's CosWithWarmup (linear warmup from a fraction of the peak, cosine to
optim.min_lr at train.max_steps), as the Recurrent Transformer paper's recipe uses.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from parallel.grads import clip_grad_norm, set_lr  # noqa: F401  (applied by the engines)

SCHEDULE_KINDS = ("warmup_cosine", "wsd_tokens", "wsd", "cosine", "constant")
TOKEN_FIELDS = ("warmup_tokens", "decay_tokens", "total_tokens")


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
    # decay every parameter, vectors (norm gains, gates, biases) included, as some papers' runs did (CART's:
    # its gate's drift is the decay's, spec-004 §2.8); off: only matrices and embeddings decay
    decay_all: bool = False

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
    """Learning-rate schedule: linear warmup, then wsd, cosine or constant, counted in optimizer steps;
    warmup_cosine, OLMo's CosWithWarmup (warmup from warmup_start x optim.lr), counted in steps; or
    wsd_tokens, the wsd shape counted in tokens seen (see `lr_at` and `lr_at_tokens`)."""

    # wsd | cosine | constant | warmup_cosine (counted in steps) | wsd_tokens (counted in tokens seen)
    kind: str = "wsd"
    warmup_steps: int = 100  # steps of linear warmup (the step kinds; wsd_tokens ignores it)
    decay_fraction: float = 0.1  # wsd: share of train.max_steps that decays to optim.min_lr (wsd_tokens ignores it)
    # warmup_cosine only (0 with the other kinds): the fraction of optim.lr the warmup starts from at step 0,
    # in [0, 1] (OLMo's alpha_0; the RT paper's 0.1)
    warmup_start: float = 0.0
    # wsd_tokens only (0 with the other kinds): tokens seen = step x tokens per step (train.global_batch_seqs
    # x data.seq_len), 0 at step 0
    warmup_tokens: int = 0  # linear warmup from 0 to optim.lr over the first warmup_tokens (0 = none)
    decay_tokens: int = 0  # linear decay to optim.min_lr over the last decay_tokens before total_tokens
    # where the decay ends; train.max_steps must then be ceil(total_tokens / tokens per step);
    # 0 = train.max_steps x tokens per step
    total_tokens: int = 0

    def validate(self, total_steps: int, tokens_per_step: int | None = None) -> None:
        """Raise ValueError with one sentence naming the first bad field. `total_steps` is train.max_steps;
        `tokens_per_step` is needed by kind wsd_tokens only."""
        if self.kind not in SCHEDULE_KINDS:
            valid = ", ".join(repr(k) for k in SCHEDULE_KINDS)
            raise ValueError(f"schedule.kind must be one of {valid}, got {self.kind!r}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        start = self.warmup_start
        if self.kind == "warmup_cosine":
            if isinstance(start, bool) or not isinstance(start, (int, float)) or not (0 <= start <= 1):
                raise ValueError(f"schedule.warmup_start must be a fraction of optim.lr in [0, 1] with "
                                 f"schedule.kind=warmup_cosine, got {start!r}")
        elif start != 0:
            raise ValueError(f"schedule.warmup_start is used by schedule.kind=warmup_cosine only; set it to 0 with "
                             f"schedule.kind={self.kind}, got {start!r}")
        if self.kind == "wsd_tokens":
            self._validate_tokens(total_steps, tokens_per_step)
            return
        for name in TOKEN_FIELDS:
            if getattr(self, name) != 0:
                raise ValueError(f"schedule.{name} is used by schedule.kind=wsd_tokens only; set it to 0 with "
                                 f"schedule.kind={self.kind}, got {getattr(self, name)!r}")
        w = self.warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or not (0 <= w < total_steps):
            raise ValueError(f"schedule.warmup_steps must be an integer in [0, total_steps={total_steps}), got {w!r}")
        if not (0 < self.decay_fraction <= 1):
            raise ValueError(f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}")

    def _validate_tokens(self, total_steps: int, tokens_per_step: int | None) -> None:
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
            raise ValueError(f"tokens_per_step (train.global_batch_seqs x data.seq_len) must be a positive integer "
                             f"with schedule.kind=wsd_tokens, got {tokens_per_step!r}")
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"schedule.{name} must be a non-negative integer (tokens), got {value!r}")
        if self.decay_tokens == 0:
            raise ValueError("schedule.decay_tokens must be positive with schedule.kind=wsd_tokens (the tokens "
                             "over which the lr decays to optim.min_lr), got 0")
        total = self.total_tokens or total_steps * tokens_per_step
        if self.warmup_tokens + self.decay_tokens > total:
            where = "schedule.total_tokens" if self.total_tokens else (
                f"train.max_steps x tokens per step = {total_steps} x {tokens_per_step}")
            raise ValueError(f"schedule.warmup_tokens + schedule.decay_tokens ({self.warmup_tokens} + "
                             f"{self.decay_tokens}) must not exceed the {total} total tokens ({where})")
        if self.total_tokens:
            steps = -(-self.total_tokens // tokens_per_step)  # ceil, in integers
            if total_steps != steps:
                raise ValueError(f"train.max_steps must be ceil(schedule.total_tokens / tokens per step) = "
                                 f"ceil({self.total_tokens} / {tokens_per_step}) = {steps} with "
                                 f"schedule.kind=wsd_tokens, got {total_steps}; set train.max_steps={steps} "
                                 "(or schedule.total_tokens=0 to end at train.max_steps)")


def lr_at(
    step: int, total_steps: int, optim: OptimConfig, schedule: ScheduleConfig, *, tokens_per_step: int | None = None
) -> float:
    """Learning rate for optimizer step `step` (counted from 0) of a `total_steps`-step run.

    Kind wsd_tokens is `lr_at_tokens(step * tokens_per_step, N, ...)`, N = schedule.total_tokens or
    total_steps * tokens_per_step (`tokens_per_step` is required for it, ignored by the other kinds).
    The step kinds, with W = warmup_steps, L = total_steps - 1 (the last step), lr and min_lr from `optim`:

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

    Kind warmup_cosine is OLMo's CosWithWarmup (alpha_0 = s = schedule.warmup_start, alpha_f = min_lr / lr,
    t_max = T = total_steps), with its own warmup:

    * step < W:          lr * (s + (1 - s) * step / W)  (exactly s * lr at step 0, rising to lr at W)
    * W <= step < T:     min_lr + (lr - min_lr) * (1 + cos(pi * (step - W) / (T - W))) / 2,
                         evaluated as lr - (lr - min_lr) * (1 - cos(...)) / 2, the same function, so
                         that step W gives exactly lr (never an ulp above it)
    * step >= T:         min_lr  (exactly)

    The cosine reaches min_lr at T, one past the last executed step L = T - 1, which gets
    min_lr + (lr - min_lr) * sin(pi / (2 (T - W)))**2, just above min_lr (the RT 300M recipe, lr 3e-3,
    min_lr 3e-4, W 10,000, T 25,000: 3e-4 + 2.96e-11). OLMo's trainer increments its step before
    asking for the lr, so its updates see steps 1..T and its last update gets min_lr exactly; here
    updates are steps 0..T-1, so every update's lr is the one OLMo gives the update before it (and
    the first update uses exactly s * lr, the paper's "warmup from 0.1 x lr"), a difference of at
    most (1 - s) * lr / W during warmup and (lr - min_lr) * pi / (2 (T - W)) after it.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if schedule.kind == "wsd_tokens":
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be a positive integer with schedule.kind=wsd_tokens, "
                             f"got {tokens_per_step!r}")
        total_tokens = schedule.total_tokens or total_steps * tokens_per_step
        return lr_at_tokens(step * tokens_per_step, total_tokens, optim, schedule)
    lr, min_lr, warmup, last = optim.lr, optim.min_lr, schedule.warmup_steps, total_steps - 1
    if schedule.kind == "warmup_cosine":
        if step < warmup:
            start = schedule.warmup_start
            return lr * (start + (1.0 - start) * step / warmup)
        if step >= total_steps:
            return min_lr
        return lr - (lr - min_lr) * (1.0 - math.cos(math.pi * (step - warmup) / (total_steps - warmup))) / 2
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


def lr_at_tokens(tokens: int, total_tokens: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """The wsd_tokens learning rate after `tokens` tokens seen, of a run whose decay ends at `total_tokens`.

    With P = optim.lr, m = optim.min_lr, W = schedule.warmup_tokens, D = schedule.decay_tokens, N = total_tokens:

    * warmup, t < W:       P * t / W  (exactly 0 at t = 0)
    * stable:              P  (up to and including t = N - D)
    * decay, N - D < t < N: m + (P - m) * (N - t) / D
    * t >= N:              m  (exactly)

    Token counts are integers, so each ratio is a single rounding of exact integers.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be non-negative, got {tokens}")
    lr, min_lr = optim.lr, optim.min_lr
    warmup, decay = schedule.warmup_tokens, schedule.decay_tokens
    if tokens < warmup:
        return lr * (tokens / warmup)
    if tokens <= total_tokens - decay:
        return lr
    if tokens >= total_tokens:
        return min_lr
    return min_lr + (lr - min_lr) * ((total_tokens - tokens) / decay)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Two AdamW groups: [decayed matrices and embeddings (ndim >= 2), undecayed vectors]; with
    `decay_all` every parameter is in the first group (optim.decay_all).

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
            (decay if p.ndim >= 2 or decay_all else no_decay).append(p)
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
    groups = param_groups(model, optim.weight_decay, optim.decay_all)
    return torch.optim.AdamW(
        groups,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        **kernel_flags(optim, (p for g in groups for p in g["params"])),
    )
