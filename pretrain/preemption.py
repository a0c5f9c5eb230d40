"""Stopping on a signal: finish the step, checkpoint on every rank together, exit for a requeue.

The chain on a cluster (slurm/train.sbatch): Slurm sends the batch shell a warning signal before the
time limit or a preemption; the shell forwards SIGTERM to the training processes; each rank's
handler only records the request; at the end of the current optimizer step the ranks agree (one
all-reduce of a flag, so that all stop at the same step), write one checkpoint together and raise
`StopRequested`; the CLI exits with EXIT_REQUEUE and the batch script requeues the job, which
resumes from `latest`. The checkpoint is atomic (written aside, then renamed), so a kill during the
save loses nothing already written.

Ctrl-C (SIGINT) takes the same path, exiting 130: every rank of a job gets it (a terminal's process
group, or torchrun forwarding it), at different points of a step; stopping each rank where it stood
would leave one rank in a collective the others never join. A second Ctrl-C stops at once
(KeyboardInterrupt), the run keeping its latest checkpoint.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time

EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped cleanly on request, resume me


class StopRequested(Exception):
    """Raised after the checkpoint of a requested stop is written."""

    def __init__(self, step: int, signame: str, seconds: float, grace_s: float):
        self.signame = signame
        late = f", over the {grace_s:g} s grace time" if seconds > grace_s else f" (grace {grace_s:g} s)"
        super().__init__(f"stopped by {signame} after step {step}: checkpoint written {seconds:.1f} s after "
                         f"the signal{late}; the next start resumes from it")
        self.step = step


def signal_numbers(names: list[str]) -> list[signal.Signals]:
    """["SIGTERM", "USR1"] -> signal numbers; a one-line ValueError for an unknown name."""
    out = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"train.stop_signals: {name!r} is not a signal that can be caught")
        out.append(sig)
    return out


class StopOnSignal:
    """Between install() and restore(), the given signals and SIGINT request a stop instead of killing
    us; a second SIGINT raises KeyboardInterrupt. `announce` gets one line when a stop is requested."""

    def __init__(self, names: list[str], announce=None):
        self.signals = list(dict.fromkeys([*signal_numbers(names), signal.SIGINT]))
        self.signame: str | None = None
        self.t_signal = 0.0
        self.announce = announce
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.signame is None:
            self.signame, self.t_signal = signal.Signals(signum).name, time.monotonic()
            if self.announce is not None:
                self.announce(f"{self.signame}: stopping after this step, with a checkpoint"
                              + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""))
        elif signum == signal.SIGINT:  # the user insists
            raise KeyboardInterrupt

    def install(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def agreed(self, distributed: bool) -> bool:
        """True on every rank if any rank has received a signal (a collective when distributed)."""
        flag = self.signame is not None
        if distributed:
            import torch
            import torch.distributed as dist

            from parallel.dist import collective

            t = torch.tensor([1.0 if flag else 0.0])
            collective("all_reduce(stop request)", dist.all_reduce, t, op=dist.ReduceOp.MAX)
            flag = t.item() > 0
            if flag and self.signame is None:  # another rank was signalled first
                self.signame, self.t_signal = "a signal on another rank", time.monotonic()
        return flag

    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.t_signal


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C (SIGINT) during a save is held until the save is over, then delivered: a checkpoint is
    completed (or fails cleanly) instead of being torn by a KeyboardInterrupt inside DCP's writers.
    Only the main thread can set handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:  # delivered now, as the handler in place before the save would have
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt
