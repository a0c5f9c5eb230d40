"""Step time and communication of each data-parallel engine at world size 1, against the plain trainer.

    PYTHONPATH=. python benchmarks/bench_parallel.py [--steps 5] [--rounds 2] [--layouts plain,ddp,...]

The model of bench_trainer.py (Transformer++ d=512, 8 layers, 8 heads, FFN 1536, vocab 32,000;
T=256, micro-batch 4, fp32, 2 threads, compile off). Each layout runs in its own process (megatron's
and DeepSpeed's global state stay apart) for 2 x --steps steps; each step of the second window is
timed on its own, from forward to zero_grad (the optimizer step included). Layouts alternate for
--rounds rounds, in a rotating order; the median step over all rounds is reported, and the fastest
(the machine is shared: single steps resist the bursts of load that a window's mean absorbs).

    plain           one process, no process group, no wrapper (the reference)
    ddp             torch DDP forced around the model in a one-rank gloo group
    megatron-ddp    megatron-core DDP (its grad buffers and optimizer wrapper)
    megatron-dist   ... with its distributed optimizer
    megatron-layers megatron-core's column/row/embedding layers at TP=1, CPU shim active, no DDP
    zero1/2/3       DeepSpeed ZeRO stages

Allocator: like `pretrain train`, the benchmark re-executes itself under tcmalloc (or jemalloc) when
one is installed (pretrain/malloc.py; PRETRAIN_MALLOC=system keeps glibc's malloc), and every layout
runs under the same allocator, printed first. DeepSpeed allocates its gradient buckets and flat
partitions afresh every step (free on a GPU's caching allocator); under glibc each is new memory
from the kernel, page-faulted in, which adds ~10% to ZeRO-1/2 on top of their copies.

Bytes: every torch.distributed collective called inside the training step is counted (the size of
its full buffer) and reported per step, next to what the layout implies for N parameters (fp32):
gradient all-reduce 4N (DDP, megatron DDP); reduce-scatter 4N + all-gather 4N (distributed optimizer,
ZeRO-1/2); ZeRO-3 also gathers the parameters for the forward and again for the backward (12N in
all). On n ranks a ring moves 2(n-1)/n of an all-reduce's buffer per rank and (n-1)/n of a
reduce-scatter's or all-gather's; at world size 1 nothing crosses a wire, but the calls and copies do.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

LAYOUTS = {
    "plain": [],
    "ddp": [],
    "megatron-ddp": ["parallel.data_parallel=megatron"],
    "megatron-dist": ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"],
    "megatron-layers": ["parallel.megatron_layers=true"],
    "zero1": ["parallel.data_parallel=deepspeed", "parallel.zero_stage=1"],
    "zero2": ["parallel.data_parallel=deepspeed", "parallel.zero_stage=2"],
    "zero3": ["parallel.data_parallel=deepspeed", "parallel.zero_stage=3"],
}
EXPECTED_N = {"plain": 0, "ddp": 4, "megatron-ddp": 4, "megatron-dist": 8, "megatron-layers": 0, "zero1": 8,
              "zero2": 8, "zero3": 12}  # bytes per parameter per step implied by the layout
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "_reduce_scatter_base",
               "_all_gather_base", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _count_collectives(counter: dict, active: list) -> None:
    """Wrap torch.distributed's collectives (before megatron/DeepSpeed import them) to add up bytes."""
    import torch
    import torch.distributed as dist

    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(size(t) for t in x)
        return 0

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _orig=original, _name=name, **kwargs):
            if active[0]:
                tensors = list(args[:2]) + [v for k, v in kwargs.items() if k in ("tensor", "output", "input",
                                                                                  "output_tensor", "input_tensor")]
                counter[_name] += max((size(t) for t in tensors), default=0)
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def child(layout: str, prefix: str, steps: int) -> None:
    counter, active = defaultdict(int), [False]
    _count_collectives(counter, active)
    with tempfile.TemporaryDirectory(prefix=f"bench-{layout}-") as workdir:  # its checkpoints are ~0.5 GB
        _run_child(layout, prefix, steps, workdir, counter, active)


def time_steps(trainer, steps: int, active: list) -> list:
    """Time each step of the trainer's second window of `steps` (appended to the returned list as fit()
    runs): from the start of forward to the end of zero_grad (backward, gradient reduction, the
    finiteness check and the optimizer step between); data loading and logging are left out.
    active[0] is True inside a measured step (what the byte counters count)."""
    calls, times, began = [0], [], [0.0]

    def starts(fn):
        def run(*a, **k):
            calls[0] += 1
            active[0] = calls[0] > steps
            began[0] = time.perf_counter()
            return fn(*a, **k)
        return run

    def ends(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            finally:
                if active[0]:
                    times.append(time.perf_counter() - began[0])
                active[0] = False
        return run

    trainer._forward_backward = starts(trainer._forward_backward)
    trainer.engine.zero_grad = ends(trainer.engine.zero_grad)
    return times


def _run_child(layout, prefix, steps, workdir, counter, active) -> None:
    import torch.distributed as dist

    from bench_trainer import overrides
    from parallel.engine import Engine, EngineSettings
    from pretrain.config import load_config
    from pretrain.optim import build_optimizer
    from pretrain.models import count_parameters
    from pretrain.trainer import Trainer

    if layout == "ddp":  # a one-rank process group so that DDP really wraps the model
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
    over = overrides(prefix, workdir, 2 * steps, steps) + ["train.compile=false"] + LAYOUTS[layout]
    trainer = Trainer(load_config("baseline/xs", over), log=lambda *_: None)
    if layout == "ddp":
        trainer.engine = Engine(trainer.model, build_optimizer(trainer.model, trainer.cfg.optim),
                                EngineSettings.from_run(trainer.cfg, wrap=True))
        # DDP's reducer calls the process group from C++; torch's Python all-reduce hook routes its
        # buckets through dist.all_reduce, where they are counted
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.engine.wrapped.register_comm_hook(None, allreduce_hook)
    times = time_steps(trainer, steps, active)
    trainer.fit()
    params = count_parameters(trainer.model)["total"]
    print(json.dumps({"times": times, "params": params,
                      "bytes": {k: v / steps for k, v in counter.items() if v}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="steps per window (two windows per run)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.data, args.steps)
    from pretrain.malloc import active_allocator, use_caching_allocator

    use_caching_allocator()
    print(f"allocator: {active_allocator()}", flush=True)
    from bench_trainer import write_data

    layouts = args.layouts.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        data = os.path.join(tmp, "tokens")
        write_data(data, 2_000_000)
        results = _measure(layouts, data, args)
    _report(layouts, results)


def _measure(layouts: list[str], data: str, args) -> dict[str, list]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.path.join(ROOT, 'benchmarks')}", DS_ACCELERATOR="cpu")
    results: dict[str, list] = defaultdict(list)
    for r in range(args.rounds):
        for name in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:  # no layout always runs first
            out = subprocess.run([sys.executable, __file__, "--child", name, "--data", data, "--steps", str(args.steps)],
                                 capture_output=True, text=True, env=env)
            lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
            if out.returncode or not lines:
                sys.exit(f"layout {name} failed:\n{out.stderr[-3000:]}")
            results[name].append(json.loads(lines[-1]))
            times = results[name][-1]["times"]
            print(f"round {r + 1}: {name:16s} {statistics.median(times):.3f} s/step (median of {len(times)}, "
                  f"min {min(times):.3f})", flush=True)
    return results


def _report(layouts: list[str], results: dict[str, list]) -> None:
    """Median and fastest step over every measured step of every round, each against plain's."""
    steps = {name: [t for x in results[name] for t in x["times"]] for name in layouts}
    base = steps.get("plain")
    print(f"\n{'layout':16s} {'median':>8s} {'vs plain':>9s} {'fastest':>8s} {'vs plain':>9s} "
          f"{'bytes/step measured':>20s} {'expected':>12s}  by collective")
    for name in layouts:
        med, fast = statistics.median(steps[name]), min(steps[name])
        last = results[name][-1]
        measured = sum(last["bytes"].values())
        expected = EXPECTED_N[name] * last["params"]
        vs = ([f"{med / statistics.median(base) - 1:+8.1%}", f"{fast / min(base) - 1:+8.1%}"] if base
              else ["       -"] * 2)
        detail = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(last["bytes"].items()))
        print(f"{name:16s} {med:8.3f} {vs[0]:>9s} {fast:8.3f} {vs[1]:>9s} {measured / 1e6:17.1f} MB "
              f"{expected / 1e6:9.1f} MB  {detail}")


if __name__ == "__main__":
    main()
