"""Activation recompute: the policies an architecture offers (its registry's `recompute_units`).

A policy (`Recompute`) is one of two kinds:
- wrap: model -> the modules ("units") whose forward is checkpointed from outside, by
  apply_recompute below: each unit's forward runs without keeping its activations and is recomputed
  in the backward pass (a stack of blocks, a block applied several times, a whole pass);
- configure: model -> None, the model arranges its own recomputation: the function sets what its
  forward reads (a recurrent net that checkpoints its time loop every S steps, a kernel with a custom
  backward that keeps its own memory). Nothing is wrapped.
parallel/apply.py applies the chosen one, either kind, with `Recompute.apply(model)`.

Wrapping uses torch's non-reentrant checkpoint on purpose (a model that checkpoints itself should
too, for the same reason): the recurrent architectures apply one block several times per step (CRT's
K passes, CART's R loops), and the reentrant variant then breaks data parallelism ("expected to mark a
variable ready only once" under DDP, gradients reduced twice under ZeRO) because its backward runs
outside the autograd graph the engines hook into. The parameter names do not change (the forward is
replaced on the instance), so checkpoints are the same with and without.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Recompute:
    """One activation-recompute policy: `Recompute(wrap=fn)` (fn: model -> modules to checkpoint) or
    `Recompute(configure=fn)` (fn: model -> None, configures the model's own recomputation)."""

    wrap: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None
    configure: Callable[[torch.nn.Module], Any] | None = None

    def __post_init__(self):
        if (self.wrap is None) == (self.configure is None):
            raise ValueError("a Recompute policy takes exactly one of wrap= (model -> modules to checkpoint) "
                             "or configure= (model -> None, the model recomputes by itself)")

    @property
    def kind(self) -> str:
        return "wrap" if self.wrap is not None else "configure"

    def apply(self, model: torch.nn.Module) -> None:
        """Turn this policy on for `model` (before compile and before the data-parallel engine)."""
        if self.wrap is not None:
            apply_recompute(self.wrap(model))
        else:
            self.configure(model)


def as_policy(policy: Recompute | Callable[[torch.nn.Module], list]) -> Recompute:
    """A Recompute as it is, a bare function as the wrap policy it has always meant."""
    if isinstance(policy, Recompute):
        return policy
    if callable(policy):
        return Recompute(wrap=policy)
    raise TypeError(f"a recompute policy is a Recompute or a function model -> modules, not {policy!r}")


def apply_recompute(units: list[torch.nn.Module]) -> int:
    """Wrap the forward of every unit in activation checkpointing; returns how many were wrapped."""
    for unit in units:
        if getattr(unit, "_recompute_wrapped", False):
            continue
        inner = unit.forward
        unit.forward = functools.partial(checkpoint, inner, use_reentrant=False)
        unit._recompute_wrapped = True
    return len(units)
