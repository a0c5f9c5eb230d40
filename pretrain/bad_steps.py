"""Which optimizer steps are skipped, and when skipping has to stop the run.

A step is *bad* when its loss or gradient norm is not finite, or (with train.skip_outlier_z set) when
either is a spike: more than z standard deviations above its mean over the last
train.skip_outlier_window good steps (OLMo-core's skip-step rule; active once the window is full).
What a bad step does:

- non-finite, train.nan_policy=stop: the run stops at once (NonFiniteLossError);
- non-finite with train.nan_policy=skip, or an outlier under either policy: the update is skipped
  (the optimizer is not stepped: its moments and its step count stay as they were; the trainer's
  step counter, the lr schedule's position and the data position advance, since the batch was read);
- more than train.max_bad_steps skips in a row: the run stops (BadStepsError) in one sentence that
  names the steps and their data positions. Nothing is saved then: the last checkpoint stays the
  last good one.

The decision reads only values that are the same on every rank (the loss summed over data-parallel
ranks, the reduced global grad norm), so all ranks skip or stop together. The consecutive count and
the outlier windows go into checkpoint meta (`state()` / `load()`), so a resumed run decides as the
uninterrupted one would.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


class NonFiniteLossError(RuntimeError):
    """The loss or the gradients became NaN/inf and train.nan_policy is stop."""


class BadStepsError(NonFiniteLossError):
    """More than train.max_bad_steps steps in a row were skipped."""


@dataclass(frozen=True)
class Verdict:
    """What to do with one step: `skip` it (with the `reason`), or apply it (skip False)."""

    skip: bool
    reason: str = ""


def data_position(dataset, start: int, count: int) -> str:
    """Which samples global samples [start, start + count) are: of a blend, each child's sample indices."""
    end = start + count - 1
    where = f"samples {start}-{end}"
    datasets = getattr(dataset, "datasets", None)
    if datasets is None or not hasattr(dataset, "sources"):
        name = getattr(dataset, "name", None)
        return f"{where} of {name}" if name else where
    d, k = dataset.sources(np.arange(start, start + count))
    parts = []
    for c in np.unique(d).tolist():
        ks = np.sort(k[d == c])
        name = getattr(datasets[c], "name", f"dataset {c}")
        parts.append(f"{name}: {_ranges(ks.tolist())}")
    return f"{where} of the blend ({'; '.join(parts)})"


def _ranges(values: list[int]) -> str:
    """'3-5,9' for [3, 4, 5, 9]."""
    out, first, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{first}-{prev}" if prev != first else f"{first}")
        if v is not None:
            first = prev = v
    return ",".join(out)


class BadSteps:
    """The skip/stop rule of one run (see the module docstring); `judge` once per step."""

    def __init__(self, train):
        self.policy, self.max_bad = train.nan_policy, train.max_bad_steps
        self.z, self.window = float(train.skip_outlier_z or 0.0), int(train.skip_outlier_window)  # 0: off
        self.history = {"loss": deque(maxlen=self.window), "grad_norm": deque(maxlen=self.window)}
        self.run: list[tuple[int, str, str]] = []  # the current run of skips: (step, reason, data position)
        self.total = 0  # steps skipped in this run (over resumes)

    def judge(self, step: int, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict on `step` (1-based) from its rank-independent loss and grad norm (None: not
        known before the optimizer step, DeepSpeed's case); raises NonFiniteLossError under
        nan_policy=stop. A good step's values enter the outlier windows."""
        values = {"loss": loss, "grad_norm": grad_norm}
        bad = [n for n, v in values.items() if v is not None and not math.isfinite(v)]
        if bad:
            reason = f"non-finite {' and '.join(n.replace('_', ' ') for n in bad)} (loss {loss:.4g}" + \
                (f", grad norm {grad_norm:.4g})" if grad_norm is not None else ")")
            return Verdict(True, reason)
        for name, v in values.items():
            spike = self._spike(name, v)
            if spike:
                return Verdict(True, spike)
        for name, v in values.items():
            if v is not None:
                self.history[name].append(v)
        return Verdict(False)

    def judge_after_step(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """For an engine that knows the grad norm only inside its step (DeepSpeed, whose overflow check
        then skips a non-finite one without touching the optimizer): the verdict on what it did."""
        if math.isfinite(grad_norm):
            return Verdict(False)
        if self.history["loss"] and self.history["loss"][-1] == loss:
            self.history["loss"].pop()  # `judge` took the step for a good one
        return Verdict(True, f"non-finite grad norm (loss {loss:.4g}, grad norm {grad_norm:.4g}; the engine's "
                             "overflow check skipped the update)")

    def _spike(self, name: str, value: float | None) -> str:
        h = self.history[name]
        if self.z <= 0 or value is None or len(h) < self.window:
            return ""
        mean = sum(h) / len(h)
        std = math.sqrt(sum((x - mean) ** 2 for x in h) / len(h))
        if value > mean + self.z * std:
            return (f"{name.replace('_', ' ')} {value:.4g} is an outlier (more than {self.z:g} std above its "
                    f"mean {mean:.4g} +- {std:.3g} over the last {len(h)} good steps, train.skip_outlier_z)")
        return ""

    def skipped(self, step: int, verdict: Verdict, position: str, log) -> None:
        """Record a skip of `step` (after `judge`); raise BadStepsError when the run of skips is too long.
        A non-finite step under nan_policy=stop raises NonFiniteLossError instead of being skipped."""
        if verdict.reason.startswith("non-finite") and self.policy == "stop":
            raise NonFiniteLossError(
                f"step {step}: {verdict.reason}; data: {position}; stopped (train.nan_policy=stop) without saving, "
                "the last checkpoint is intact. Lower optim.lr, check the data, or set train.nan_policy=skip")
        self.total += 1
        self.run.append((step, verdict.reason, position))
        log(f"step {step}: {verdict.reason}, update skipped; data: {position}")
        if len(self.run) > self.max_bad:
            steps = ", ".join(f"step {s} ({p})" for s, _, p in self.run)
            raise BadStepsError(
                f"{len(self.run)} steps in a row were skipped, more than train.max_bad_steps={self.max_bad}: "
                f"{steps}; the last was {self.run[-1][1]}; stopped without saving, the last checkpoint is intact")

    def good(self) -> None:
        """A step was applied: the run of skips is over."""
        self.run.clear()

    # -- checkpoint meta --------------------------------------------------------------------------
    def state(self) -> dict:
        return {"run": [list(r) for r in self.run], "total": self.total,
                "history": {k: list(v) for k, v in self.history.items()}}

    def load(self, state: dict | None) -> None:
        if not state:
            return
        self.run = [tuple(r) for r in state.get("run", [])]
        self.total = int(state.get("total", 0))
        for k, values in state.get("history", {}).items():
            if k in self.history:
                self.history[k].extend(values)
