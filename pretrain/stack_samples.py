"""PRETRAIN_STACKS_EVERY=S: every thread's Python stack, every S seconds, while a run starts.

A first step that takes minutes (a compile on a GPU) then leaves a timeline of where it was, not one stack at
the moment it was stopped. `pretrain train` starts the sampler before it loads the config and the trainer stops
it once the first step is logged; the GPU suite sets S = 20 for its rows.

A daemon thread reads the stacks with sys._current_frames(), which holds the interpreter lock. faulthandler's
dump_traceback_later reads other threads' frames without it, from a watchdog thread: under torch 2.11 a run
that sampled every 0.3 s that way died of a segmentation fault in its first second.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback

ENV = "PRETRAIN_STACKS_EVERY"
HEADER = "stack sample"  # each sample's first line starts with it
_running: tuple[threading.Event, threading.Thread] | None = None


def every() -> float:
    """The seconds between samples from PRETRAIN_STACKS_EVERY (0: unset, none); a bad value is a ValueError,
    one sentence."""
    text = os.environ.get(ENV, "").strip()
    try:
        seconds = float(text or 0)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{ENV}={text!r}: give the seconds between stack samples (0: none)")
    return seconds


def sample() -> str:
    """Every other thread's stack, innermost call last, each under its thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me, lines = threading.get_ident(), []
    for ident, frame in sys._current_frames().items():
        if ident != me:
            lines.append(f"thread {names.get(ident, ident)}:")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(lines)


def start(seconds: float, out=None) -> None:
    """Print a sample to `out` (stderr) every `seconds` until stop()."""
    stop()
    done = threading.Event()
    out = out or sys.stderr

    def run() -> None:
        n = 0
        while not done.wait(seconds):
            n += 1
            out.write(f"{HEADER} {n} ({n * seconds:g} s; {ENV}), most recent call last:\n{sample()}\n")
            out.flush()

    global _running
    thread = threading.Thread(target=run, name="stack-samples", daemon=True)
    _running = (done, thread)
    thread.start()


def stop() -> None:
    """End the samples; a sample being printed is finished first, so nothing is printed after this returns."""
    global _running
    if _running is not None:
        done, thread = _running
        _running = None
        done.set()
        thread.join(timeout=10)
