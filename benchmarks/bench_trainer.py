"""Trainer throughput against a bare PyTorch loop (torch.compile + fused AdamW), side by side.

    PYTHONPATH=. python benchmarks/bench_trainer.py [--steps 30] [--rounds 2]

Same model (the registry's Transformer++ at d=512, 8 layers, 8 heads, FFN 1536, vocab 32,000),
same batches (T=256, micro-batch 4, fp32, 2 threads). The bare loop holds its batches in memory
and does nothing but forward, backward and the optimizer step; the trainer runs with its CPU
defaults (data loading, schedule, clipping, NaN check, progress lines, metrics.jsonl), and its
throughput is read from its metrics after the first (compilation) window. The two alternate for
--rounds rounds; medians are reported.

MFU = tokens/s * FLOPs per token / peak, with FLOPs per token = 6 N + 12 L d T (N = matmul
parameters, output head included) and the peak from the fp32 matmul probe (pretrain.metrics).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_tools.indexed import IndexedWriter  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.data import Collator, PackedDataset  # noqa: E402
from pretrain.metrics import probe_cpu_peak_tflops, read_metrics  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402

MODEL = {"model.vocab_size": 32000, "model.d_model": 512, "model.n_layers": 8, "model.n_heads": 8,
         "model.ffn_hidden": 1536, "model.max_seq_len": 256}
T, MICRO = 256, 4


def write_data(prefix: str, tokens: int) -> None:
    rng = np.random.default_rng(0)
    with IndexedWriter(prefix, np.uint16) as w:
        lengths = rng.integers(200, 2000, tokens // 1000)
        w.add_sequences(rng.integers(5, 32000, int(lengths.sum()), dtype=np.uint16), lengths)


def overrides(prefix: str, workdir: str, steps: int, window: int) -> list[str]:
    o = dict(MODEL)
    o.update({"data.train": f"[{prefix}]", "data.split": "99,1", "data.seq_len": T, "data.tokenizer": "''",
              "data.cache_dir": os.path.join(workdir, "cache"), "train.run_dir": os.path.join(workdir, "run"),
              "train.max_steps": steps, "train.global_batch_seqs": MICRO, "train.micro_batch_seqs": MICRO,
              "train.log_every": window, "train.eval_every": 0, "train.eval_batches": 1,
              "train.threads": 2, "checkpoint.resume": "false", "schedule.warmup_steps": 1,
              "model.document_mask": "false"})
    return [f"{k}={v}" for k, v in o.items()]


def bare_loop(cfg, batches, steps: int, warmup: int) -> float:
    """tokens/s of forward + backward + fused AdamW on a compiled model, nothing else."""
    torch.manual_seed(0)
    spec = get_arch("baseline")
    model = spec.build(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = torch.compile(model)
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        loss, _ = step_fn(batches[i % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * MICRO * T / (time.perf_counter() - t0)


def trainer_run(args_over, window: int, run_dir: str) -> float:
    trainer = Trainer(load_config("baseline/xs", args_over + [f"train.run_dir={run_dir}"]), log=lambda *_: None)
    trainer.fit()
    records = read_metrics(trainer.run_dir)
    return statistics.median(r["tokens_per_s"] for r in records[1:])  # after the compile window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from pretrain.malloc import active_allocator, use_caching_allocator

    use_caching_allocator()  # as `pretrain train` does; PRETRAIN_MALLOC=system keeps glibc's malloc
    print(f"allocator: {active_allocator()}", flush=True)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="bench_trainer-") as work:
        prefix = os.path.join(work, "data")
        write_data(prefix, 2_000_000)
        window = args.steps // 3
        over = overrides(prefix, work, args.warmup + args.steps, window)
        over_default = overrides(prefix, work, window * 4, window)
        cfg = load_config("baseline/xs", over)
        ds = PackedDataset(prefix, T, split="99,1", cache_dir=os.path.join(work, "cache"))
        collate = Collator(eod_id=None)
        batches = [collate(ds.get_many(range(i * MICRO, (i + 1) * MICRO))) for i in range(16)]
        spec = get_arch("baseline")
        flops = spec.flops_per_token(cfg.model, T, None)
        peak = probe_cpu_peak_tflops(2)
        bare, ours = [], []
        for r in range(args.rounds):
            bare.append(bare_loop(cfg, batches, args.steps, args.warmup))
            ours.append(trainer_run(over_default, window, os.path.join(work, f"run{r}")))
            print(f"round {r + 1}: bare {bare[-1]:,.0f} tok/s, trainer {ours[-1]:,.0f} tok/s", flush=True)
        b, o = statistics.median(bare), statistics.median(ours)
        default_compile = load_config("baseline/xs", over_default).train.compile
        print(f"\nd=512 L=8 H=8 FFN=1536 T={T} vocab 32000 micro-batch {MICRO}, fp32, 2 threads; "
              f"{flops / 1e6:.1f} MFLOP/token (6N + 12LdT), probed peak {peak * 1e3:.0f} GFLOP/s")
        print(f"bare loop (compile, fused AdamW): {b:>8,.0f} tok/s  MFU {b * flops / peak / 1e12:.1%}")
        print(f"trainer, CPU defaults (compile={default_compile}): {o:>8,.0f} tok/s  "
              f"MFU {o * flops / peak / 1e12:.1%}")
        print(f"RATIO trainer/bare = {o / b:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
