"""Where the training steps' time goes: data, forward, backward, optimizer (the window's record adds
"other": whatever else its wall time held), so that the split adds up to the steps.

    timer.start()              # a step begins
    timer.mark("data")         # the time since the previous mark belongs to "data"
    engine.forward_backward(..., timer=timer)  # marks "forward" and "backward" per micro batch
    timer.mark("optimizer")    # finish_grads (clipping), the step or its skip, zero_grad
    timer.resolve()            # only after a host sync that followed the marks

On a GPU the host clock says when work was queued, not when it ran: the step's one host sync (in
the trainer's _step_or_skip) waits for everything queued before it, so host timers put nearly all
of a step in whichever phase holds that sync. There the compute phases are CUDA events on the current
stream, read lazily by resolve(), which the trainer calls after a sync it makes anyway (no new sync).
Data loading is host work and is timed with the host clock on every device; on CPU everything is.
"""
from __future__ import annotations

import time

import torch

PHASES = ("data", "forward", "backward", "optimizer")
HOST_PHASES = frozenset({"data"})


class PhaseTimer:
    """Seconds per phase, summed until read. `event()` makes a timing event (record(),
    elapsed_time(other) in ms, as torch.cuda.Event); by default CUDA's on a CUDA device, none on CPU."""

    def __init__(self, device: torch.device, event=None):
        if event is None and device.type == "cuda":
            event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._event = event
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._pending: list = []  # (phase, start event, end event), not read yet
        self.start()

    def _stamp(self):
        event = None
        if self._event is not None:
            event = self._event()
            event.record()
        return time.perf_counter(), event

    def start(self) -> None:
        self._host, self._last = self._stamp()

    def mark(self, phase: str) -> None:
        host, event = self._stamp()
        if event is None or phase in HOST_PHASES:
            self.seconds[phase] += host - self._host
        else:
            self._pending.append((phase, self._last, event))
        self._host, self._last = host, event

    def resolve(self) -> dict[str, float]:
        """The seconds per phase so far. Events are read here only: call it after a host sync that
        followed the last mark, when they have all completed and reading them waits for nothing."""
        for phase, begin, end in self._pending:
            self.seconds[phase] += begin.elapsed_time(end) / 1e3
        self._pending.clear()
        return self.seconds
