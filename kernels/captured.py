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
(RT's KEYS_MOVED counter and the kernel registry's paths_used see the capture only). Autocast's weight
cache is emptied as a region starts and as it ends, eager and captured alike: a cast cached during a
capture would live in graph memory, and one cached before it would be read from memory the cache later
frees. Inside, casts are cached as usual (a weight cast once per region, not once per position, and its
gradient summed through that one cast: what eager autocast always did).
Parameters and buffers are read where they live (an optimizer updates them in place, so a replay sees
the new values; a model moved or rebuilt after a capture needs reset(), as each Trainer does); tensors
made fresh each step must be inputs (GPN's folded matrices and RT's RoPE tables are). An input that is
the very tensor last copied into its buffer in the same step, unchanged since (its version counter), is
not copied again: GPN's folded matrices, one set a step, feed each of the window's segments. (Not across
steps: a fused optimizer writes parameters without bumping their versions.) A body that writes into its
inputs (seen in the warm-up) has them copied at every replay.

Memory: the graphs of one region kind (RT's forward, all layers) and input signature share one set of
static input and output buffers, and all graphs share one pool for their intermediates. Both are safe
because replays run one after another on one stream and outputs are copied out at once: no graph's
result outlives its replay. (A set per graph would not fit: RT at 512 x 512 tokens, d 1024, holds about
six 1 GiB [B, N, d] tensors per layer's pair of graphs.)

Modes (train.cuda_graphs): "off" never captures; "auto" captures on CUDA and otherwise says once why
the regions run eagerly; "on" is "auto" that refuses, in one sentence before any work, a run that
cannot capture (check()). A capture that fails at run time (an op that syncs, a shape that changes
inside the region) is said once and that region runs eagerly from then on ("on": the error stands).
"""
from __future__ import annotations

import statistics
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("auto", "on", "off")
WARMUP = 2  # eager runs on a side stream before a capture


@dataclass
class Graph:
    """One captured region: the static input buffers it reads, the static outputs it fills, a replay."""
    inputs: list
    outputs: list
    replay: Callable[[], None]
    # the captured function: through its closure, every tensor the graph reads by address (a layer's own
    # buffers) stays alive as long as the graph does, so a replay never reads freed memory
    keep: object = None
    mutates: bool = False  # the body writes into an input: its buffers are copied in at every replay


class CudaGraphs:
    """The real backend: torch.cuda graphs captured on one stream into one shared memory pool."""

    def __init__(self):
        self.pool = self.stream = None
        # one side stream for every warm-up: the caching allocator keeps freed blocks for the stream that
        # allocated them, so a stream per warm-up (~24 for RT's layers) would strand each one's memory
        self.side = None
        self.retired = []  # (pool, graph) of failed captures (capture() says why)
        self.pool_bytes = 0  # what the captures added to the device's allocations (the pool's growth)

    def available(self, device: torch.device) -> str | None:
        """Why regions cannot be captured on `device`, or None."""
        if device.type != "cuda":
            return f"the {device.type.upper()} has no CUDA graphs"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def warmup(self, fn: Callable, inputs: list) -> list:
        """WARMUP eager runs on a side stream (what capture needs first); the last one's outputs."""
        if self.side is None:
            self.side = torch.cuda.Stream()
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                out = _as_list(fn(*inputs))
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, body: Callable[[], None], device: torch.device) -> Callable[[], None]:
        """body's launches as a graph; its replay. A failed capture ends cleanly (the thread's stream restored,
        the allocator out of capture mode) and raises the error that broke it, not capture_end's echo of it.
        Its pool is retired: when a capture breaks, capture_end does not release the pool from the pinned-memory
        allocator (torch 2.11), and beginning another capture on it would fail ("already recording to
        mempool_id"), so every later capture would; the next capture starts a fresh pool. The broken graph
        is kept, since the allocators may still hold its filter."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = self.stream or torch.cuda.Stream()
        before = torch.cuda.memory_allocated()
        torch.cuda.synchronize()  # every input written before the capture stream starts
        graph, error, begun = torch.cuda.CUDAGraph(), None, False
        with torch.cuda.stream(self.stream):
            try:
                # thread_local: another thread's CUDA call (the data loader's pinning) does not void the capture
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                begun = True
                body()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the capture is ended
                error = e
            if begun:
                try:
                    graph.capture_end()
                except BaseException as e:  # noqa: BLE001
                    error = error or e
            if error is not None:
                try:  # a broken capture_end (or begin) leaves the device allocator routing to the pool
                    index = device.index if device.index is not None else torch.cuda.current_device()
                    torch._C._cuda_endAllocateToPool(index, self.pool)
                except Exception:  # noqa: BLE001 - it had released it
                    pass
        if error is not None:
            self.retired.append((self.pool, graph))
            self.pool = None
            raise error
        self.pool_bytes += torch.cuda.memory_allocated() - before
        return graph.replay


_BOOL_INDEXED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                 torch.ops.aten._index_put_impl_.default}


def host_read(func, args: tuple, kwargs: dict | None = None) -> str | None:
    """Why an op cannot sit in a CUDA graph (it reads tensor data on the host, a device sync, or its output
    shape depends on the data), or None. One rule for the emulated capture and the host-sync census
    (tests/test_host_syncs.py). Indexing is judged by its indices: integer ones are gathers and scatters a
    graph holds; a boolean one is a nonzero in disguise (its tag marks every index as dynamic)."""
    if func in _BOOL_INDEXED:
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "indexes by a boolean mask (a nonzero: its shape depends on tensor data)"
        return None
    if func is torch.ops.aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is not None:
        return None  # the total given up front: no sync for the output's length
    if torch.Tag.data_dependent_output in func.tags or func is torch.ops.aten._local_scalar_dense.default:
        return "reads tensor data on the host (a device sync)"
    if torch.Tag.dynamic_output_shape in func.tags:
        return "has an output shape that depends on tensor data"
    return None


class _CaptureRules(TorchDispatchMode):
    """What a CUDA graph capture cannot hold (host_read), refused where the emulated backend captures, so
    a CPU test finds it: .item(), a comparison turned into a bool, nonzero, masked_select, a mask index."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = host_read(func, args, kwargs)
        if why is not None:
            raise RuntimeError(f"{func.name()} {why}: a CUDA graph cannot capture it")
        return func(*args, **(kwargs or {}))


class Emulated:
    """A stand-in backend for CPU tests: the same shared static buffers, copies in and out, and a replay that
    reruns the captured body (so a result kept past the next replay shows as overwritten, as with a real
    graph). Its captures refuse what a real one cannot hold (_CaptureRules). `fail`: an exception every
    capture raises (a capture that breaks)."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type, self.captures, self.pool_bytes, self.fail = device_type, 0, 0, None

    def available(self, device: torch.device) -> str | None:
        return None if device.type == self.device_type else f"the emulated backend serves {self.device_type} only"

    def warmup(self, fn: Callable, inputs: list) -> list:
        return _as_list(fn(*inputs))

    def capture(self, body: Callable[[], None], device: torch.device) -> Callable[[], None]:
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        with _CaptureRules():
            body()
        return body


@dataclass
class _State:
    mode: str = "off"
    active: bool = False  # inside step(): a training forward and backward
    log: Callable[[str], None] = print
    backend: object = field(default_factory=CudaGraphs)
    graphs: dict = field(default_factory=dict)  # (name, signature, grad, autocast) -> Graph
    # static buffers shared by every graph of a group ("rt_prefill forward": all layers) and signature: replays
    # run one after another and outputs are copied out at once, so one set serves them all
    buffers: dict = field(default_factory=dict)  # (group, "in" | "out", position, shape, dtype, device) -> Tensor
    eager: dict = field(default_factory=dict)  # region name -> why it runs eagerly (said once)
    said: set = field(default_factory=set)
    replays: int = 0
    # id(static input buffer) -> (the tensor last copied into it, weakly, and its version then): a replay
    # in the same step whose input is that same tensor, unchanged, skips the copy (GPN's folded matrices:
    # one set a step, read by each of its ~45 segments, forward and backward)
    copied: dict = field(default_factory=dict)
    copies: int = 0  # input copies made (tests read it)
    graphing: bool = False  # inside _capture: a region's warm-up and capture, the code its graph replays


_state = _State()


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _signature(inputs: Sequence[Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


def _autocast_key(device_type: str) -> tuple:
    """(enabled, dtype) of autocast on this device type; (False, None) where autocast has none (meta: a
    dry run's fake model)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False, None
    return (on, torch.get_autocast_dtype(device_type) if on else None)


def autocast_state(device: torch.device) -> tuple:
    """The caller's autocast on `device` (enabled, dtype): what a recomputing backward must run under."""
    return _autocast_key(device.type)


def autocast_as(device: torch.device, state: tuple):
    """A context that runs under `state` (autocast_state's): a custom Function's backward, which the
    autograd engine runs outside the forward's autocast, recomputes the forward's arithmetic this way."""
    on, dtype = state
    if on:
        return torch.autocast(device.type, dtype=dtype)
    return torch.autocast(device.type, enabled=False) if _autocast_key(device.type)[0] else nullcontext()


def _say(text: str) -> None:
    if text not in _state.said:
        _state.said.add(text)
        _state.log(text)


def why_not(what: str | None, why_none: str | None, pp: int = 1, arch: str = "") -> str | None:
    """Why a run cannot capture, its device aside (None: it can): the config's check of "on" and check()'s."""
    if what is None:
        return why_none or f"model.arch {arch!r} declares no loop to capture (RT and GPN do)"
    if pp > 1:
        return f"parallel.pp={pp}: pipeline stages would need one graph per micro batch in flight"
    return None


def check(mode: str, device: torch.device, what: str | None, why_none: str | None = None,
          pp: int = 1) -> tuple[str | None, bool]:
    """Before any work: (the run's line about its regions, None when there is nothing to say; whether its
    steps capture). `what`: the regions in words (an architecture's registry `captured_regions`), or
    None with `why_none`. Under "on", a run that cannot capture is a ValueError, one sentence."""
    if mode not in MODES:
        raise ValueError(f"train.cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    if what is None and why_none is None:
        return None, False  # an architecture without loops: nothing to say whatever the mode
    if mode == "off":
        return (f"train.cuda_graphs=off: {what} run eagerly (auto captures them on this GPU)"
                if what and _state.backend.available(device) is None and pp == 1 else None), False
    why = why_not(what, why_none, pp) or _state.backend.available(device)
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
    # the inputs' copy records hold within one step only: a fused optimizer between steps updates the
    # parameters in place without bumping their version counters (GPN passes its biases through as inputs)
    _state.copied.clear()
    try:
        yield
    finally:
        _state.mode, _state.active, _state.log = prev
        _state.copied.clear()


def region(name: Hashable, fn: Callable[..., object], inputs: Sequence[Tensor]) -> list:
    """fn(*inputs) as a list of outputs: replayed from a CUDA graph inside a captured step on CUDA, run
    as is elsewhere (see the module docstring)."""
    inputs = list(inputs)
    if not inputs:
        return _as_list(fn())
    fn = _own_casts(fn, inputs[0].device.type)
    if not _state.active or _capturing():  # a region inside another's capture is part of it
        return fn(*inputs)
    group = name[0] if isinstance(name, tuple) else name
    if group in _state.eager:
        return fn(*inputs)
    device = inputs[0].device
    why = _state.backend.available(device)
    if why is not None:
        _state.eager[group] = why
        if _state.mode == "on":
            raise RuntimeError(f"train.cuda_graphs=on cannot capture {group}: {why}")
        _say(f"train.cuda_graphs: {group} runs eagerly ({why})")
        return fn(*inputs)
    key = (name, _signature(inputs), torch.is_grad_enabled(), _autocast_key(device.type))
    graph = _state.graphs.get(key)
    if graph is None:
        graph = _capture(group, fn, inputs, device)
        if graph is None:
            return fn(*inputs)
        _state.graphs[key] = graph
    _copy_in(graph.inputs, inputs, reuse=not graph.mutates)
    graph.replay()
    _state.replays += 1
    if graph.mutates:  # its buffers no longer hold what was copied in
        _forget(graph.inputs)
    return [o.clone() if o is not None else None for o in graph.outputs]


def _own_casts(fn: Callable, device_type: str) -> Callable[..., list]:
    """fn returning a list, with autocast's weight cache emptied at its start and end (module docstring)."""
    def run(*xs) -> list:
        if not _autocast_key(device_type)[0]:
            return _as_list(fn(*xs))
        torch.clear_autocast_cache()
        try:
            return _as_list(fn(*xs))
        finally:
            torch.clear_autocast_cache()
    return run


def _copy_in(static: list, inputs: list, reuse: bool = True) -> None:
    """Each input into its static buffer, unless it is there already: the buffer itself, or (`reuse`) the
    same tensor as the last one copied in, unchanged since (its version counts in-place writes; the weak
    reference is alive, so its memory was not handed to another tensor)."""
    with torch.no_grad():  # the buffers never join an autograd graph
        for buffer, t in zip(static, inputs):
            if buffer.data_ptr() == t.data_ptr():
                continue
            last = _state.copied.get(id(buffer))
            if reuse and last is not None and last[0]() is t and last[1] == t._version:
                continue
            buffer.copy_(t)
            _state.copies += 1
            _state.copied[id(buffer)] = (weakref.ref(t), t._version)


def _forget(static: list) -> None:
    """Drop the copy records of buffers a body wrote into: their next use copies its input in."""
    for buffer in static:
        _state.copied.pop(id(buffer), None)


def _buffer(group, kind: str, i: int, like: Tensor) -> Tensor:
    """The group's shared static buffer for position i of its inputs or outputs, shaped like `like`."""
    key = (group, kind, i, tuple(like.shape), like.dtype, like.device)
    if key not in _state.buffers:
        _state.buffers[key] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return _state.buffers[key]


def _capture(group, fn, inputs: list, device: torch.device) -> Graph | None:
    """Warm fn up, then capture it reading the group's shared input buffers and writing its shared output
    buffers; None (said once) when the capture fails under "auto"."""
    _state.graphing = True
    try:  # fn empties autocast's cache around each call already (_own_casts)
        static = [_buffer(group, "in", i, t) for i, t in enumerate(inputs)]
        _copy_in(static, inputs, reuse=False)
        versions = [t._version for t in static]
        shapes = _state.backend.warmup(fn, static)
        mutates = [t._version for t in static] != versions  # the warm-up wrote into an input
        outputs = [_buffer(group, "out", i, o) if o is not None else None for i, o in enumerate(shapes)]
        del shapes

        def body():
            with torch.no_grad():
                for buffer, o in zip(outputs, fn(*static)):
                    if buffer is not None:
                        buffer.copy_(o)

        replay = _state.backend.capture(body, device)
    except Exception as e:  # an op that syncs the host, a shape that changes inside, memory
        if _state.mode == "on":
            raise RuntimeError(f"train.cuda_graphs=on: capturing {group} failed: {type(e).__name__}: {e}") from e
        _state.eager[group] = f"its capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _say(f"train.cuda_graphs: {group} runs eagerly from now on ({_state.eager[group]})")
        return None
    finally:
        _state.graphing = False
    if mutates:  # the warm-up wrote into the buffers
        _forget(static)
    return Graph(static, outputs, replay, keep=fn, mutates=mutates)


def static_bytes() -> int:
    """The bytes of the static buffers the captured regions hold (the planner's captured_bytes estimates them)."""
    return sum(t.numel() * t.element_size() for t in _state.buffers.values())


def summary() -> str:
    """The regions captured so far, for the trainer's kernels line: '' when none."""
    if not _state.graphs:
        return ""
    groups: dict = {}
    for (name, *_), graph in _state.graphs.items():
        group = name[0] if isinstance(name, tuple) else name
        groups[group] = groups.get(group, 0) + 1
    static = static_bytes()
    pool = getattr(_state.backend, "pool_bytes", 0)
    return ("captured: " + ", ".join(f"{g} {n} graph{'s' if n > 1 else ''}" for g, n in groups.items())
            + f"; {_state.replays:,} replays; static buffers {static / 2**20:,.0f} MiB, graph pool {pool / 2**20:,.0f} MiB")


def reset(backend: object | None = None) -> None:
    """Drop every graph, buffer and said line (a new run, a test). `backend` replaces the current one (tests
    pass Emulated(), and CudaGraphs() to put the real one back); without it a CUDA backend starts a fresh pool
    and an emulated one is kept."""
    global _state
    if backend is None:
        backend = _state.backend if isinstance(_state.backend, Emulated) else CudaGraphs()
    _state = _State(backend=backend)


def graphing() -> bool:
    """Whether the code running now is a region's warm-up or capture: what its graph will replay, where the host
    launches nothing. An op measured here times its paths as replayed graphs (replay_time): the RT tile."""
    return _state.graphing


_TIMING_RETIRED: list = []  # backends of timing captures that failed (their pools stay retired, as capture() says)


def replay_time(run: Callable[[], object], warmup: int = 2, reps: int = 5, calls: int = 10) -> float:
    """Seconds per run() as a replayed CUDA graph runs it: `warmup` runs first (Triton's compile, the allocator),
    then `calls` runs captured into one graph of a pool of its own, replayed `reps` times between CUDA events;
    the median over `calls`. Launches cost nothing there, as in a captured region: a path of several small
    kernels is not charged the host's time to launch them, which wall_time (the default timer, a sync around
    each call) counts. On the H200 (2026-11-30) wall_time gave every Triton tile of 1 to 16 keys 0.09-0.13 ms,
    flat in the tile's size: a launch's cost, by the look of it, not the kernel's. Off CUDA, inside another
    capture, or for a run a graph cannot hold (a host sync), registry.wall_time."""
    from kernels.registry import wall_time

    if not torch.cuda.is_available() or _capturing():
        return wall_time(run)
    for _ in range(warmup):
        run()
    backend = CudaGraphs()
    try:
        replay = backend.capture(lambda: [run() for _ in range(calls)], torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - a run no graph holds: timed as launched
        _TIMING_RETIRED.append(backend)
        return wall_time(run)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()  # the first replay uploads the graph
    times = []
    for _ in range(reps):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


__all__ = ["CudaGraphs", "Emulated", "MODES", "autocast_as", "autocast_state", "check", "graphing", "region",
           "replay_time", "reset", "step", "summary", "why_not"]
