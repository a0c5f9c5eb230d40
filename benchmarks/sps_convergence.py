"""A small reproduction of the SPS paper's direction (spec-001 §6 T11), printed as a table, not asserted.

    PYTHONPATH=. python benchmarks/sps_convergence.py [--steps 250] [--variants sps] [--out /tmp/sps_convergence]

Trains Standard (configs/baseline/tiny) and SPS (configs/sps/tiny: the same width, depth and data,
w = 8) through the real trainer on the embedded quickstart corpus (data/quickstart; its tokenizer
reserves <predict>), with the same data order, schedule and seed, evaluating on the same validation
batches every --eval-every steps. Prints the validation loss of each at each evaluation, against the
step and against the training FLOPs spent so far (the registry's flops_per_token x tokens seen: an SPS
step costs about twice a Standard one), so both of the paper's comparisons (per token, Fig. 1; per
compute, Fig. 2 bottom) can be read at this scale. The paper's gap (-0.04 to -0.07 nats at 53M-1.7B
parameters and 20B tokens) is not expected here; spec §6 T11 asks only that both fall.
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


def run(config: str, name: str, a, extra=()) -> tuple[list[dict], float, float]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=250, help="optimizer steps per run (16 x 256 tokens each)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--variants", nargs="*", default=["sps"],
                   help="SPS-family variants to train beside Standard: sps delayed_state reverse_sps 2x_memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/sps_convergence")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    runs = {"standard": run("baseline/tiny", "standard", a, ["model.document_mask=true"])}
    for v in a.variants:
        runs[v] = run("sps/tiny", v, a, [f"model.variant={v}"])
    print(f"# {a.steps} steps of 16 x 256 tokens on data/quickstart, d=256, 4 layers; SPS family w=8; "
          f"validation loss on the same {a.eval_batches} batches")
    names = list(runs)
    print(f"{'step':>6} " + " ".join(f"{n:>14}" for n in names) + "   " + " ".join(f"{'d ' + n:>16}" for n in names[1:]))
    by_step = {n: {r["step"]: r["val_loss"] for r in runs[n][0]} for n in names}
    for step in sorted(by_step["standard"]):
        row = [by_step[n].get(step, float("nan")) for n in names]
        print(f"{step:>6} " + " ".join(f"{x:>14.4f}" for x in row) + "   "
              + " ".join(f"{x - row[0]:>+16.4f}" for x in row[1:]))
    print("\n# the same evaluations against training compute (TFLOP spent: validation loss); wall time per run")
    for n in names:
        evals, flops, seconds = runs[n]
        points = ", ".join(f"{r['step'] * flops / 1e12:.1f}: {r['val_loss']:.4f}" for r in evals)
        print(f"{n:>14}  {flops / 1e12:.2f} TFLOP/step, {seconds:.0f} s   {points}")


if __name__ == "__main__":
    main()
