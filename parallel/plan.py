"""The layout planner's formulas: what a rank holds and how long a step takes, from numbers only
(no model, no torch: pretrain/plan.py measures a config's stages and calls these).

Bytes a rank holds for its `n` local parameters in `k` tensors (our trainer keeps fp32 parameters;
bf16 autocast changes the activations, not these), by parallel.data_parallel:

    engine                        weights      gradients    optimizer (AdamW exp_avg, exp_avg_sq, step)
    ddp (torch DDP, pipeline)     4n           4n           8n + 4k        (step: one fp32 scalar per tensor)
    megatron (its DDP)            4n           4n           8n + 4k
    megatron distributed opt.     4n           4n           8n / dp        (sharded; + padding, see below)
    deepspeed ZeRO-1              4n           4n           12n / dp       (fp32 partition + exp_avg + exp_avg_sq)
    deepspeed ZeRO-2              4n           4n / dp      12n / dp
    deepspeed ZeRO-3              4n / dp      4n / dp      12n / dp

n is the rank's own share: a tensor-parallel matrix counts 1/tp of its elements, a replicated vector
whole, and a pipeline stage only its own units (and the embedding / head on the first / last stage).
The sharded engines pad their flat buffers (megatron: buckets to a multiple of dp x 128 elements;
DeepSpeed: partitions to a multiple of dp x 2), which adds at most a few MB; the table leaves it out.
"""
from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("ddp", "megatron", "megatron-distopt", "zero1", "zero2", "zero3")


def engine_of(parallel) -> str:
    """The row of the table above that a ParallelConfig (read duck-typed) trains with."""
    if parallel.data_parallel == "deepspeed":
        return f"zero{parallel.zero_stage}"
    if parallel.data_parallel == "megatron":
        return "megatron-distopt" if parallel.distributed_optimizer else "megatron"
    return "ddp"


@dataclass(frozen=True)
class StateBytes:
    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def state_bytes(n: int, k: int, engine: str, dp: int) -> StateBytes:
    """Weights, gradients and optimizer state of a rank holding n parameters in k tensors (the table)."""
    if engine in ("ddp", "megatron"):
        return StateBytes(4 * n, 4 * n, 8 * n + 4 * k)
    if engine == "megatron-distopt":
        return StateBytes(4 * n, 4 * n, 8 * n // dp)
    if engine == "zero1":
        return StateBytes(4 * n, 4 * n, 12 * n // dp)
    if engine == "zero2":
        return StateBytes(4 * n, 4 * n // dp, 12 * n // dp)
    if engine == "zero3":
        return StateBytes(4 * n // dp, 4 * n // dp, 12 * n // dp)
    raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")


def in_flight(pp: int, stage: int, micro_batches: int) -> int:
    """Micro batches whose activations a stage holds at once under 1F1B: pp - stage (its warm-up
    forwards and the one in its steady state), at most the step's micro batches."""
    return max(1, min(pp - stage, micro_batches))
