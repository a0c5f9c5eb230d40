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


def in_flight(pp: int, stage: int, micro_batches: int, virtual: int = 1) -> float:
    """Micro batches whose activations a pipeline rank holds at once, in units of a micro batch through
    all of the rank's units. 1F1B: pp - stage (its warm-up forwards and the one in its steady state), at
    most the step's micro batches. Interleaved (v stages per rank, each 1/v of its units): megatron's
    warm-up of (pp - stage - 1) x 2 + (v - 1) x pp stage-micro-batches and one more, over v."""
    if virtual == 1:
        return max(1, min(pp - stage, micro_batches))
    return min((pp - stage - 1) * 2 + (virtual - 1) * pp + 1, virtual * micro_batches) / virtual


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


# -- position-serial loops (an architecture's registry serial_loop) ----------------------------------
# A loop over positions runs small per-step kernels: each step costs a latency (launches, even under CUDA
# graphs) and its matmuls have only the batch's rows. Both constants come from the one published
# measurement of such a loop: RT's per-layer forward latency against batch size on one H100 (spec-003
# §3.7, the paper's CUDA-graph table; d = 1024, T = 512, 16 heads), fitted as a line over the training
# batches (512 to 2,048 sequences):  latency(b) = T x step_s + b T (f_serial / kappa + f_batched) / (peak eta(d)).
RT_LAYER_FORWARD_MS = {512: 81.73, 1024: 134.09, 2048: 240.83}  # with CUDA graphs; batch: ms
RT_TABLE_SHAPE = dict(d=1024, f=4096, T=512)


def fit_serial_constants(hw_name: str = "h100", table: dict[int, float] | None = None,
                         shape: dict | None = None) -> tuple[float, float]:
    """(seconds per serial step, kappa: the serial FLOPs' efficiency relative to eta) from a table of
    {batch: per-layer forward ms} (default the paper's above; benchmarks/bench_rt_layer.py refits from its
    own), by least squares; f_serial = 6 d^2 + 4 d f + 2 d T (rt.serial_loop's forward part), f_batched = 6 d^2."""
    table, shape = table or RT_LAYER_FORWARD_MS, shape or RT_TABLE_SHAPE
    d, f, T = shape["d"], shape["f"], shape["T"]
    xs, ys = list(table), [ms / 1e3 for ms in table.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)  # seconds per sequence
    intercept = my - slope * mx
    hw = HARDWARE[hw_name]
    rate = hw.peak_tflops * 1e12 * efficiency(hw, d)
    f_serial, f_batched = 6 * d * d + 4 * d * f + 2 * d * T, 6 * d * d
    kappa = f_serial / (slope * rate / T - f_batched)
    return intercept / T, kappa


SERIAL_STEP_S, SERIAL_KAPPA = fit_serial_constants()  # about 55 us per step and 0.23


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
              recompute: bool, engine: str, act_bytes: int = 2, serial_steps: int = 0,
              serial_flops_per_token: float = 0.0, virtual: int = 1) -> StepEstimate:
    """The formulas `pretrain plan --help` states:
      compute  = (F - Fs + Fs / kappa) x tokens_per_step / gpus / (peak x eta(d / tp)), x 4/3 with recompute
                 (one more forward); + M x S / pp x (2 passes, 3 with recompute) x step_s
                 (Fs, S: the FLOPs per token run inside a position-serial loop and its steps per micro batch,
                 the architecture's registry serial_loop; 0 for a model that runs every position at once)
      bubble   = compute x (pp - 1) / (v M)                  (1F1B: M micro batches per step and stage; v
                 stages per rank under the interleaved schedule, 1 otherwise)
      tp comm  = M x L/pp x (4, 6 with recompute) all-reduces of b T d x act_bytes, ring 2 (tp-1)/tp over NVLink
      pp comm  = v x M x 2 sends of b T d x act_bytes per stage boundary (NVLink in a node, else the network)
      dp comm  = 2 (dp-1)/dp x 4 bytes x params_per_rank over NVLink when tp x dp ranks fit a node, else the
                 network; half of it hidden behind the backward (DDP's buckets), none under pipeline stages
                 (their gradients are reduced after the schedule)."""
    work = flops_per_token - serial_flops_per_token + serial_flops_per_token / SERIAL_KAPPA
    flops = work * tokens_per_step / gpus * (4 / 3 if recompute else 1.0)
    compute = flops / (hw.peak_tflops * 1e12 * efficiency(hw, d_model / tp))
    compute += micro_batches * serial_steps / pp * (3 if recompute else 2) * SERIAL_STEP_S
    bubble = compute * (pp - 1) / (virtual * micro_batches)
    message = micro_tokens * d_model * act_bytes
    tp_comm = 0.0
    if tp > 1:
        tp_comm = micro_batches * layers / pp * (6 if recompute else 4) * 2 * (tp - 1) / tp * message / (hw.nvlink_gbs * 1e9)
    pp_link = hw.nvlink_gbs if tp * dp * pp <= hw.gpus_per_node else hw.network_gbs
    pp_comm = virtual * micro_batches * 2 * message / (pp_link * 1e9) if pp > 1 else 0.0
    dp_link = hw.nvlink_gbs if tp * dp <= hw.gpus_per_node else hw.network_gbs
    dp_comm = 2 * (dp - 1) / dp * 4 * params_per_rank / (dp_link * 1e9) if dp > 1 else 0.0
    if engine == "zero3":  # the parameters are gathered again for the forward and for the backward
        dp_comm *= 2
    exposed = 1.0 if pp > 1 else 0.5
    return StepEstimate(compute, bubble, tp_comm, pp_comm, dp_comm * exposed)
