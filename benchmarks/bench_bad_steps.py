"""What the per-step bad-step check (pretrain/bad_steps.py, Trainer._step_or_skip) costs, as a share
of the step time, on benchmarks/bench_trainer.py's model and batches.

    PYTHONPATH=. python benchmarks/bench_bad_steps.py [--steps 20] [--outlier-z 0]

The check is: the step's loss summed over data-parallel ranks (no collective on one rank), the loss
and the already reduced grad norm brought to the host together (the one host sync per step; there
is none per micro batch), and the verdict (plus the outlier rule's running mean/std when on). It is
timed as the time of `_step_or_skip` minus the optimizer step inside it, step by step after the
first (warm-up) steps; the step time is the wall time between steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
from bench_trainer import MICRO, T, overrides, write_data  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--outlier-z", type=float, default=0.0, help="train.skip_outlier_z (0: the rule is off)")
    ap.add_argument("--compile", default="false", help="train.compile (the benchmark's CPU default is true)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        prefix = os.path.join(work, "data")
        write_data(prefix, max(400_000, (args.steps + args.warmup + 2) * MICRO * (T + 1) * 2))
        over = overrides(prefix, work, args.steps + args.warmup, 10**6) + [
            f"train.compile={args.compile}", f"train.skip_outlier_z={args.outlier_z}", "train.skip_outlier_window=2"]
        trainer = Trainer(load_config("baseline/xs", over), log=lambda *_: None)
        checks, steps, inner = [], [], {}
        step, decide = trainer.engine.step, trainer._step_or_skip

        def timed_step():
            t0 = time.perf_counter()
            step()
            inner["step"] = time.perf_counter() - t0

        def timed_decide(*a):
            inner["step"] = 0.0
            t0 = time.perf_counter()
            out = decide(*a)
            checks.append(time.perf_counter() - t0 - inner["step"])
            steps.append(time.perf_counter())
            return out

        trainer.engine.step, trainer._step_or_skip = timed_step, timed_decide
        trainer.fit()
    check = statistics.median(checks[args.warmup:])
    step_s = statistics.median([b - a for a, b in zip(steps[args.warmup:], steps[args.warmup + 1:])])
    print(f"d=512 L=8 T={T} micro-batch {MICRO}, fp32, compile={args.compile}, outlier rule "
          f"{'z=%g' % args.outlier_z if args.outlier_z else 'off'}: check {check * 1e6:.0f} us per step, "
          f"step {step_s * 1e3:.0f} ms; RATIO check/step = {check / step_s:.2e}")


if __name__ == "__main__":
    main()
