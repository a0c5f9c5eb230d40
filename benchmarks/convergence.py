"""Side-by-side training runs printed as a validation-loss table (the architectures' small reproductions).

`compare(runs, args)` trains each named (config, overrides) through the real trainer with the same
steps, seeds, data order, schedule length and evaluation batches, then prints the validation loss of
each at each evaluation (and the difference to the first run), and the same evaluations against the
training FLOPs spent (the registry's flops_per_token x tokens seen) with each run's wall time. Used by
cart_convergence.py and gpn_convergence.py; `add_arguments` gives them the same options. The grids without
anything else to compute are recipes now (configs/<arch>/papers/cpu-*.yaml, `pretrain repro RECIPE --local`,
then `--report` and `pretrain compare ROOT --by ... --x flops` for the per-FLOP view).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from pretrain.config import load_config  # noqa: E402
from pretrain.metrics import read_metrics  # noqa: E402
from pretrain.models import get_arch  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402


def add_arguments(p: argparse.ArgumentParser, out: str, steps: int = 250) -> None:
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help="where the runs are written")


def train(config: str, name: str, a, extra=()) -> tuple[list[dict], float, float]:
    """(evaluation records, FLOPs per step, seconds) of one run."""
    over = [f"train.run_dir={a.out}/{name}", f"train.name={name}", f"train.max_steps={a.steps}",
            f"train.eval_every={a.eval_every}", f"train.eval_batches={a.eval_batches}", "train.log_every=10",
            f"checkpoint.every={a.steps}", f"train.seed={a.seed}", f"data.seed={a.seed}",
            f"schedule.warmup_steps={max(1, a.steps // 10)}", *extra]
    cfg = load_config(config, over)
    start = time.time()
    Trainer(cfg, log=lambda *_: None).fit()
    seconds = time.time() - start
    flops = get_arch(cfg.model.arch).flops_per_token(cfg.model, cfg.data.seq_len) * cfg.tokens_per_step
    evals = [r for r in read_metrics(f"{a.out}/{name}") if "val_loss" in r]
    return evals, flops, seconds


def compare(runs: dict[str, tuple[str, list[str]]], a, title: str) -> None:
    os.makedirs(a.out, exist_ok=True)
    results = {name: train(config, name, a, extra) for name, (config, extra) in runs.items()}
    names = list(results)
    print(f"# {title}; validation loss on the same {a.eval_batches} batches")
    print(f"{'step':>6} " + " ".join(f"{n:>14}" for n in names) + "   " + " ".join(f"{'d ' + n:>16}" for n in names[1:]))
    by_step = {n: {r["step"]: r["val_loss"] for r in results[n][0]} for n in names}
    for step in sorted(by_step[names[0]]):
        row = [by_step[n].get(step, float("nan")) for n in names]
        print(f"{step:>6} " + " ".join(f"{x:>14.4f}" for x in row) + "   "
              + " ".join(f"{x - row[0]:>+16.4f}" for x in row[1:]))
    print("\n# the same evaluations against training compute (TFLOP spent: validation loss); wall time per run")
    for n in names:
        evals, flops, seconds = results[n]
        points = ", ".join(f"{r['step'] * flops / 1e12:.1f}: {r['val_loss']:.4f}" for r in evals)
        print(f"{n:>14}  {flops / 1e12:.2f} TFLOP/step, {seconds:.0f} s   {points}")
