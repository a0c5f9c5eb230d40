"""A model as one ordered list of units, the single walk that training, inference and pipeline stages share.

A unit is one step of the model's trunk, `h = unit.apply(h, run)`, and owns the modules and parameters
it alone uses (a shared block is owned by every unit that applies it). The model's ends (the embedding
before the first unit; the final norm, head and loss after the last) are not units.

- `Units.apply_units(h, run, lo, hi)` applies units [lo, hi): the training forward, `logits` and the
  streaming decode (a decoder's `body`) and a pipeline stage (`run_stage`) all call it, so they cannot
  drift apart.
- `Units.keep_stage(units, first, last)` drops what a pipeline rank does not run: every module and
  parameter owned only by units outside `units` (no names are listed by hand; tests/test_registry.py
  checks that every parameter belongs to a unit or an end, so a new one cannot stay behind unowned).
- `pipeline_units()` is the number of units (the planner and `pipeline_split` count them).

A model whose whole forward is one indivisible step (CRT's K passes over every block, GPN's time loop)
is one unit: `Whole` gives it the same stage interface, so the planner and dry runs treat every
architecture alike (pipeline parallelism stays refused by its registry entry).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor, nn

from parallel.stages import NotOnThisStage
from pretrain.models.base import StepContext


@dataclass
class Run:
    """What every unit of one forward reads, and what it leaves: the value blocks attend with (mask,
    RoPE tables, decode cache), the step's context (its per-step draws), the decode cache, a depth
    override at inference (CART's R), and the diagnostics units report."""

    attend: Any
    ctx: StepContext  # no default: torch 2.11's dynamo cannot wrap a StepContext default (a graph break)
    cache: Any = None
    loops: int | None = None
    diagnostics: dict = field(default_factory=dict)

    @property
    def offset(self) -> int:
        """Cached positions before this forward's first (0 without a cache)."""
        return 0 if self.cache is None else self.cache.length


@dataclass(frozen=True)
class Unit:
    """One step of the trunk: `apply(h, run) -> h` and the modules / parameters it owns. (A loop inside a
    unit that a GPU should replay as a CUDA graph is a region of kernels/captured.py, declared by the kernel
    or the model that runs it, not by the unit.)"""

    apply: Callable[[Tensor, Run], Tensor]
    owns: tuple = ()

    @classmethod
    def block(cls, block: nn.Module, slot: int) -> "Unit":
        """A block applied once, reading decode-cache slot `slot`."""
        return cls(lambda h, run: block(h, run.attend.at(slot)), (block,))


class Units:
    """The shared driver (a mixin of nn.Module models); a model defines `units()`."""

    def units(self) -> list[Unit]:
        raise NotImplementedError

    def pipeline_units(self) -> int:
        return len(self.units())

    def apply_units(self, h: Tensor, run: Run, lo: int = 0, hi: int | None = None) -> Tensor:
        units = self.units()
        for unit in units[lo:len(units) if hi is None else hi]:
            h = unit.apply(h, run)
        return h

    def keep_stage(self, units, first: bool, last: bool) -> None:
        """Drop what a pipeline rank running `units` (a range, or a set under the interleaved schedule) does
        not run; the kept parameters keep their single-device names. The ends: `drop_ends(first, last)`."""
        listed = self.units()
        kept = {id(x) for i, u in enumerate(listed) if i in units for x in u.owns}
        names = _names(self)
        for i, unit in enumerate(listed):
            for x in unit.owns if i not in units else ():
                if id(x) not in kept and id(x) in names:
                    _replace(self, names[id(x)], None if isinstance(x, nn.Parameter) else NotOnThisStage())
                    names.pop(id(x))
        self.drop_ends(first, last)

    def drop_ends(self, first: bool, last: bool) -> None:
        raise NotImplementedError


class Whole:
    """The stage interface of a model that is one unit (see the module docstring): its one stage is its
    forward; there is nothing to drop."""

    def pipeline_units(self) -> int:
        return 1

    def run_stage(self, batch, ctx, h: Tensor | None, lo: int, hi: int, last: bool) -> tuple[Tensor, dict]:
        if (lo, hi, last, h) != (0, 1, True, None):
            raise ValueError(f"{type(self).__name__} is one pipeline unit: it runs as a single stage")
        return self(batch, ctx)

    def keep_stage(self, units, first: bool, last: bool) -> None:
        if set(units) != {0} or not (first and last):
            raise ValueError(f"{type(self).__name__} is one pipeline unit: it runs as a single stage")


def unit_modules(model) -> list[nn.Module]:
    """The modules the model's units own, each once, in order: the activation-recompute policy of a model
    whose units are its blocks (each checkpointed keeps only its input; a registry `recompute_units`)."""
    seen, out = set(), []
    for unit in model.units():
        for x in unit.owns:
            if isinstance(x, nn.Module) and id(x) not in seen:
                seen.add(id(x))
                out.append(x)
    return out


def owned_parameters(model: nn.Module, owners) -> set[int]:
    """ids of the parameters of `owners` (modules and parameters, as units and ends list them)."""
    out = set()
    for x in owners:
        if isinstance(x, nn.Parameter):
            out.add(id(x))
        elif isinstance(x, nn.Module):
            out.update(id(p) for p in x.parameters())
    return out


def _names(model: nn.Module) -> dict[int, str]:
    """id -> the first attribute path of every submodule and parameter of `model`."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(m): n for n, m in model.named_modules() if n})
    return names


def _replace(model: nn.Module, path: str, value) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, value)
