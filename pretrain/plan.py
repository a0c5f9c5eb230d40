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


def parse_layout(text: str) -> dict[str, int]:
    """"tp=4,pp=2,dp=8" -> {"tp": 4, "pp": 2, "dp": 8}; ValueError naming what is wrong."""
    out = {"tp": 1, "pp": 1, "dp": 1}
    for part in text.split(","):
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


def dry_run(cfg, tp: int, pp: int, dp: int, log=print) -> list[StageReport]:
    """Build and check every pipeline stage of `cfg` (a RunConfig) under tp x pp x dp ranks."""
    import torch

    from parallel.mesh import setup_layout
    from parallel.pipeline import Stage
    from parallel.plan import engine_of, in_flight, state_bytes
    from pretrain.data.batch import Batch
    from pretrain.models import get_arch
    from pretrain.models.base import StepContext

    parallel = replace(cfg.parallel, tp=tp, pp=pp)
    cfg = replace(cfg, parallel=parallel, train=replace(cfg.train, compile=False))  # nothing runs compiled here
    cfg.validate(check_data=False)
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
                    model.keep_stage(stage.lo, stage.hi, stage.first, stage.last)
                tokens = torch.zeros(mb, T, dtype=torch.long)
                batch = Batch(tokens, tokens, torch.ones(mb, T, dtype=torch.bool), torch.zeros(mb, T, dtype=torch.int32),
                              torch.arange(T).expand(mb, T))
                out, _ = model.run_stage(batch, StepContext.for_step(cfg.train.seed, 0), h, stage.lo, stage.hi,
                                         stage.last)
                (out if stage.last else out.float().sum()).backward()
            params = {id(p): p for p in model.parameters()}
            n = sum(p.numel() for p in params.values())
            act = None
            if spec.activation_bytes is not None:
                units = stage.hi - stage.lo
                act = spec.activation_bytes(cfg.model, T, mb, cfg.parallel.recompute) * units // \
                    model.pipeline_units() * in_flight(pp, s, micro_batches) // max(1, lay.tp)
            reports.append(StageReport(s, (stage.lo, stage.hi), n, len(params), tuple(out.shape), act))
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
