"""GPN+M's matrix memory over a sequence of fixed inputs: one op, two paths (spec-002 §2.5, §6 T6).

    delta_memory(q, k, v, beta, alpha, M0=None, chunk=0) -> (reads [B, T, H, d_v], last M)

Paths (kernels/registry.py):
    "chunked"    chunk steps per triangular solve (chunked.py), picked when chunk > 0
    "reference"  step by step (reference.py): the definition, and what the model's time loop uses
                 (reference.write / reference.read), because its inputs depend on the state
A Triton path of the fused write-and-read for the GPU registers here later, tested against both.
"""
from __future__ import annotations

from kernels import registry
from kernels.delta_memory import chunked, reference

OP = registry.op("delta_memory")
OP.register("chunked", chunked.recurrence, priority=10,
            capable=lambda q, k, v, beta, alpha, M0=None, chunk=0: chunk > 0)
OP.register("reference", reference.recurrence)


def delta_memory(q, k, v, beta, alpha, M0=None, chunk: int = 0):
    return OP(q, k, v, beta, alpha, M0, chunk=chunk)


__all__ = ["OP", "chunked", "delta_memory", "reference"]
