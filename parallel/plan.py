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


# -- step time ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense bf16 tensor-core peak
    memory_gib: float
    nvlink_gbs: float  # per GPU, one direction, inside a node
    network_gbs: float  # per GPU, one direction, between nodes
    efficiency: float  # eta_max: the share of the peak large matmuls reach in a training step (calibrated)
    gpus_per_node: int = 8


HARDWARE = {
    "a100": Hardware("A100 SXM 80 GB", 312.0, 80.0, 300.0, 25.0, 0.67),
    "h100": Hardware("H100 SXM 80 GB", 989.0, 80.0, 450.0, 50.0, 0.70),
    "h200": Hardware("H200 SXM 141 GB", 989.0, 141.0, 450.0, 50.0, 0.70),
}
H0 = 256  # the matmul width per GPU (d / tp) at which efficiency is half its maximum


def efficiency(hw: Hardware, width: float) -> float:
    """eta = eta_max x w / (w + 256) for matmuls of width w = d_model / tp on one GPU."""
    return hw.efficiency * width / (width + H0)


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # the exposed part

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s


def step_time(hw: Hardware, *, flops_per_token: float, tokens_per_step: int, gpus: int, d_model: int, layers: int,
              tp: int, pp: int, dp: int, micro_batches: int, micro_tokens: int, params_per_rank: int,
              recompute: bool, engine: str, act_bytes: int = 2) -> StepEstimate:
    """The formulas `pretrain plan --help` states:
      compute  = F x tokens_per_step / gpus / (peak x eta(d / tp)), F x 4/3 with recompute (one more forward)
      bubble   = compute x (pp - 1) / M                      (1F1B: M micro batches per step and stage)
      tp comm  = M x L/pp x (4, 6 with recompute) all-reduces of b T d x act_bytes, ring 2 (tp-1)/tp over NVLink
      pp comm  = M x 2 sends of b T d x act_bytes per stage boundary (NVLink in a node, else the network)
      dp comm  = 2 (dp-1)/dp x 4 bytes x params_per_rank over NVLink when tp x dp ranks fit a node, else the
                 network; half of it hidden behind the backward (DDP's buckets), none under pipeline stages
                 (their gradients are reduced after the schedule)."""
    flops = flops_per_token * tokens_per_step / gpus * (4 / 3 if recompute else 1.0)
    compute = flops / (hw.peak_tflops * 1e12 * efficiency(hw, d_model / tp))
    bubble = compute * (pp - 1) / micro_batches
    message = micro_tokens * d_model * act_bytes
    tp_comm = 0.0
    if tp > 1:
        tp_comm = micro_batches * layers / pp * (6 if recompute else 4) * 2 * (tp - 1) / tp * message / (hw.nvlink_gbs * 1e9)
    pp_link = hw.nvlink_gbs if tp * dp * pp <= hw.gpus_per_node else hw.network_gbs
    pp_comm = micro_batches * 2 * message / (pp_link * 1e9) if pp > 1 else 0.0
    dp_link = hw.nvlink_gbs if tp * dp <= hw.gpus_per_node else hw.network_gbs
    dp_comm = 2 * (dp - 1) / dp * 4 * params_per_rank / (dp_link * 1e9) if dp > 1 else 0.0
    if engine == "zero3":  # the parameters are gathered again for the forward and for the backward
        dp_comm *= 2
    exposed = 1.0 if pp > 1 else 0.5
    return StepEstimate(compute, bubble, tp_comm, pp_comm, dp_comm * exposed)
