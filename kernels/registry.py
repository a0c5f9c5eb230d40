"""Kernel paths as a registry: each op (attention; next RT's tiled prefill, GPN's memory recurrence)
registers named implementations ("paths"), each with a capability check, and one dispatcher per op
picks, runs and records the path for every call.

    ATTENTION = op("attention")
    ATTENTION.register("sdpa", sdpa.attention, priority=10)
    ATTENTION.register("reference", reference.attention, auto=False)   # only when forced
    out = ATTENTION(q, k, v, mask, offset=0)

Picking: the forced path if one is set, else the capable automatic path of highest priority, or,
for an op that measures (below), the fastest capable one measured for calls like this one. A
capability check sees the call's arguments and reads only Python values (devices, dtypes,
requires_grad; never tensor data, so no device sync); under torch.compile those reads happen at
trace time and dynamo guards on them.

Forcing, per op: the environment variable PRETRAIN_KERNELS="attention=reference,rt_prefill=tiled"
(read when the op is created; an op may also name a legacy variable of its own, PRETRAIN_ATTENTION),
or force(op, path) in code (tests, a config). A forced path that cannot serve a call (say a
CUDA-only kernel on the CPU) is an error naming both, never a silent fallback: a PathRefused, saying
why when the path registers a `refusal` (a check that returns its reason instead of False).
pretrain/kernel_probe.py raises it before a run starts, from a forward of the model on fake tensors.

Measured choice (op.measure_with(Measured(key, inputs)); attention opts in: which path is fastest
depends on the mask kind and the shape, which one number per path cannot say). It applies when more
than one automatic path can serve a call, nothing is forced, measuring is on, and the op's key(*args)
names the call (None: not measured; attention's key is None off CUDA, so CPU calls, and with them every
CPU test and golden loss curve, go by the static priority exactly as before). The first call of a key
runs forward + backward (forward only where no input requires grad) of every capable path on
inputs(key): fresh synthetic tensors of the key's shape and dtype, never the caller's, with autocast
off and saved-tensor hooks (an enclosing activation checkpoint's) shadowed. The timer is injectable
(Measured.timer; tests use a fake clock); the default, wall_time, syncs the device around each of REPS
calls after WARMUP and takes the median. The fastest path wins, except that a higher-priority path within
MARGIN of it keeps the key (near ties do not flip between runs); the static priority is the order of
the candidates. A path that raises while measured is dropped from that key with its reason. The choice
and every timing are kept for the life of the process (one measurement per key per process, and per
rank: ranks measure on their own), and that key dispatches to it from then on. Not measured, and not
cached, under a tensor dispatch mode (fake tensors, a FLOP counter) or a CUDA graph capture: those calls
go by priority. choices() and describe_choices() report "attention [key]: triton (2.10 ms fwd+bwd) over
sdpa (3.40 ms)" (with "; measuring took 23 s" where the measurement itself took TOOK_SAID_S or more: on a
GPU, Triton's JIT and FlexAttention's compile, paid in a run's first step), and describe_paths_used()
appends the choices of the ops that ran.

A resumed run keeps its choices: the trainer saves saved_choices() in each checkpoint's meta and a resume
puts them back (restore_choices) before its first step, so after a restart the run dispatches to the paths
it ran before (a near tie measured again could flip, and with it the low bits of every later step) without
paying the measurement (FlexAttention's compile) again. Choices made on another device model, torch or
Triton release are measured again, said in one line; new keys and changed candidates are measured as usual.

Under torch.compile the choice is made at trace time: _choose takes Python values only (the op's name,
the key, the candidates' names) and carries dynamo's assume_constant_result mark, so dynamo calls it for
real, not traced, while it traces the op; it measures on real tensors, outside any graph, and dynamo
keeps the returned name as a constant and traces that path alone. A key of symbolic sizes (dynamic
shapes) is not measured. PRETRAIN_KERNELS_MEASURE=0 (or measuring(False) in code) turns measuring off:
static priority everywhere.

paths_used() reports {op: paths that ran} since reset_paths_used(); the trainer and the generator
reset it once, before their first step, and print it. An eager call records itself; a compiled graph
records its paths once, while it is traced (_note_used is a constant to dynamo, as _choose is), so a
graph traced before a reset does not report again after it. Recorded as traced code instead, the sets'
contents became guards: every compiled model was traced again at its second call, and again after
each reset.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

ENV = "PRETRAIN_KERNELS"
MEASURE_ENV = "PRETRAIN_KERNELS_MEASURE"
TOOK_SAID_S = 1.0  # a measurement that took this long or more is said in the report, with its seconds
WARMUP, REPS = 2, 5  # per path and key: the warm-ups absorb Triton's JIT and FlexAttention's compile
MARGIN = 0.03  # a higher-priority path within 3% of the fastest keeps the call (stable choice on near ties)


@dataclass(frozen=True)
class Path:
    name: str
    fn: Callable[..., Any]
    capable: Callable[..., bool] | None  # (*args, **kwargs) -> whether it can serve this call; None: any
    priority: int
    auto: bool  # picked without being forced (False for references and debug paths)
    refusal: Callable[..., str | None] | None = None  # (*args, **kwargs) -> why it cannot serve, None if it can


class PathRefused(ValueError):
    """A forced path that does not exist or cannot serve a call: one sentence for the user."""


def _env_choices() -> dict[str, str]:
    """{op: path} from PRETRAIN_KERNELS; a malformed entry is one sentence."""
    text = os.environ.get(ENV, "").strip()
    choices = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op_name, sep, path = item.partition("=")
        if not sep or not op_name.strip() or not path.strip():
            raise ValueError(f"{ENV}={text!r}: each entry must be op=path (e.g. attention=reference), got {item!r}")
        choices[op_name.strip()] = path.strip()
    return choices


_used: dict[str, set[str]] = {}


def _env_measure() -> bool:
    return os.environ.get(MEASURE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


_measure_on = _env_measure()  # read once: a module global is what dynamo guards on (a change recompiles)


def measuring(on: bool | None = None) -> bool:
    """Whether measured choices are made (PRETRAIN_KERNELS_MEASURE, default on); measuring(False) turns
    them off in code (static priority everywhere), measuring(True) back on. Returns the setting."""
    global _measure_on
    if on is not None:
        _measure_on = bool(on)
    return _measure_on


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def wall_time(run: Callable[[], object], warmup: int = WARMUP, reps: int = REPS) -> float:
    """The default timer: seconds per run() (median of `reps` after `warmup`), the device synced around
    each timed call so queued kernels are counted (a sync costs microseconds; the calls take milliseconds)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        run()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Measured:
    """How an op opts in to measured choices (see the module docstring)."""
    key: Callable[..., Hashable | None]  # (*call args) -> calls that share a choice; None: not measured
    inputs: Callable[[Hashable], tuple[tuple, dict] | None]  # key -> (args, kwargs) of fresh synthetic tensors
    timer: Callable[[Callable[[], object]], float] | None = None  # run -> seconds per run; None: wall_time
    describe: Callable[[Hashable], str] = str  # key -> words for the report


@dataclass
class Choice:
    """One key's measured choice: the path, each path's seconds per forward + backward, the dropped ones."""
    op: str
    key: Hashable
    where: str  # the key in words
    path: str
    seconds: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # path -> why it was not measured
    backward: bool = True
    note: str = ""  # why nothing was measured (the path is then the first by priority)
    took_s: float = 0.0  # the measuring's own wall time (Triton's JIT and FlexAttention's compile included)
    kept: str = ""  # where a restored choice came from ("the checkpoint"): measured by an earlier process
    traced: bool = False  # measured while dynamo traced the caller (its time is inside that compile's)

    def __str__(self) -> str:
        what = "fwd+bwd" if self.backward else "fwd"
        text = f"{self.op} [{self.where}]: {self.path}"
        if self.note:
            return f"{text} (by priority; not measured: {self.note})"
        if self.path in self.seconds:
            text += f" ({self.seconds[self.path] * 1e3:.2f} ms {what})"
        others = [f"{n} ({t * 1e3:.2f} ms)" for n, t in sorted(self.seconds.items(), key=lambda i: i[1])
                  if n != self.path]
        if others:
            text += " over " + ", ".join(others)
        if self.dropped:
            text += "; dropped " + ", ".join(f"{n} ({why})" for n, why in self.dropped.items())
        if self.took_s >= TOOK_SAID_S:  # a run's first step pays it: say it where it is large enough to matter
            text += f"; measuring took {self.took_s:.0f} s"
        if self.kept:
            text += f"; kept from {self.kept}"
        return text


_choices: dict[str, dict[tuple, Choice]] = {}


def _fwd_bwd(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Callable[[], object], bool]:
    """A run() of fn on these inputs: forward, and backward into the inputs that require grad (through
    autograd.grad: nothing accumulates in .grad between runs); whether it has a backward."""
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        if not leaves:
            with torch.no_grad():
                return fn(*args, **kwargs)
        with torch.enable_grad():  # dynamo traces with grad off: a trace-time measurement turns it on
            out = fn(*args, **kwargs)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
        return out

    return run, bool(leaves)


def _not_measurable_now() -> bool:
    """A tensor mode (fake tensors, a FLOP counter) or a CUDA graph capture: timings would be
    meaningless or the capture broken. The call goes by priority, and nothing is cached."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _reason(e: BaseException) -> str:
    first = str(e).strip().splitlines()[:1]
    return f"{type(e).__name__}: {first[0][:160]}" if first else type(e).__name__


def _tracing() -> bool:
    """Whether dynamo is compiling a frame now (it calls _choose for real while it traces the op)."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return False
    return TracingContext.try_get() is not None


# seconds of each of dynamo's phase timers (torch._dynamo.utils.compilation_time_metrics) spent inside
# measurements: a candidate's own torch.compile (FlexAttention's) nested in a traced frame's compile adds
# entries to the same timers, which pretrain/compile_report.py subtracts so nothing is counted twice
nested_compile_s: dict[str, float] = {}


@contextmanager
def _compile_apart():
    """A measurement that compiles (FlexAttention is a torch.compile'd function) while dynamo traces the
    model (the choice is made at trace time) gets dynamo's per-thread compile bookkeeping to itself: the
    candidate's backward, compiled lazily at its first backward, would otherwise write is_forward=False
    into the enclosing compile's metrics record, and that compile's own is_forward then failed with
    "Metric(s) {'is_forward'} have already been set in the current context" (torch 2.11 and 2.13).
    The metrics record and the chromium event stacks are set aside and put back after; the timers it adds
    to are noted in nested_compile_s."""
    try:
        from torch._dynamo import utils as du

        saved = [(tls, dict(tls.__dict__)) for tls in (du._metrics_context_tls, du.get_chromium_event_logger().tls)]
        timers = du.compilation_time_metrics
    except Exception:  # noqa: BLE001 - a torch without these internals: measure as is
        yield
        return
    counts = {name: len(v) for name, v in timers.items()}
    for tls, _ in saved:
        tls.__dict__.clear()
    try:
        yield
    finally:
        for tls, state in saved:
            tls.__dict__.clear()
            tls.__dict__.update(state)
        for name, v in timers.items():
            if len(v) > counts.get(name, 0):
                nested_compile_s[name] = nested_compile_s.get(name, 0.0) + float(sum(v[counts.get(name, 0):]))


def _measure(op: Op, key: Hashable, names: tuple[str, ...]) -> Choice | None:
    m = op.measured
    made = m.inputs(key)
    if made is None:
        return None
    args, kwargs = made
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    from torch._subclasses.fake_tensor import is_fake
    if any(is_fake(t) for t in tensors):
        return None
    device = tensors[0].device.type if tensors else "cpu"
    timer = m.timer or wall_time
    choice, start = Choice(op.name, key, m.describe(key), names[0], traced=_tracing()), time.perf_counter()
    # autocast off: the inputs are in the key's dtype already; identity saved-tensor hooks shadow an
    # enclosing activation checkpoint's, which must not see these synthetic graphs
    with torch.autocast(device, enabled=False), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
            _compile_apart() if choice.traced else nullcontext():
        for name in names:
            run, choice.backward = _fwd_bwd(op.paths[name].fn, args, kwargs)
            try:
                choice.seconds[name] = float(timer(run))
            except Exception as e:  # noqa: BLE001 - any failure drops the path from this key, said why
                choice.dropped[name] = _reason(e)
    choice.took_s = time.perf_counter() - start
    if choice.seconds:
        best = min(choice.seconds.values())
        choice.path = next(n for n in names if n in choice.seconds and choice.seconds[n] <= best * (1 + MARGIN))
    return choice


def _choose(op_name: str, key: Hashable, names: tuple[str, ...]) -> str | None:
    """The path for (key, candidate names): measured on the first call, cached after. Under
    torch.compile dynamo runs this for real at trace time (its arguments are Python values) and keeps its
    result as a constant: the measurement happens outside the graph. None: go by priority."""
    cache = _choices.setdefault(op_name, {})
    hit = cache.get((key, names))
    if hit is not None:
        return hit.path
    if _not_measurable_now():
        return None
    op = _OPS[op_name]
    try:
        choice = _measure(op, key, names)
    except Exception as e:  # noqa: BLE001 - the inputs or the hooks failed: by priority, said why, not retried
        choice = Choice(op_name, key, op.measured.describe(key), names[0], note=_reason(e))
    if choice is None:
        return None
    cache[(key, names)] = choice
    return choice.path


# what torch._dynamo.assume_constant_result(_choose) sets, set here without importing dynamo (2 s at
# import on a CPU); tests/test_kernel_measure.py checks the decorator still sets exactly this
_choose._dynamo_marked_constant = True


class Op:
    """One op's dispatcher: its registered paths, the forced one (if any), and what ran."""

    def __init__(self, name: str, legacy_env: str | None = None):
        self.name = name
        self.paths: dict[str, Path] = {}
        self._automatic: list[Path] = []  # automatic paths, highest priority first
        self._forced: str | None = None
        self._forced_from = ""
        self.measured: Measured | None = None  # set by measure_with: measured choices per key
        # what the environment asks for, checked against the registered paths at the first call
        # (the paths register after the op is created)
        wanted = _env_choices().get(name) or (os.environ.get(legacy_env) or None if legacy_env else None)
        if wanted:
            self._forced, self._forced_from = wanted, ENV if name in _env_choices() else legacy_env
        _used.setdefault(name, set())

    def register(self, name: str, fn: Callable[..., Any], capable: Callable[..., bool] | None = None,
                 priority: int = 0, auto: bool = True,
                 refusal: Callable[..., str | None] | None = None) -> Callable[..., Any]:
        """`refusal` replaces `capable` where a path can say why it refuses (capable: it returns None)."""
        if name in self.paths:
            raise ValueError(f"kernel op {self.name!r} already has a path named {name!r}")
        if refusal is not None and capable is None:
            def capable(*args, **kwargs) -> bool:
                return refusal(*args, **kwargs) is None
        self.paths[name] = Path(name, fn, capable, priority, auto, refusal)
        self._automatic = sorted((p for p in self.paths.values() if p.auto), key=lambda p: -p.priority)
        return fn

    def measure_with(self, measured: Measured | None) -> None:
        """Opt in to measured choices (None: static priority only); forgets this op's earlier choices."""
        self.measured = measured
        _choices.pop(self.name, None)

    def force(self, name: str | None, source: str = "force") -> None:
        """Run every later call on path `name`; None returns to picking by capability."""
        if name is not None and name not in self.paths:
            raise ValueError(f"{source}={name!r} is not {self._a} path; choose one of {', '.join(self.paths)}")
        self._forced, self._forced_from = name, source

    @property
    def _a(self) -> str:  # "an attention", "a rt_prefill"
        return ("an " if self.name[:1] in "aeio" else "a ") + self.name

    @property
    def forced(self) -> str | None:
        return self._forced

    def pick(self, *args, **kwargs) -> Path:
        if self._forced is not None:
            path = self.paths.get(self._forced)
            if path is None:
                raise PathRefused(f"{self._forced_from}={self._forced!r} is not {self._a} path; choose one of "
                                  f"{', '.join(self.paths)}")
            if path.capable is not None and not path.capable(*args, **kwargs):
                why = path.refusal(*args, **kwargs) if path.refusal is not None else None
                raise PathRefused(f"the {self.name} path {path.name!r} (forced by {self._forced_from}) cannot serve "
                                  f"this call: {why or 'its capability check refused the device, dtype or arguments'}"
                                  f"; unset it or choose another of {', '.join(self.paths)}")
            return path
        for i, path in enumerate(self._automatic):
            if path.capable is None or path.capable(*args, **kwargs):
                if self.measured is None or not _measure_on:
                    return path  # static priority
                # a measured op: the first capable path unless its key (None on a CPU) has a measured choice
                return self._measured_pick(path, self._automatic[i + 1:], args, kwargs)
        raise RuntimeError(f"no {self.name} path can serve this call (registered: {', '.join(self.paths)})")

    def _measured_pick(self, first: Path, rest: list[Path], args, kwargs) -> Path:
        key = self.measured.key(*args, **kwargs)
        if key is None:
            return first
        names = (first.name, *(p.name for p in rest if p.capable is None or p.capable(*args, **kwargs)))
        if len(names) == 1:
            return first
        chosen = _choose(self.name, key, names)
        return first if chosen is None else self.paths[chosen]

    def __call__(self, *args, **kwargs):
        path = self.pick(*args, **kwargs)
        _note_used(self.name, path.name)
        return path.fn(*args, **kwargs)


def _note_used(op_name: str, path_name: str) -> bool:
    """Record that `path_name` of op `op_name` ran. Under torch.compile dynamo calls it for real once, at trace
    time, and keeps its result as a constant (marked as _choose is): traced as code, the set's contents became a
    guard that failed at the second call, so every compiled model compiled twice."""
    _used[op_name].add(path_name)
    return True


_note_used._dynamo_marked_constant = True


_OPS: dict[str, Op] = {}


def op(name: str, legacy_env: str | None = None) -> Op:
    """The dispatcher of op `name`, created on first use."""
    if name not in _OPS:
        _OPS[name] = Op(name, legacy_env)
    return _OPS[name]


def force(op_name: str, path: str | None) -> None:
    """Force `path` for op `op_name` (None: pick by capability again)."""
    if op_name not in _OPS:
        raise ValueError(f"{op_name!r} is not a kernel op; known: {', '.join(sorted(_OPS))}")
    _OPS[op_name].force(path)


def forced() -> dict[str, str]:
    """{op: its forced path} for every op that has one (the environment's included)."""
    return {name: o.forced for name, o in sorted(_OPS.items()) if o.forced is not None}


def paths_used() -> dict[str, list[str]]:
    """{op: the paths that ran}, for every op that has run since the last reset_paths_used()."""
    return {name: sorted(paths) for name, paths in sorted(_used.items()) if paths}


def reset_paths_used() -> None:
    for paths in _used.values():
        paths.clear()


def choices() -> dict[str, list[Choice]]:
    """{op: its measured choices, one per key} made in this process (none on a CPU)."""
    return {name: list(c.values()) for name, c in sorted(_choices.items()) if c}


def reset_choices() -> None:
    """Forget every measured choice (the next call of each key measures again): tests."""
    _choices.clear()


def context() -> dict:
    """What measured timings hold for: the device model and the torch and Triton releases (Triton's from
    its package metadata: importing it costs seconds)."""
    from importlib import metadata

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton}


def _to_plain(value):
    """A key as JSON values: tuples as lists, dtypes tagged; anything else stays (checked by a round trip)."""
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    return [_to_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _from_plain(value, cuda: str | None = None):
    """_to_plain's inverse; with `cuda` ("cuda:3"), a key's CUDA device becomes that one: rank 0 saved the
    choices, and each rank's keys name its own device."""
    if isinstance(value, dict) and isinstance(getattr(torch, str(value.get("dtype")), None), torch.dtype):
        return getattr(torch, value["dtype"])
    if isinstance(value, dict):
        raise ValueError(f"unknown tagged value {value!r}")
    if cuda is not None and isinstance(value, str) and re.fullmatch(r"cuda:\d+", value):
        return cuda
    return tuple(_from_plain(v, cuda) for v in value) if isinstance(value, list) else value


def saved_choices() -> dict | None:
    """This process's measured choices as JSON values with their context(), for a checkpoint (None: none
    made). A resumed run restores them (restore_choices), so it runs the paths the run ran before."""
    records = []
    for op_name, cache in sorted(_choices.items()):
        for (key, names), c in cache.items():
            if c.note or not c.seconds:
                continue  # nothing was measured: a resumed run may try again
            plain = _to_plain(key)
            try:
                if _from_plain(json.loads(json.dumps(plain))) != key:
                    continue
            except (TypeError, ValueError):
                continue  # a key of values JSON cannot hold: measured again after a resume
            records.append({"op": op_name, "key": plain, "names": list(names), "path": c.path, "where": c.where,
                            "seconds": c.seconds, "dropped": c.dropped, "backward": c.backward})
    return {"context": context(), "choices": records} if records else None


def restore_choices(saved, source: str = "the checkpoint", device: torch.device | None = None) -> str | None:
    """Put saved_choices()'s record back as this process's choices, those keys not measured again; a line
    for the log, None when there was nothing to restore. `device`: this rank's (its keys name it). Choices
    made on another device model or torch or Triton release are not restored (timings differ there): the
    line says so and the keys are measured again. An unreadable record is said, never fatal: measuring
    again is always correct. Ops that are forced, or not created yet, keep none (call it after the model
    is built); with measuring off, none are used, and the line says so."""
    if not saved:
        return None
    if not _measure_on:
        return f"kernels: measuring is off ({MEASURE_ENV}=0): the measured choices in {source} are not used"
    cuda = None
    if device is not None and device.type == "cuda":  # "cuda" alone: the rank's current device
        cuda = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    try:
        then, records = saved["context"], saved["choices"]
        restored = []
        for r in records:
            key, names = _from_plain(r["key"], cuda), tuple(r["names"])
            if r["path"] not in names or not all(isinstance(n, str) for n in names):
                raise ValueError(f"the path {r['path']!r} is not among {names}")
            restored.append((r["op"], (key, names), Choice(r["op"], key, str(r["where"]), r["path"],
                             {str(n): float(t) for n, t in r["seconds"].items()}, dict(r.get("dropped", {})),
                             bool(r.get("backward", True)), kept=source)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"kernels: the measured choices in {source} are unreadable ({_reason(e)}); measuring again"
    now = context()
    if then != now:
        def words(c):
            return f"{c.get('device')} (torch {c.get('torch')}, Triton {c.get('triton')})" if isinstance(c, dict) else "?"
        return (f"kernels: the measured choices in {source} were made on {words(then)}, not this "
                f"{words(now)}; measuring again")
    # an op that is forced, or not (yet) created with its measurement, would not use them (and measure_with
    # forgets an op's choices): only the others are kept
    restored = [(n, k, c) for n, k, c in restored
                if n in _OPS and _OPS[n].measured is not None and _OPS[n].forced is None]
    if not restored:
        return None
    for op_name, cache_key, choice in restored:
        _choices.setdefault(op_name, {})[cache_key] = choice
    paths = ", ".join(sorted({f"{op_name} {c.path}" for op_name, _, c in restored}))
    return (f"kernels: {len(restored)} measured choice{'s' if len(restored) != 1 else ''} kept from {source} "
            f"({paths}): the resumed run runs the paths it ran, unmeasured")


def describe_choices() -> str:
    """One clause per choice: "attention [causal & document, ...]: triton (2.10 ms fwd+bwd) over sdpa (3.40 ms)"."""
    return "; ".join(str(c) for cs in choices().values() for c in cs)


def describe_paths_used() -> str:
    """One line for logs: "attention sdpa, rt_prefill tiled" (or "none dispatched"), then the measured
    choices of the ops that ran, if any ("; measured attention [...]: triton (2.10 ms fwd+bwd) over ...")."""
    used = paths_used()
    text = ", ".join(f"{name} {'+'.join(paths)}" for name, paths in used.items()) or "none dispatched"
    made = [str(c) for name, cs in choices().items() if name in used for c in cs]
    return text + ("; measured " + "; ".join(made) if made else "")
