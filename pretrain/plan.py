"""`pretrain plan CONFIG --dry-run --layout tp=T,pp=P,dp=D`: a large layout built without its GPUs.

On torch's fake process group (every collective returns at once, nothing is sent) this process takes,
in turn, the place of one rank of each pipeline stage (tensor-parallel rank 0, data-parallel rank 0),
sets up the layout as the trainer does (megatron-core's parallel state, our layers' TP shards),
builds the model on the meta device (no memory), keeps that stage, and runs one micro batch's forward
and backward on meta tensors: every shape of a step is checked (the stage's input is the previous
stage's output). It reports each stage's parameters per rank and the bytes a rank holds (weights,
gradients, optimizer state by parallel/plan.py's table; activations from the architecture's
registry `activation_bytes` when it has one, times the micro batches 1F1B keeps in flight).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any


@dataclass
class StageReport:
    stage: int
    units: tuple[int, int]
    params: int  # this rank's parameter elements (its TP shards, its stage)
    tensors: int
    output: tuple  # what the stage sends on (the last: the loss's shape, ())
    activations: int | None  # bytes held at once, or None without an estimate
    state: Any = None  # parallel.plan.StateBytes: weights, gradients, optimizer state
    act_fraction: float = 1.0  # the stage's share of the model's pipeline units


def parse_layout(text: str) -> dict[str, int]:
    """"tp=4,pp=2,dp=8" -> {"tp": 4, "pp": 2, "dp": 8} (sizes left out are 1; "" is one rank); ValueError
    naming what is wrong."""
    out = {"tp": 1, "pp": 1, "dp": 1}
    for part in text.split(",") if text.strip() else ():  # none given: one rank
        key, _, value = part.partition("=")
        if key.strip() not in out or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--layout {text!r}: give tp=N,pp=N,dp=N with positive integers (any may be left out)")
        out[key.strip()] = int(value)
    return out


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank `rank` of a `world`-rank job on torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.mesh import teardown_layout

    if dist.is_initialized():
        raise ValueError("a dry run needs a process without a process group (run it as its own command)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        teardown_layout()
        dist.destroy_process_group()


def dry_run(cfg, tp: int, pp: int, dp: int, shapes: bool = True) -> list[StageReport]:
    """Build every pipeline stage of `cfg` (a RunConfig) under tp x pp x dp ranks and, with `shapes`,
    run one micro batch's forward and backward on meta tensors through them."""
    import torch

    from parallel.mesh import setup_layout
    from parallel.stages import Stage
    from parallel.plan import engine_of, in_flight, state_bytes
    from pretrain.data.batch import Batch
    from pretrain.models import get_arch
    from pretrain.models.base import StepContext

    parallel = replace(cfg.parallel, tp=tp, pp=pp)
    cfg = replace(cfg, parallel=parallel, train=replace(cfg.train, compile=False))  # nothing runs compiled here
    cfg.validate(check_data=False)
    if cfg.parallel.virtual_stages > 1:
        raise ValueError(f"pretrain plan --dry-run builds one stage per pipeline rank; parallel.virtual_stages="
                         f"{cfg.parallel.virtual_stages} (interleaved) is not dry-run yet: the --gpus table estimates it")
    spec = get_arch(cfg.model.arch)
    mb, T = cfg.train.micro_batch_seqs, cfg.data.seq_len
    micro_batches = cfg.train.global_batch_seqs // (mb * dp)
    if micro_batches * mb * dp != cfg.train.global_batch_seqs:
        raise ValueError(f"train.global_batch_seqs={cfg.train.global_batch_seqs} is not a multiple of "
                         f"train.micro_batch_seqs x dp = {mb} x {dp}")
    reports, h = [], None
    for s in range(pp):
        with fake_rank(s * tp * dp, tp * pp * dp):
            lay = setup_layout(parallel)
            with torch.device("meta"):
                model = spec.build(cfg.model)
                stage = Stage(0, model.pipeline_units(), True, True)
                if pp > 1:
                    stage = Stage.of(spec.pipeline_split(cfg.model, pp))
                    model.keep_stage(range(stage.lo, stage.hi), stage.first, stage.last)
                out = torch.empty(())
                if shapes:
                    tokens = torch.zeros(mb, T, dtype=torch.long)
                    batch = Batch(tokens, tokens, torch.ones(mb, T, dtype=torch.bool),
                                  torch.zeros(mb, T, dtype=torch.int32), torch.arange(T).expand(mb, T))
                    out, _ = model.run_stage(batch, StepContext.for_step(cfg.train.seed, 0), h, stage.lo, stage.hi,
                                             stage.last)
                    (out if stage.last else out.float().sum()).backward()
            params = {id(p): p for p in model.parameters()}
            n = sum(p.numel() for p in params.values())
            act = None
            whole = spec.activation_bytes(cfg.model, T, mb, cfg.parallel.recompute)
            if whole is not None:
                units = stage.hi - stage.lo
                act = whole * units // model.pipeline_units() * in_flight(pp, s, micro_batches) // max(1, lay.tp)
            reports.append(StageReport(s, (stage.lo, stage.hi), n, len(params), tuple(out.shape), act))
            reports[-1].act_fraction = (stage.hi - stage.lo) / model.pipeline_units()
            h = None if stage.last else torch.empty(out.shape, device="meta")
            del model
    engine = engine_of(parallel)
    for r in reports:
        r.state = state_bytes(r.params, r.tensors, engine, dp)
    return reports


def dry_run_lines(cfg, layout: dict, seconds: float, reports: list[StageReport]) -> list[str]:
    from parallel.plan import engine_of

    tp, pp, dp = layout["tp"], layout["pp"], layout["dp"]
    gib = lambda b: f"{b / 2**30:,.2f}"  # noqa: E731
    lines = [f"dry run of {cfg.model.arch} on {tp * pp * dp} ranks = tp {tp} x pp {pp} x dp {dp} "
             f"({engine_of(cfg.parallel)}; micro batch {cfg.train.micro_batch_seqs} x T {cfg.data.seq_len}; "
             f"recompute {cfg.parallel.recompute}): every stage built on the meta device and one micro batch's "
             f"forward and backward shape-checked in {seconds:.1f} s",
             f"{'stage':>5} {'ranks':>13} {'units':>9} {'params/rank':>14} {'weights':>8} {'grads':>8} "
             f"{'optimizer':>9} {'activations':>11} {'total GiB':>9}  sends"]
    for r in reports:
        first = r.stage * tp * dp
        act = "n/a" if r.activations is None else gib(r.activations)
        total = r.state.total + (r.activations or 0)
        lines.append(f"{r.stage:>5} {f'{first}-{first + tp * dp - 1}':>13} {f'{r.units[0]}-{r.units[1] - 1}':>9} "
                     f"{r.params:>14,} {gib(r.state.weights):>8} {gib(r.state.gradients):>8} "
                     f"{gib(r.state.optimizer):>9} {act:>11} {gib(total):>9}  "
                     f"{list(r.output) if r.output else 'the loss'}")
    if any(r.activations is None for r in reports):
        lines.append(f"activations: model.arch {cfg.model.arch!r} has no activation_bytes estimate in its registry "
                     "entry yet; the totals leave them out")
    return lines


def run_dry(cfg, layout_text: str, as_json: bool = False) -> list[str]:
    import json

    layout = parse_layout(layout_text)
    t0 = time.perf_counter()
    reports = dry_run(cfg, layout["tp"], layout["pp"], layout["dp"])
    if as_json:
        return [json.dumps({"stage": r.stage, "units": list(r.units), "params": r.params, "tensors": r.tensors,
                            "weights": r.state.weights, "gradients": r.state.gradients, "optimizer": r.state.optimizer,
                            "activations": r.activations, "output": list(r.output)}) for r in reports]
    return dry_run_lines(cfg, layout, time.perf_counter() - t0, reports)


# -- the planner ---------------------------------------------------------------------------------
RESERVE_GIB = 2.0  # CUDA context, communication buffers, allocator fragmentation


@dataclass
class Candidate:
    tp: int
    pp: int
    dp: int
    engine: str
    recompute: str
    micro_batches: int
    memory: int  # bytes on the fullest rank
    activations_known: bool
    step: Any  # parallel.plan.StepEstimate
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool = False
    micro_batch: int = 0
    virtual: int = 1  # parallel.virtual_stages


def divisors(n: int, limit: int) -> list[int]:
    return [k for k in range(1, min(n, limit) + 1) if n % k == 0]


def micro_batch_options(cfg, dp: int) -> list[int]:
    """The micro batches that keep the global batch (gradient accumulation): every divisor of its share per
    data-parallel rank, up to the whole share (a position-serial loop pays its latency per micro batch)."""
    per_rank = cfg.train.global_batch_seqs // dp
    return divisors(per_rank, per_rank)


def candidates(cfg, gpus: int, hw, memory_gib: float) -> tuple[list[Candidate], dict]:
    """Every layout of `gpus` GPUs this config validates under, with its memory and step time; and the
    refusals met ({sentence: count})."""
    from pretrain.models import get_arch
    from pretrain.run_config import ConfigError

    spec = get_arch(cfg.model.arch)
    flops = spec.flops_per_token(cfg.model, cfg.data.seq_len, None)
    policies = ["none", *spec.recompute_policies()]
    engines = {"ddp": {}, "megatron-distopt": {"data_parallel": "megatron", "distributed_optimizer": True},
               **{f"zero{z}": {"data_parallel": "deepspeed", "zero_stage": z} for z in (1, 2, 3)}}
    out, refused, inventory = [], {}, {}
    for tp in divisors(gpus, hw.gpus_per_node):
        for pp in divisors(gpus // tp, 64):
            dp = gpus // (tp * pp)
            if cfg.train.global_batch_seqs % dp:
                refused["train.global_batch_seqs does not split over the data-parallel ranks"] = \
                    refused.get("train.global_batch_seqs does not split over the data-parallel ranks", 0) + 1
                continue
            for engine, fields in engines.items():
                for policy in policies:
                    parallel = replace(cfg.parallel, **{"tp": tp, "pp": pp, "recompute": policy, "data_parallel": "ddp",
                                                        "distributed_optimizer": False, "zero_stage": 0,
                                                        "virtual_stages": 1, **fields})
                    trial = replace(cfg, parallel=parallel, train=replace(cfg.train, compile=False))
                    try:
                        trial.validate(check_data=False)
                    except (ConfigError, ValueError) as e:
                        refused[str(e)] = refused.get(str(e), 0) + 1
                        continue
                    if (tp, pp) not in inventory:  # what each stage holds (the micro batch does not matter here)
                        inventory[(tp, pp)] = dry_run(replace(trial, train=replace(trial.train, micro_batch_seqs=1)),
                                                      tp, pp, dp, shapes=False)
                    for mb in micro_batch_options(cfg, dp):  # the micro batch is free too
                        M = cfg.train.global_batch_seqs // (mb * dp)
                        for v in _virtual_options(spec, cfg.model, pp, M):
                            out.append(_candidate(cfg, spec, hw, memory_gib, inventory[(tp, pp)],
                                                  replace(parallel, virtual_stages=v), dp, mb, flops, gpus))
    out.sort(key=lambda c: (not c.fits, -c.tokens_per_s_per_gpu))
    return out, refused


def _virtual_options(spec, model_cfg, pp: int, M: int) -> list[int]:
    """1, and 2 where the interleaved schedule can run: the model splits into 2 pp stages, and the engine
    accepts M micro batches (parallel.stages.interleaving_accepts). A rank's bytes are taken from the 1F1B
    split (the same units per rank for equal layers; approximate for CART's cost-balanced split)."""
    from parallel.stages import interleaving_accepts

    if pp == 1 or not interleaving_accepts(pp, M):
        return [1]
    try:
        spec.pipeline_split(model_cfg, 2 * pp)
    except ValueError:
        return [1]
    return [1, 2]


def _candidate(cfg, spec, hw, memory_gib: float, stages: list[StageReport], parallel, dp: int, mb: int, flops: float,
               gpus: int) -> Candidate:
    """One layout with micro batch mb: the fullest rank's bytes and the step's estimate."""
    from parallel.plan import engine_of, step_time

    T, tp, pp, policy = cfg.data.seq_len, parallel.tp, parallel.pp, parallel.recompute
    M = cfg.train.global_batch_seqs // (mb * dp)
    worst, known = rank_bytes(cfg, spec, stages, parallel, dp, mb)
    steps, serial_flops = spec.serial_loop(cfg.model, T) or (0, 0.0)
    width, layers = spec.plan_shape(cfg.model)
    est = step_time(hw, flops_per_token=flops, tokens_per_step=cfg.tokens_per_step, gpus=gpus,
                    d_model=width, layers=layers, tp=tp, pp=pp, dp=dp,
                    micro_batches=M, micro_tokens=mb * T, params_per_rank=max(r.params for r in stages),
                    recompute=policy != "none", engine=engine_of(parallel), serial_steps=steps,
                    serial_flops_per_token=serial_flops, virtual=parallel.virtual_stages)
    tps = cfg.tokens_per_step / est.total_s / gpus
    c = Candidate(tp, pp, dp, engine_of(parallel), policy, M, worst, known, est, tps, flops * tps / (hw.peak_tflops * 1e12))
    c.micro_batch, c.virtual = mb, parallel.virtual_stages
    c.fits = fits(worst, memory_gib * 2**30)
    return c


def rank_bytes(cfg, spec, stages: list[StageReport], parallel, dp: int, mb: int) -> tuple[int, bool]:
    """(the fullest rank's bytes with micro batch mb, whether its activations are in them): each stage's
    weights, gradients and optimizer state (parallel/plan.py's table) and its activations (the registry's
    activation_bytes x the stage's share / tp x the micro batches in flight, under bf16 `bf16_activations`), and
    the static buffers of captured loops under train.cuda_graphs (the registry's captured_bytes)."""
    from parallel.plan import engine_of, in_flight, state_bytes

    T, tp, pp = cfg.data.seq_len, parallel.tp, parallel.pp
    M = cfg.train.global_batch_seqs // (mb * dp)
    whole = spec.activation_bytes(cfg.model, T, mb, parallel.recompute)
    worst, known = 0, whole is not None
    graphs = captured_static_bytes(cfg, spec, parallel, mb)
    if known and cfg.train.precision in ("auto", "bf16"):  # auto: bf16 on the GPUs the planner plans for
        whole = bf16_activations(cfg.model, whole, mb * T, spec.bf16_kept(parallel.recompute))
    for r in stages:
        act = 0.0
        if known:
            act = whole * r.act_fraction / tp
            act *= in_flight(pp, r.stage, M, parallel.virtual_stages)
        worst = max(worst, int(state_bytes(r.params, r.tensors, engine_of(parallel), dp).total + act + graphs))
    return worst, known


def captured_static_bytes(cfg, spec, parallel, mb: int) -> int:
    """The captured loops' static buffers on each rank that runs them (the registry's captured_bytes), under
    train.cuda_graphs on/auto, where this layout has regions to capture: GPN's segments only under
    parallel.recompute=full, and none under pipeline parallelism (kernels/captured.why_not)."""
    from kernels.captured import why_not

    if spec.captured_bytes is None or cfg.train.cuda_graphs == "off":
        return 0
    if why_not(*spec.captured_regions(replace(cfg, parallel=parallel)), parallel.pp, spec.name):
        return 0
    return spec.captured_bytes(cfg.model, cfg.data.seq_len, mb)


def bf16_activations(model_cfg, fp32_bytes: float, positions: int, kept: float) -> float:
    """A micro batch's activation bytes under bf16 autocast from the registry's fp32 estimate: the loss's logits,
    their softmax and gradient (3 V fp32 numbers per position read out; under model.loss_chunk one chunk's
    logits and their gradient, 2 V per chunk position: kernels/lm_loss's memory_columns) stay as they are; the
    rest keeps `kept` of its bytes (the registry's bf16_kept: not half, since the residual stream, norms' inputs
    and softmax statistics stay fp32). Halving all of it, as the planner did, put RT's Transformer-12L at
    128 x 512 at 65.9 GiB; it ran out of an 80 GB H100."""
    from kernels.lm_loss import memory_columns

    # width 0: under a chunk the loss keeps h's gradient, which is in autocast's dtype like the rest
    columns = memory_columns(model_cfg.vocab_size, 0, positions, getattr(model_cfg, "loss_chunk", 0))
    logits = min(fp32_bytes, 4 * positions * sum(columns))
    return logits + (fp32_bytes - logits) * kept


def fits(memory: int, capacity: float) -> bool:
    """Whether a rank holding `memory` bytes fits a GPU of `capacity` bytes, RESERVE_GIB kept free."""
    return memory + RESERVE_GIB * 2**30 <= capacity


def rank_stages(cfg, dp: int) -> list[StageReport]:
    """What each pipeline stage of cfg's own layout (parallel.tp, parallel.pp, dp data-parallel ranks)
    holds, by a dry run without shapes (the micro batch does not matter here); in this process, which
    must hold no process group."""
    trial = replace(cfg, parallel=replace(cfg.parallel, virtual_stages=1),
                    train=replace(cfg.train, compile=False, micro_batch_seqs=1))
    return dry_run(trial, cfg.parallel.tp, cfg.parallel.pp, dp, shapes=False)


def plan_lines(cfg, gpus: int, gpu: str, memory_gib: float | None, top: int = 12) -> list[str]:
    from parallel.plan import HARDWARE
    from pretrain.models import count_parameters, meta_model

    hw = HARDWARE[gpu]
    memory_gib = memory_gib or hw.memory_gib
    t0 = time.perf_counter()
    found, refused = candidates(cfg, gpus, hw, memory_gib)
    n = count_parameters(meta_model(cfg.model))["total"]
    lines = [f"plan for {cfg.model.arch} ({n:,} parameters) on {gpus} x {hw.name} ({memory_gib:g} GiB each, "
             f"{-(-gpus // hw.gpus_per_node)} node(s)): T={cfg.data.seq_len}, micro batch {cfg.train.micro_batch_seqs}, "
             f"{cfg.tokens_per_step:,} tokens per step; {len(found)} layouts in {time.perf_counter() - t0:.1f} s",
             f"{'tp':>3} {'pp':>3} {'vp':>2} {'dp':>4} {'engine':>17} {'recompute':>9} {'mb':>3} {'M':>4} {'GiB/GPU':>8} {'fits':>4} "
             f"{'tokens/s/GPU':>13} {'MFU':>6} {'step s':>7}  compute / bubble / tp / pp / dp comm s"]
    for c in found[:top]:
        s = c.step
        gib = f"{c.memory / 2**30:.1f}" + ("" if c.activations_known else "+?")
        lines.append(f"{c.tp:>3} {c.pp:>3} {c.virtual:>2} {c.dp:>4} {c.engine:>17} {c.recompute:>9} {c.micro_batch:>3} {c.micro_batches:>4} {gib:>8} "
                     f"{'yes' if c.fits else 'no':>4} {c.tokens_per_s_per_gpu:>13,.0f} {c.mfu:>6.1%} {s.total_s:>7.2f}  "
                     f"{s.compute_s:.2f} / {s.bubble_s:.2f} / {s.tp_comm_s:.2f} / {s.pp_comm_s:.2f} / {s.dp_comm_s:.2f}")
    best = next((c for c in found if c.fits), None)
    if best is None:
        lines.append("no layout fits: raise the GPU count, lower train.micro_batch_seqs or turn on parallel.recompute")
    else:
        vp = f" parallel.virtual_stages={best.virtual}" if best.virtual > 1 else ""
        lines.append(f"proposed: parallel.tp={best.tp} parallel.pp={best.pp}{vp} train.micro_batch_seqs={best.micro_batch} "
                     f"(dp {best.dp}) with {best.engine}, parallel.recompute={best.recompute}: "
                     f"{best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                     f"MFU {best.mfu:.1%} (predicted)")
    if not found or not found[0].activations_known:
        lines.append(f"activations: model.arch {cfg.model.arch!r} has no activation_bytes estimate yet; memory shows "
                     "weights, gradients and optimizer state only (+?)")
    for sentence, count in _grouped(refused)[:6]:
        lines.append(f"refused ({count}x): {sentence}")
    return lines


def _grouped(refused: dict[str, int]) -> list[tuple[str, int]]:
    """Refusals that differ only in a parallel size ("parallel.pp=2 ...", "parallel.pp=4 ...") as one
    sentence naming every size, most frequent first."""
    import re

    groups: dict[str, tuple[list, int]] = {}
    for sentence, count in refused.items():
        sizes = re.findall(r"parallel\.(?:tp|pp)=(\d+)", sentence)
        key = re.sub(r"(parallel\.(?:tp|pp))=\d+", r"\1={}", sentence, count=1) if sizes else sentence
        values, total = groups.get(key, ([], 0))
        groups[key] = (values + sizes[:1], total + count)
    out = [(key.replace("{}", ",".join(sorted(set(v), key=int)), 1) if v else key, n) for key, (v, n) in groups.items()]
    return sorted(out, key=lambda kv: -kv[1])


def predict(cfg, gpus: int, gpu: str, engine: str = "ddp") -> Candidate:
    """The estimate for cfg's own layout (parallel.tp, parallel.pp, the rest data-parallel) and micro batch
    on `gpus` GPUs of kind `gpu`, trained by `engine` (a row of parallel/plan.py's table)."""
    from parallel.plan import HARDWARE
    from pretrain.models import get_arch

    hw, tp, pp = HARDWARE[gpu], cfg.parallel.tp, cfg.parallel.pp
    fields = {"ddp": {}, "megatron": {"data_parallel": "megatron"},
              "megatron-distopt": {"data_parallel": "megatron", "distributed_optimizer": True},
              **{f"zero{z}": {"data_parallel": "deepspeed", "zero_stage": z} for z in (1, 2, 3)}}[engine]
    parallel = replace(cfg.parallel, **fields)
    dp = gpus // (tp * pp)
    stages = rank_stages(replace(cfg, parallel=parallel), dp)
    spec = get_arch(cfg.model.arch)
    return _candidate(cfg, spec, hw, hw.memory_gib, stages, parallel, dp, cfg.train.micro_batch_seqs,
                      spec.flops_per_token(cfg.model, cfg.data.seq_len, None), gpus)
