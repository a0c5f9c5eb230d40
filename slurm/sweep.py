"""Sweeps: a grid over config fields, one run directory per point, run as one Slurm job array.

    # sweep.yaml
    name: lr-width
    config: baseline/tiny
    overrides: [train.max_steps=200]
    grid: {optim.lr: [1.0e-3, 3.0e-3], model.d_model: [64, 128]}
    root: runs/sweeps            # optional; points go to ROOT/NAME/<point>

A grid entry whose values are mappings sets several fields together at each of its points (fields
that must move as one, a width with its head count): `width: [{model.d_model: 256, model.n_heads: 4}, ...]`.

    python -m slurm.submit sweep sweep.yaml --profile P.yaml   # renders and submits the array
    python -m slurm.sweep status runs/sweeps/lr-width          # each point's state and final val loss
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys


class SweepError(ValueError):
    pass


def load_sweep(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            spec = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise SweepError(f"sweep file {path} does not exist") from None
    for key in ("name", "config", "grid"):
        if key not in spec:
            raise SweepError(f"sweep file {path}: missing field {key!r} (needs name, config, grid)")
    unknown = set(spec) - {"name", "config", "grid", "overrides", "root"}
    if unknown:
        raise SweepError(f"sweep file {path}: unknown field {sorted(unknown)[0]!r}")
    grid = spec["grid"]
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError(f"sweep file {path}: grid must map each field to a non-empty list of values")
    return spec


def _short(field: str, value) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "", f"{field.split('.')[-1]}{value}")


def expand(spec: dict) -> list[dict]:
    """Grid points in a stable order: [{"name", "run_dir", "overrides"}], run dirs under root/name."""
    root = os.path.abspath(os.path.join(spec.get("root", "runs/sweeps"), spec["name"]))
    fields = list(spec["grid"])
    points = []
    for i, values in enumerate(itertools.product(*(spec["grid"][f] for f in fields))):
        name = f"p{i:02d}-" + "-".join(_short(f, "_".join(map(str, v.values())) if isinstance(v, dict) else v)
                                       for f, v in zip(fields, values))
        run_dir = os.path.join(root, name)
        over = list(spec.get("overrides") or [])
        for f, v in zip(fields, values):
            over += [f"{k}={x}" for k, x in v.items()] if isinstance(v, dict) else [f"{f}={v}"]
        points.append({"name": name, "run_dir": run_dir,
                       "overrides": over + [f"train.name={name}", f"train.run_dir={run_dir}"]})
    return points


def write_points(spec: dict, points: list[dict]) -> str:
    """points.json beside the points' run directories: what each array task reads its overrides from."""
    root = os.path.dirname(points[0]["run_dir"])
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "points.json")
    with open(path, "w") as f:
        json.dump({"name": spec["name"], "config": spec["config"], "points": points}, f, indent=1)
    return path


def point_overrides(points_file: str, task: str) -> list[str]:
    with open(points_file) as f:
        points = json.load(f)["points"]
    if not task.isdigit() or int(task) >= len(points):
        raise SweepError(f"array task id {task!r} does not name one of the {len(points)} points of {points_file}")
    return points[int(task)]["overrides"]


def point_status(run_dir: str) -> tuple[str, int, float | None]:
    """(state, last logged step, final validation loss or None) from the run directory alone."""
    from pretrain.metrics import read_metrics
    from pretrain.preemption import EXIT_REQUEUE

    if not os.path.isdir(run_dir):
        return "pending", 0, None
    records = read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    step = max((r["step"] for r in records), default=0)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    from slurm.job import read_history

    ends = [r for r in read_history(run_dir) if r.get("event") == "end"]
    if ends and ends[-1]["rc"] == 0 and not ends[-1]["stopped"]:
        state = "done"
    elif ends and ends[-1]["rc"] not in (0, EXIT_REQUEUE):  # a requeue's stop is not a failure
        state = f"failed (exit {ends[-1]['rc']})"
    else:
        state = "running" if step else "started"
    return state, step, (val[-1] if val else None)


def status_table(sweep_dir: str) -> str:
    with open(os.path.join(sweep_dir, "points.json")) as f:
        points = json.load(f)["points"]
    rows = [f"{'point':40s} {'state':16s} {'step':>6s} {'val loss':>9s}"]
    for p in points:
        state, step, val = point_status(p["run_dir"])
        rows.append(f"{p['name']:40s} {state:16s} {step:6d} {'-' if val is None else f'{val:.4f}':>9s}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = ap.add_subparsers(dest="verb", required=True)
    st = verbs.add_parser("status", help="each point's state, step and final validation loss")
    st.add_argument("sweep_dir")
    pt = verbs.add_parser("point", help="(used by train.sbatch) one array task's overrides, one per line")
    pt.add_argument("points_file")
    pt.add_argument("task")
    ex = verbs.add_parser("expand", help="list the points of a sweep file without submitting")
    ex.add_argument("sweep_file")
    args = ap.parse_args(argv)
    try:
        if args.verb == "status":
            print(status_table(args.sweep_dir))
        elif args.verb == "point":
            print("\n".join(point_overrides(args.points_file, args.task)))
        else:
            for p in expand(load_sweep(args.sweep_file)):
                print(p["name"], " ".join(p["overrides"]))
    except (SweepError, FileNotFoundError) as e:
        print(f"slurm.sweep: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
