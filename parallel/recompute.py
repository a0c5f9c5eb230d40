"""Activation checkpointing of an architecture's recompute units (its registry's `recompute_units`).

Each unit's forward runs without keeping its activations and is recomputed in the backward pass.
torch's non-reentrant checkpoint is used on purpose: the recurrent architectures apply one block
several times per step (CRT's K passes, CART's R loops), and the reentrant variant then breaks data
parallelism ("expected to mark a variable ready only once" under DDP, gradients reduced twice under
ZeRO) because its backward runs outside the autograd graph the engines hook into. The parameter names
do not change (the forward is replaced on the instance), so checkpoints are the same with and without.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def apply_recompute(units: list[torch.nn.Module]) -> int:
    """Wrap the forward of every unit in activation checkpointing; returns how many were wrapped."""
    for unit in units:
        if getattr(unit, "_recompute_wrapped", False):
            continue
        inner = unit.forward
        unit.forward = functools.partial(checkpoint, inner, use_reentrant=False)
        unit._recompute_wrapped = True
    return len(units)
