"""Pipeline parallelism's overhead at world size 2 on CPU, and the bytes its stages exchange.

    PYTHONPATH=. python benchmarks/bench_pipeline.py [--steps 4] [--rounds 2] [--micro 8]

The model of bench_trainer.py (Transformer++ d=512, 8 layers, vocab 32,000; T=256, micro batch 4,
fp32, compile off), with --micro micro batches per optimizer step. Three layouts, each in its own
processes, alternating for --rounds rounds; the median step (forward of the first micro batch to
zero_grad) over the second window of every round is reported:

    one-2t   one process, 2 threads: the whole machine for one rank (the reference)
    pp2      two pipeline stages of 4 layers (torchrun, 1 thread each: the same 2 cores), 1F1B
    one-1t   one process, 1 thread: what one stage's core does with the whole model

What to expect: two stages of half the work on one core each take (one-1t / 2) x (M + 1) / M per step
with M micro batches (1F1B's bubble: each stage idles one micro batch's work of the other), plus the
transfers; against one-2t this shows how well 2 threads use 2 cores (the threads' scaling) as much as
the pipeline's cost, which is why one-1t is measured too.

Bytes: the point-to-point messages of the step are counted where megatron-core sends them
(torch.distributed.batch_isend_irecv: its default batched path): each micro batch's activations
[micro, T, d] in fp32 forward and their gradient backward, plus the small shape messages of its
variable-length mode; expected M x 2 x micro x T x d x 4 bytes per step between the two stages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

LAYOUTS = ("one-2t", "pp2", "one-1t")


def _count_p2p(counter: dict, active: list) -> None:
    """Count what megatron-core's batched point-to-point path sends (its default, batch_p2p_comm)."""
    import torch.distributed as dist

    batched = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        if active[0]:
            for op in ops:
                if op.op is dist.isend:
                    counter["sent"] += op.tensor.numel() * op.tensor.element_size()
                    counter["messages"] += 1
        return batched(ops)

    dist.batch_isend_irecv = batch_isend_irecv


def child(layout: str, prefix: str, steps: int, micro_batches: int) -> None:
    counter, active = defaultdict(int), [False]
    _count_p2p(counter, active)
    from bench_parallel import time_steps
    from bench_trainer import MICRO, overrides
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix=f"bench-pp-{layout}-") as workdir:
        over = overrides(prefix, workdir, 2 * steps, steps) + [
            "train.compile=false", f"train.global_batch_seqs={MICRO * micro_batches}",
            f"train.threads={2 if layout == 'one-2t' else 1}", "checkpoint.every=0", "checkpoint.keep_last=1"]
        if layout == "pp2":
            over.append("parallel.pp=2")
        trainer = Trainer(load_config("baseline/xs", over), log=lambda *_: None)
        times = time_steps(trainer, steps, active)  # the second window's steps, as bench_parallel times them
        trainer.save = lambda: None  # the end-of-run checkpoint is not what is measured
        trainer.fit()
        cfg = trainer.cfg
    if trainer.rank == 0:
        from pretrain.models.baseline import flops_per_token

        T = cfg.data.seq_len
        head = flops_per_token(cfg.model, T, depth=0)  # the output head and loss (the embedding is a lookup)
        layers = flops_per_token(cfg.model, T) - head
        stages = [layers / 2, layers / 2 + head]  # equal runs of L/2 layers; the last stage has the head
        print(json.dumps({"times": times, "sent_per_step": counter["sent"] / steps, "stage_flops": stages,
                          "messages_per_step": counter["messages"] / steps,
                          "activation_bytes": MICRO * cfg.data.seq_len * cfg.model.d_model * 4}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per window (two windows per run)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8, help="micro batches per optimizer step (M)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.data, args.steps, args.micro)
    from bench_trainer import write_data

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        data = os.path.join(tmp, "tokens")
        write_data(data, 2_000_000)
        results = _measure(data, args)
    _report(results, args.micro)


def _measure(data: str, args) -> dict[str, list]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.path.join(ROOT, 'benchmarks')}", OMP_NUM_THREADS="1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    results: dict[str, list] = defaultdict(list)
    for r in range(args.rounds):
        for name in LAYOUTS[r % 3:] + LAYOUTS[:r % 3]:
            launch = [torchrun, "--standalone", "--nproc-per-node", "2"] if name == "pp2" else [sys.executable]
            out = subprocess.run([*launch, __file__, "--child", name, "--data", data, "--steps", str(args.steps),
                                  "--micro", str(args.micro)], capture_output=True, text=True, env=env)
            lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
            if out.returncode or not lines:
                sys.exit(f"layout {name} failed:\n{out.stderr[-3000:]}")
            results[name].append(json.loads(lines[-1]))
            times = results[name][-1]["times"]
            print(f"round {r + 1}: {name:7s} {statistics.median(times):.3f} s/step (median of {len(times)})", flush=True)
    return results


def _report(results: dict[str, list], M: int) -> None:
    med = {n: statistics.median([t for x in results[n] for t in x["times"]]) for n in LAYOUTS}
    ideal = med["one-1t"] / 2 * (M + 1) / M
    print(f"\nM = {M} micro batches per step")
    for n in LAYOUTS:
        print(f"{n:7s} {med[n]:.3f} s/step  ({med[n] / med['one-2t']:.2f}x one-2t, {med[n] / med['one-1t']:.2f}x one-1t)")
    print(f"pp2 against halves on one core each with the 1F1B bubble (one-1t / 2 x (M + 1) / M = {ideal:.3f} s): "
          f"{med['pp2'] / ideal:.2f}x")
    flops = results["pp2"][-1]["stage_flops"]
    share = max(flops) / sum(flops)
    balanced = med["one-1t"] * share * (M + 1) / M
    print(f"the stages' FLOPs are {flops[0] / 1e9:.2f} and {flops[1] / 1e9:.2f} GFLOP per token (the last holds the "
          f"head): the slower stage does {share:.0%} of the work; one-1t x {share:.2f} x (M + 1) / M = {balanced:.3f} s; "
          f"pp2 is {med['pp2'] / balanced:.2f}x that")
    last = results["pp2"][-1]
    expected = M * 2 * last["activation_bytes"]
    print(f"sent by stage 0 per step: {last['sent_per_step'] / 1e6:.2f} MB in {last['messages_per_step']:.0f} "
          f"messages; activations forward and gradients back: {expected / 2 / 1e6:.2f} MB each way "
          f"(M x micro x T x d x 4); stage 0 sends the forward half: {last['sent_per_step'] / (expected / 2):.3f}x it")


if __name__ == "__main__":
    main()
