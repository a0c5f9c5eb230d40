"""Render the sbatch scripts from a config and a cluster profile, then print or submit them.

    python -m slurm.submit train baseline/xs optim.lr=1e-3 --profile slurm/profiles/example.yaml [--dry-run]
    python -m slurm.submit sweep sweep.yaml --profile P.yaml [--dry-run]
    python -m slurm.submit preprocess --profile P.yaml --tasks 8 --inputs 'corpus/*.jsonl' \\
        --output-prefix data/web -- --tokenizer-model tok.model

The rendered scripts are written next to the run (RUN_DIR/slurm/, the sweep's folder, or
OUTPUT_PREFIX.parts/) before submission, so the job can be inspected and resubmitted as it ran.
`--dry-run` prints them instead and submits nothing. A profile (see slurm/profiles/example.yaml)
holds what is site-specific: partition, account, QoS, nodes, GPUs and CPUs, time limit, launcher,
python, setup lines and environment.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

from slurm.profile import ProfileError, load_profile
from slurm.render import render_preprocess, render_train
from slurm.sweep import SweepError, expand, load_sweep, write_points


def _write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def _sbatch(script: str, *extra: str) -> str:
    try:
        res = subprocess.run(["sbatch", "--parsable", *extra, script], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ProfileError("sbatch is not on PATH: run this on a Slurm login node, or use --dry-run") from None
    if res.returncode:
        raise ProfileError(f"sbatch refused {script}: {(res.stderr or res.stdout).strip().splitlines()[-1]}")
    return res.stdout.strip().split(";")[0]


def _train(args, profile) -> int:
    from pretrain.config import load_config

    cfg = load_config(args.config, args.overrides, check_data=False)  # a bad config fails here, not in the queue
    run_dir = os.path.abspath(cfg.train.run_dir)
    text = render_train(profile, args.config, args.overrides, run_dir, args.job_name or cfg.train.name,
                        cfg.checkpoint.grace_s)
    if args.dry_run:
        print(text, end="")
        return 0
    job = _sbatch(_write(os.path.join(run_dir, "slurm", "train.sbatch"), text))
    print(f"submitted job {job}: {run_dir} (output in {run_dir}/slurm/)")
    return 0


def _sweep(args, profile) -> int:
    spec = load_sweep(args.sweep_file)
    points = expand(spec)
    submit_sweep(spec, points, profile, args.job_name or spec["name"], args.dry_run)
    return 0


def submit_sweep(spec: dict, points: list[dict], profile, job_name: str, dry_run: bool = False) -> str:
    """Render and submit `points` (slurm.sweep.expand) as one array, each task from its point's config;
    the array's job id ("" for a dry run, which prints the script instead)."""
    from pretrain.config import load_config

    for p in points:  # every point's config must load before anything is queued
        try:
            load_config(p["config"], p["overrides"], check_data=False)
        except ValueError as e:
            raise SweepError(f"point {p['name']}: {e}") from None
    root = os.path.dirname(points[0]["run_dir"])
    points_file = os.path.join(root, "points.json")
    text = render_train(profile, points[0]["config"], [], root, job_name, array=f"0-{len(points) - 1}",
                        points=points_file)
    if dry_run:
        print("\n".join(f"# point {i}: {p['name']}: {p['config']} {' '.join(p['overrides'])}"
                        for i, p in enumerate(points)))
        print(text, end="")
        return ""
    write_points(spec, points)
    os.makedirs(os.path.join(root, "slurm"), exist_ok=True)  # Slurm fails a job whose output folder is missing
    job = _sbatch(_write(os.path.join(root, "sweep.sbatch"), text))
    print(f"submitted array job {job}: {len(points)} points under {root}; status: python -m slurm.sweep status {root}")
    return job


def _preprocess(args, profile) -> int:
    files = sorted(f for pattern in args.inputs for f in (glob.glob(pattern) or [pattern]))
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"input {missing[0]} does not exist")
    out = os.path.abspath(args.output_prefix)
    parts = out + ".parts"
    inputs_file = os.path.join(parts, "inputs.txt")
    keys = args.json_keys
    rest = list(args.rest) + ["--json-keys", *keys]
    tokenize = render_preprocess(profile, out, inputs_file, args.tasks, rest, keys, merge=False)
    merge = render_preprocess(profile, out, inputs_file, args.tasks, [], keys, merge=True)
    if args.dry_run:
        print(tokenize + "\n# --- then, after the array (afterok):\n" + merge, end="")
        return 0
    os.makedirs(os.path.join(parts, "logs"), exist_ok=True)
    with open(inputs_file, "w") as f:
        f.write("\n".join(os.path.abspath(x) for x in files) + "\n")
    array = _sbatch(_write(os.path.join(parts, "tokenize.sbatch"), tokenize))
    job = _sbatch(_write(os.path.join(parts, "merge.sbatch"), merge), f"--dependency=afterok:{array}")
    print(f"submitted tokenize array {array} ({args.tasks} tasks, {len(files)} files) and merge job {job} "
          f"-> {out}_<key>_document")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m slurm.submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = ap.add_subparsers(dest="verb", required=True)

    def common(p):
        p.add_argument("--profile", required=True, help="cluster profile YAML (see slurm/profiles/example.yaml)")
        p.add_argument("--dry-run", action="store_true", help="print the rendered script(s); submit nothing")
        p.add_argument("--job-name", help="Slurm job name (default: train.name or the sweep's name)")

    t = verbs.add_parser("train", help="one training job")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*")
    common(t)
    s = verbs.add_parser("sweep", help="a grid of runs as one job array (see python -m slurm.sweep --help)")
    s.add_argument("sweep_file")
    common(s)
    p = verbs.add_parser("preprocess", help="tokenize across array tasks, then merge")
    p.add_argument("--inputs", nargs="+", required=True, help="input files or quoted globs")
    p.add_argument("--output-prefix", required=True, help="final dataset: OUTPUT_PREFIX_<key>_document")
    p.add_argument("--tasks", type=int, default=2, help="array tasks (each takes every TASKS-th file)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("rest", nargs="*", help="after --: arguments for pretrain-data preprocess (tokenizer, ...)")
    common(p)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
        if getattr(args, "tasks", 1) < 1:
            raise ProfileError("--tasks must be at least 1")
        return {"train": _train, "sweep": _sweep, "preprocess": _preprocess}[args.verb](args, profile)
    except (ProfileError, SweepError, ValueError, FileNotFoundError) as e:
        print(f"slurm.submit {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
