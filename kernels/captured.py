"""Captured regions: a loop of many tiny launches replayed as one CUDA graph (issue 37, spec-003 §3.7).

RT's layer and GPN's time loop produce their positions one at a time, so on a GPU their cost is the
host launching thousands of small kernels, not the arithmetic. A *region* is a piece of such a loop
written as a pure function of tensors:

    outputs = region(name, fn, inputs)        fn(*inputs) -> tuple of tensors (None entries allowed)

whose launches depend only on the inputs' shapes and dtypes and on Python values the caller puts in
`name` (a layer's identity, a truncation flag). Inside a captured step (`step(mode)`: the trainer's
forward and backward) on CUDA, the first call of a name and input signature runs fn twice on a side
stream (warm-up: Triton's autotuning and torch.compile's first calls happen here, never in a graph),
then captures it into a CUDA graph whose inputs are static buffers. Every later call copies its inputs
into those buffers, replays the graph and returns copies of the outputs (a replay overwrites them, and
a later segment or the backward may still read the previous ones). Everywhere else (a CPU, evaluation,
train.cuda_graphs=off) fn simply runs: the eager result is the definition the graph replays, and the
CPU tests compare the regions to the plain loops through exactly that path.

The users are the loops' own autograd Functions, both of which already split into a forward without
an autograd graph and a backward that is a function of saved tensors: RT's TiledPrefill (forward: the
tile schedule; backward: its three phases) and GPN's _Segment (forward: S steps without a graph;
backward: the S steps again, differentiated). Each body is a region, so a graph holds no autograd state
between forward and backward and one graph per signature serves every call (GPN's ~45 segments per
window share one; its shorter last segment and a truncation cut get their own). Gradients, parameters'
included, come out of the backward graph as outputs that autograd accumulates as usual: .grad needs no
static buffers, DDP's hooks fire as before.

What a region must not do, since a replay repeats only the device work: read tensor data on the host
(a sync; capture fails, see below), draw random numbers, or count on a Python side effect each call
(RT's KEYS_MOVED counter and the kernel registry's paths_used see the capture only). Autocast runs
with its weight cache off inside a region (a cast cached during a capture would live in graph memory).
Parameters are read where they live (an optimizer updates them in place, so a replay sees the new
values); tensors made fresh each step must be inputs (GPN's folded matrices are).

Memory: each graph keeps static copies of its inputs and outputs, and all graphs share one pool for
their intermediates (safe because outputs are copied out at once: no graph's result outlives its replay).

Modes (train.cuda_graphs): "off" never captures; "auto" captures on CUDA and otherwise says once why
the regions run eagerly; "on" is "auto" that refuses, in one sentence before any work, a run that
cannot capture (check()). A capture that fails at run time (an op that syncs, a shape that changes
inside the region) is said once and that region runs eagerly from then on ("on": the error stands).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor

MODES = ("auto", "on", "off")
WARMUP = 2  # eager runs on a side stream before a capture


@dataclass
class Graph:
    """One captured region: its static input buffers, a replay, and the static outputs it fills."""
    inputs: list
    outputs: list
    replay: Callable[[], None]
    bytes: int = 0  # device memory the capture took (static buffers and the pool's growth)


class CudaGraphs:
    """The real backend: torch.cuda.graph capture into one shared memory pool."""

    def __init__(self):
        self.pool = None

    def available(self, device: torch.device) -> str | None:
        """Why regions cannot be captured on `device`, or None."""
        if device.type != "cuda":
            return f"the {device.type.upper()} has no CUDA graphs"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def capture(self, fn: Callable, inputs: list) -> Graph:
        before = torch.cuda.memory_allocated()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = _as_list(fn(*inputs))
        return Graph(inputs, outputs, graph.replay, torch.cuda.memory_allocated() - before)


class Emulated:
    """A stand-in backend for CPU tests: the same static buffers, copies in and out, and a replay that
    recomputes fn on the static inputs into the static outputs (so a result kept past the next replay
    would show as overwritten, exactly as with a real graph)."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type, self.captures = device_type, 0

    def available(self, device: torch.device) -> str | None:
        return None if device.type == self.device_type else f"the emulated backend serves {self.device_type} only"

    def capture(self, fn: Callable, inputs: list) -> Graph:
        self.captures += 1
        outputs = _as_list(fn(*inputs))

        def replay():
            for out, new in zip(outputs, _as_list(fn(*inputs))):
                if out is not None:
                    out.copy_(new)

        return Graph(inputs, outputs, replay)


@dataclass
class _State:
    mode: str = "off"
    active: bool = False  # inside step(): a training forward and backward
    log: Callable[[str], None] = print
    backend: object = field(default_factory=CudaGraphs)
    graphs: dict = field(default_factory=dict)  # (name, signature, grad, autocast) -> Graph
    eager: dict = field(default_factory=dict)  # region name -> why it runs eagerly (said once)
    said: set = field(default_factory=set)
    replays: int = 0


_state = _State()


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _signature(inputs: Sequence[Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


def _autocast_key(device_type: str) -> tuple:
    on = torch.is_autocast_enabled(device_type)
    return (on, torch.get_autocast_dtype(device_type) if on else None)


def _say(text: str) -> None:
    if text not in _state.said:
        _state.said.add(text)
        _state.log(text)


def check(mode: str, device: torch.device, what: str | None, why_none: str | None = None,
          pipeline: bool = False) -> tuple[str | None, bool]:
    """Before any work: (the run's line about its regions, None when there is nothing to say; whether its
    steps capture). `what`: the regions in words (an architecture's registry `captured_regions`), or
    None with `why_none`. Under "on", a run that cannot capture is a ValueError, one sentence."""
    if mode not in MODES:
        raise ValueError(f"train.cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if what is None and why_none is None:
        return None, False  # an architecture without loops: nothing to say whatever the mode
    if mode == "off":
        return (f"train.cuda_graphs=off: {what} run eagerly (auto captures them on this GPU)"
                if what and _state.backend.available(device) is None and not pipeline else None), False
    why = why_none or ("pipeline stages would need one graph per micro batch in flight" if pipeline
                       else _state.backend.available(device))
    if why is None:
        return f"train.cuda_graphs={mode}: {what} are captured as CUDA graphs in the first step and replayed", True
    if mode == "on":
        raise ValueError(f"train.cuda_graphs=on cannot capture: {why}; use auto (eager where it cannot) or off")
    return (f"train.cuda_graphs=auto: {why}, so {what} run eagerly" if what else
            f"train.cuda_graphs=auto: nothing to capture ({why})"), False


@contextmanager
def step(mode: str, log: Callable[[str], None] | None = None):
    """Regions called inside (a training step's forward and backward) are captured per `mode`."""
    if mode not in MODES:
        raise ValueError(f"train.cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    prev = (_state.mode, _state.active, _state.log)
    _state.mode, _state.active = mode, mode != "off"
    if log is not None:
        _state.log = log
    try:
        yield
    finally:
        _state.mode, _state.active, _state.log = prev


def region(name: Hashable, fn: Callable[..., object], inputs: Sequence[Tensor]) -> list:
    """fn(*inputs) as a list of outputs: replayed from a CUDA graph inside a captured step on CUDA, run
    as is elsewhere (see the module docstring)."""
    inputs = list(inputs)
    if not _state.active or not inputs or _capturing():  # a region inside another's capture is part of it
        return _as_list(fn(*inputs))
    group = name[0] if isinstance(name, tuple) else name
    if group in _state.eager:
        return _as_list(fn(*inputs))
    device = inputs[0].device
    why = _state.backend.available(device)
    if why is not None:
        _state.eager[group] = why
        if _state.mode == "on":
            raise RuntimeError(f"train.cuda_graphs=on cannot capture {group}: {why}")
        _say(f"train.cuda_graphs: {group} runs eagerly ({why})")
        return _as_list(fn(*inputs))
    key = (name, _signature(inputs), torch.is_grad_enabled(), _autocast_key(device.type))
    graph = _state.graphs.get(key)
    if graph is None:
        graph = _capture(group, fn, inputs, device)
        if graph is None:
            return _as_list(fn(*inputs))
        _state.graphs[key] = graph
    else:
        for static, t in zip(graph.inputs, inputs):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
    graph.replay()
    _state.replays += 1
    return [o.clone() if o is not None else None for o in graph.outputs]


def _capture(group, fn, inputs: list, device: torch.device) -> Graph | None:
    static = [t.detach().clone() for t in inputs]
    on, dtype = _autocast_key(device.type)

    def body(*xs):  # autocast as the caller has it, without the weight cache (see the module docstring)
        with torch.autocast(device.type, dtype=dtype, cache_enabled=False) if on else nullcontext():
            return fn(*xs)

    try:
        return _state.backend.capture(body, static)
    except Exception as e:  # an op that syncs or allocates on the host, a shape that changes inside
        if _state.mode == "on":
            raise RuntimeError(f"train.cuda_graphs=on: capturing {group} failed: {type(e).__name__}: {e}") from e
        _state.eager[group] = f"its capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _say(f"train.cuda_graphs: {group} runs eagerly from now on ({_state.eager[group]})")
        return None


def summary() -> str:
    """The regions captured so far, for the trainer's kernels line: '' when none."""
    if not _state.graphs:
        return ""
    groups: dict = {}
    for (name, *_), graph in _state.graphs.items():
        group = name[0] if isinstance(name, tuple) else name
        n, size = groups.get(group, (0, 0))
        groups[group] = (n + 1, size + graph.bytes)
    parts = [f"{g} {n} graph{'s' if n > 1 else ''}" + (f" ({size / 2**20:,.0f} MiB)" if size else "")
             for g, (n, size) in groups.items()]
    return "captured: " + ", ".join(parts) + f"; {_state.replays:,} replays"


def reset(backend: object | None = None) -> None:
    """Drop every graph and said line (a new run, a test); `backend` replaces the current one (tests pass
    Emulated(), and CudaGraphs() to put the real one back)."""
    global _state
    _state = _State(backend=backend if backend is not None else _state.backend)


__all__ = ["CudaGraphs", "Emulated", "MODES", "check", "region", "reset", "step", "summary"]
