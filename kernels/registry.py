"""Kernel paths as a registry: each op (attention; next RT's tiled prefill, GPN's memory recurrence)
registers named implementations ("paths"), each with a capability check, and one dispatcher per op
picks, runs and records the path for every call.

    ATTENTION = op("attention")
    ATTENTION.register("sdpa", sdpa.attention, priority=10)
    ATTENTION.register("reference", reference.attention, auto=False)   # only when forced
    out = ATTENTION(q, k, v, mask, offset=0)

Picking: the forced path if one is set, else the capable automatic path of highest priority. A
capability check sees the call's arguments and reads only Python values (devices, dtypes,
requires_grad; never tensor data, so no device sync); under torch.compile those reads happen at
trace time and dynamo guards on them.

Forcing, per op: the environment variable PRETRAIN_KERNELS="attention=reference,rt_prefill=tiled"
(read when the op is created; an op may also name a legacy variable of its own, PRETRAIN_ATTENTION),
or force(op, path) in code (tests, a config). A forced path that cannot serve a call (say a
CUDA-only kernel on the CPU) is an error naming both, never a silent fallback: a PathRefused, saying
why when the path registers a `refusal` (a check that returns its reason instead of False).
pretrain/kernel_probe.py raises it before a run starts, from a forward of the model on fake tensors.

paths_used() reports {op: paths that ran} since reset_paths_used(); the trainer and the generator
print it once. Recording is a set.add: inside a compiled region dynamo keeps the mutation of this
module-level dict's sets as a side effect and replays it after each run of the graph, so compiled and
eager runs report alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

ENV = "PRETRAIN_KERNELS"


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


class Op:
    """One op's dispatcher: its registered paths, the forced one (if any), and what ran."""

    def __init__(self, name: str, legacy_env: str | None = None):
        self.name = name
        self.paths: dict[str, Path] = {}
        self._automatic: list[Path] = []  # automatic paths, highest priority first
        self._forced: str | None = None
        self._forced_from = ""
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
        for path in self._automatic:
            if path.capable is None or path.capable(*args, **kwargs):
                return path
        raise RuntimeError(f"no {self.name} path can serve this call (registered: {', '.join(self.paths)})")

    def __call__(self, *args, **kwargs):
        path = self.pick(*args, **kwargs)
        _used[self.name].add(path.name)
        return path.fn(*args, **kwargs)


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


def describe_paths_used() -> str:
    """One line for logs: "attention sdpa, rt_prefill tiled" (or "none dispatched")."""
    return ", ".join(f"{name} {'+'.join(paths)}" for name, paths in paths_used().items()) or "none dispatched"
