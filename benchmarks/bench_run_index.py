"""What the run database costs at scale: `index_root` over 1,000 generated run directories of 10,000
logged steps each, first and incremental, and a query over the result (time and peak memory).

    PYTHONPATH=. python benchmarks/bench_run_index.py [--runs 1000] [--steps 10000] [--eval-every 100]
        [--root /tmp/bench_run_index] [--keep] [--profile]

Generated: ROOT/sweep-KK/run-NNNN/ (folders of 100 runs), each with a real resolved config.yaml
(`load_config("baseline/tiny", ...)` then `to_yaml`; 4 learning rates, 4 widths of model.d_model (so
the per-model-config cache of parameter counts and FLOPs is filled 4 times), 5 seeds) and a
metrics.jsonl of `--steps` records shaped like the trainer's (pretrain/trainer.py Window.record: step,
loss, lr, grad_norm, throughput, MFU, memory, step_s, time_split, eta_s, samples, tokens, skipped
steps; val_loss/val_ppl/val_tokens every --eval-every steps and at the last), with floats at full
repr length as json writes them. Each run's validation loss levels off somewhere between 3.5 and 6.5.

Measured, each in a fresh Python process (so its peak resident size, VmHWM, is its own: ru_maxrss
would carry the parent's peak across fork and exec, see benchmarks/procmem.py):
  first      index_root with no runs.sqlite yet: every run read
  changed    index_root after 100 step records were appended to ONE run's metrics.jsonl
  unchanged  index_root with nothing changed
  query      load_runs + query.select(runs, ["optim.lr=3e-3", "val_loss_best<5"])
  (imports)  the same process importing index and query and doing nothing: the floor under the peaks
`seconds` is the call itself; `process` is the whole process (interpreter start-up and imports too).
The files were just written, so the first index reads them from the page cache: the figures are the
CPU cost of indexing, the best case for a first read from a network filesystem.

--profile: afterwards, one more first index (the database removed) under cProfile; the functions
with the most cumulative time are printed. ROOT is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procmem import status_kib  # noqa: E402  (benchmarks/, this script's folder)

MARKER = ".bench_run_index"  # ROOT is deleted only when it holds this (i.e. this script made it)
LRS = ("1e-3", "2e-3", "3e-3", "6e-3")
WIDTHS = (128, 192, 256, 384)  # baseline/tiny's 4 heads divide each
SEEDS = 5
QUERY = ["optim.lr=3e-3", "val_loss_best<5"]
SEQ, BATCH = 256, 16  # baseline/tiny's seq_len and global_batch_seqs


# ---------------------------------------------------------------------------------------------- generating

def run_dir_of(root: str, i: int) -> str:
    return os.path.join(root, f"sweep-{i // 100:02d}", f"run-{i:04d}")


def config_text(i: int, steps: int, run_dir: str, cache: dict) -> str:
    """The resolved config of run i. load_config takes ~0.15 s, so it is called once per (lr, width,
    seed) with a placeholder run_dir that is then substituted (checked equal to a direct call once)."""
    from pretrain.config import load_config, to_yaml

    lr, width, seed = LRS[i % len(LRS)], WIDTHS[(i // len(LRS)) % len(WIDTHS)], i % SEEDS

    def resolved(where: str) -> str:
        return to_yaml(load_config("baseline/tiny", [f"optim.lr={lr}", f"train.max_steps={steps}", f"train.seed={seed}",
                                                     f"train.run_dir={where}", f"model.d_model={width}"],
                                   check_data=False, log=lambda *_: None))

    key = (lr, width, seed)
    if key not in cache:
        placeholder = "/bench-run-index-placeholder"
        cache[key] = resolved(placeholder)
        assert cache[key].count(placeholder) == 1, "train.run_dir appears other than once in the yaml"
        if len(cache) == 1:
            assert cache[key].replace(placeholder, run_dir) == resolved(run_dir), "placeholder substitution differs"
    return cache[key].replace("/bench-run-index-placeholder", run_dir)


def metrics_lines(i: int, first: int, last: int, max_steps: int, eval_every: int, lr: float) -> list[str]:
    """Records first..last of run i, one JSON line each, shaped like the trainer's."""
    rnd = random.Random(i * 1_000_003 + first)
    floor = 3.5 + (i % 7) * 0.5  # where this run's loss levels off
    tau = 0.05 * max_steps
    base_tps = 4000.0 * (1 + 0.3 * (i % 4))
    out = []
    for s in range(first, last + 1):
        r = rnd.random
        loss = floor + 7.5 * math.exp(-s / tau) + 0.05 * (r() - 0.5)
        tps = base_tps * (0.97 + 0.06 * r())
        tflops = tps * 3e-5
        step_s = BATCH * SEQ / tps
        d, f, b, o = 0.004 * r(), 0.33 + 0.02 * r(), 0.6 + 0.02 * r(), 0.01 * r()
        other = max(1.0 - d - f - b - o, 0.0)
        line = (f'{{"step": {s}, "loss": {loss!r}, "lr": {lr * min(1.0, s / 25)!r}, "grad_norm": {0.3 + r()!r}, '
                f'"tokens_per_s": {tps!r}, "tflops": {tflops!r}, "tokens_per_s_per_device": {tps!r}, '
                f'"tflops_per_device": {tflops!r}, "mfu": {tflops / 0.1875!r}, "memory_gb": {0.99 + 0.02 * r()!r}, '
                f'"step_s": {step_s!r}, "time_split": {{"data": {d!r}, "forward": {f!r}, "backward": {b!r}, '
                f'"optimizer": {o!r}, "other": {other!r}}}, "eta_s": {(max_steps - s) * step_s!r}, '
                f'"consumed_samples": {s * BATCH}, "tokens": {s * BATCH * SEQ}, "skipped_steps": 0, "skipped_total": 0')
        if s % eval_every == 0 or s == max_steps:
            val = floor + 7.5 * math.exp(-s / tau) + 0.02 + 0.01 * r()
            line += f', "val_loss": {val!r}, "val_ppl": {math.exp(min(val, 50.0))!r}, "val_tokens": 19343'
        out.append(line + "}\n")
    return out


def generate(root: str, runs: int, steps: int, eval_every: int) -> tuple[int, int, float]:
    """(metrics bytes, config bytes, seconds)."""
    t0 = time.perf_counter()
    os.makedirs(root)
    open(os.path.join(root, MARKER), "w").close()
    cache: dict = {}
    mbytes = cbytes = 0
    for i in range(runs):
        d = run_dir_of(root, i)
        os.makedirs(d)
        text = config_text(i, steps, d, cache)
        with open(os.path.join(d, "config.yaml"), "w") as f:
            f.write(text)
        with open(os.path.join(d, "metrics.jsonl"), "w") as f:
            f.writelines(metrics_lines(i, 1, steps, steps, eval_every, float(LRS[i % len(LRS)])))
        cbytes += os.path.getsize(os.path.join(d, "config.yaml"))
        mbytes += os.path.getsize(os.path.join(d, "metrics.jsonl"))
        if (i + 1) % 100 == 0 or i + 1 == runs:
            print(f"  generated {i + 1}/{runs} runs, {mbytes / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s", flush=True)
    return mbytes, cbytes, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- one phase

def phase(name: str, root: str, profile: bool) -> None:
    """Runs in the child: one measured step, its figures as one JSON line on stdout."""
    from pretrain.experiments import query
    from pretrain.experiments.index import index_root, load_runs

    out = {}
    t0 = time.perf_counter()
    if name == "query":
        runs = load_runs(os.path.join(root, "runs.sqlite"))
        chosen = query.select(runs, QUERY)
        out.update(runs=len(runs), read=None, matched=len(chosen))
    elif name != "imports":
        if profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            s = prof.runcall(index_root, root, log=lambda *_: None)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(15)
            out["profile"] = buf.getvalue()
        else:
            s = index_root(root, log=lambda *_: None)
        if s.skipped:
            raise SystemExit(f"{len(s.skipped)} runs skipped, e.g. {s.skipped[0]}")
        out.update(runs=s.runs, read=s.read)
    out.update(seconds=time.perf_counter() - t0, peak_mib=status_kib("VmHWM") / 1024)
    print(json.dumps(out))


def measure(name: str, root: str, profile: bool = False) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", name, "--root", root]
                         + (["--profile"] if profile else []), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"phase {name} failed:\n{res.stderr}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process"] = wall
    db = os.path.join(root, "runs.sqlite")
    out["db_bytes"] = os.path.getsize(db) if os.path.exists(db) else 0
    return out


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10000, help="logged steps per run")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--root", default="/tmp/bench_run_index")
    ap.add_argument("--keep", action="store_true", help="do not delete ROOT at the end")
    ap.add_argument("--profile", action="store_true", help="also profile one more first index (cProfile)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # the child's side of measure()
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    if args.phase:
        return phase(args.phase, root, args.profile)

    if os.path.exists(root):
        if not os.path.exists(os.path.join(root, MARKER)):
            raise SystemExit(f"{root} exists and was not made by this benchmark; give another --root")
        shutil.rmtree(root)
    try:
        print(f"generating {args.runs:,} runs x {args.steps:,} steps under {root} ...", flush=True)
        mbytes, cbytes, gen_s = generate(root, args.runs, args.steps, args.eval_every)
        rows = [("(imports)", measure("imports", root)), ("first", measure("first", root))]
        changed = os.path.join(run_dir_of(root, args.runs // 2), "metrics.jsonl")
        i = args.runs // 2
        with open(changed, "a") as f:
            f.writelines(metrics_lines(i, args.steps + 1, args.steps + 100, args.steps, args.eval_every,
                                       float(LRS[i % len(LRS)])))
        rows += [("changed", measure("changed", root)), ("unchanged", measure("unchanged", root)),
                 ("query", measure("query", root))]
        prof = None
        if args.profile:
            os.remove(os.path.join(root, "runs.sqlite"))
            prof = measure("first", root, profile=True)["profile"]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{args.runs:,} runs x {args.steps:,} logged steps (eval every {args.eval_every}): metrics.jsonl "
          f"{mbytes / 1e9:.2f} GB, config.yaml {cbytes / 1e6:.1f} MB, generated in {gen_s:.0f} s; "
          f"runs.sqlite {rows[1][1]['db_bytes'] / 1e6:.1f} MB")
    print(f"machine: {os.cpu_count()} cores ({cpu}), Python {sys.version.split()[0]}; files in the page cache")
    print(f"{'':10s} {'seconds':>9s} {'process':>9s} {'peak RSS':>10s} {'runs':>6s} {'read':>6s}  db after")
    for name, r in rows:
        read = "-" if r.get("read") is None else f"{r['read']:,}"
        runs = "-" if r.get("runs") is None else f"{r['runs']:,}"
        note = f"  ({r['matched']} matched {' and '.join(QUERY)})" if "matched" in r else ""
        print(f"{name:10s} {r['seconds']:8.2f}s {r['process']:8.2f}s {r['peak_mib']:6.0f} MiB {runs:>6s} {read:>6s}  "
              f"{r['db_bytes'] / 1e6:.1f} MB{note}")
    print(f"reproduce: PYTHONPATH=. python benchmarks/bench_run_index.py --runs {args.runs} --steps {args.steps} "
          f"--eval-every {args.eval_every}")
    if prof:
        print("\nfirst index under cProfile (top 15 by cumulative time):\n" + prof)


if __name__ == "__main__":
    main()
