"""GPN+M's matrix memory over a sequence of fixed inputs: one op, two paths (spec-002 §2.5, §6 T6).

    delta_memory(q, k, v, beta, alpha, M0=None, chunk=0) -> (reads [B, T, H, d_v], last M)

Paths (kernels/registry.py):
    "chunked"    chunk steps per triangular solve (chunked.py), picked when chunk > 0
    "reference"  step by step (reference.py): the definition
The model's time loop cannot use either (its q, k, v, beta, alpha depend on the state): it calls the ops
"delta_memory_step" (one write and the first read) and "delta_memory_read" (a later read), whose
"reference" paths are reference.step / reference.read; the chunked form stays a tested identity for
fixed inputs. A fused GPU kernel of the step registers as a path of "delta_memory_step".
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


# The model's time loop, whose inputs depend on the state, one step at a time:
#     memory_step(M, k, v, beta, alpha, q) -> (M_t, M_t^T q)   the write, then the first read
#     memory_read(M, q) -> M^T q                                 a later predict sub-layer's read
STEP = registry.op("delta_memory_step")
STEP.register("reference", reference.step)
READ = registry.op("delta_memory_read")
READ.register("reference", reference.read)


def memory_step(M, k, v, beta, alpha, q):
    return STEP(M, k, v, beta, alpha, q)


def memory_read(M, q):
    return READ(M, q)


__all__ = ["OP", "READ", "STEP", "chunked", "delta_memory", "memory_read", "memory_step", "reference"]
