"""Sweeps: a grid over config fields, one run directory per point, run as one Slurm job array.

    # sweep.yaml
    name: lr-width
    config: baseline/tiny
    overrides: [train.max_steps=200]
    grid: {optim.lr: [1.0e-3, 3.0e-3], model.d_model: [64, 128]}
    root: runs/sweeps            # optional; points go to ROOT/NAME/<point>

A grid entry whose values are mappings sets several fields together at each of its points (fields
that must move as one, a width with its head count): `width: [{model.d_model: 256, model.n_heads: 4}, ...]`.

Points with configs of their own (a table that spans several configs: SPS's scales x variants, RT against
its Transformer rows), two ways, either or both:
- `config` as a grid axis: `grid: {config: [sps/xs, sps/s], train.seed: [0, 1]}` (the top-level `config`
  may then be left out);
- `points:` a list of points that are no product, each `{name, config, overrides}` (config defaults to
  the top-level one), run after the grid's points.
Every point's config is stored in points.json, and an array task starts from its own point's config
(`python -m slurm.sweep argv POINTS TASK`, which train.sbatch calls).

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
    return check_sweep(spec, f"sweep file {path}")


def check_sweep(spec, where: str) -> dict:
    """A sweep's fields and shapes, one sentence naming the first problem (`where` names the source)."""
    if not isinstance(spec, dict):
        raise SweepError(f"{where} is not a mapping of fields (name, config, grid, points, overrides, root)")
    unknown = set(spec) - {"name", "config", "grid", "points", "overrides", "root"}
    if unknown:
        raise SweepError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    if "name" not in spec or ("grid" not in spec and "points" not in spec):
        raise SweepError(f"{where}: needs a name and a grid or a list of points")
    grid, points = spec.get("grid") or {}, spec.get("points") or []
    if "grid" in spec and (not isinstance(grid, dict) or not grid
                           or not all(isinstance(v, list) and v for v in grid.values())):
        raise SweepError(f"{where}: grid must map each field to a non-empty list of values")
    if not isinstance(points, list) or not all(isinstance(p, dict) and p.get("name") for p in points):
        raise SweepError(f"{where}: points must be a list of {{name, config, overrides}} mappings")
    for p in points:
        if set(p) - {"name", "config", "overrides"}:
            raise SweepError(f"{where}: point {p['name']!r} has unknown field {sorted(set(p) - {'name', 'config', 'overrides'})[0]!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", str(p["name"])):
            raise SweepError(f"{where}: point name {p['name']!r} may hold only letters, digits and _ . + -")
    names = [p["name"] for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f"{where}: point name {next(n for n in names if names.count(n) > 1)!r} appears twice")
    if "config" not in spec and ("config" not in grid if grid else False):
        raise SweepError(f"{where}: missing field 'config' (a top-level config, or config as a grid axis)")
    if "config" not in spec and any("config" not in p for p in points):
        raise SweepError(f"{where}: point {next(p['name'] for p in points if 'config' not in p)!r} names no config "
                         "and the sweep has no top-level one")
    return spec


def _short(field: str, value) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "", f"{field.split('.')[-1]}{value}")


def expand(spec: dict) -> list[dict]:
    """The points in a stable order, the grid's then the listed ones: [{"name", "config", "run_dir",
    "overrides"}], run dirs under root/name."""
    root = os.path.abspath(os.path.join(spec.get("root", "runs/sweeps"), spec["name"]))
    grid = spec.get("grid") or {}
    fields = list(grid)
    rows = []  # (name, config, overrides of the point)
    for i, values in enumerate(itertools.product(*(grid[f] for f in fields))) if grid else ():
        name = f"p{i:02d}-" + "-".join(_short(f, "_".join(map(str, v.values())) if isinstance(v, dict) else v)
                                       for f, v in zip(fields, values))
        config, over = spec.get("config"), []
        for f, v in zip(fields, values):
            if f == "config":
                config = str(v)
            else:
                over += [f"{k}={x}" for k, x in v.items()] if isinstance(v, dict) else [f"{f}={v}"]
        rows.append((name, config, over))
    for p in spec.get("points") or []:
        rows.append((str(p["name"]), str(p.get("config", spec.get("config"))), [str(o) for o in p.get("overrides") or []]))
    points = []
    for name, config, over in rows:
        run_dir = os.path.join(root, name)
        points.append({"name": name, "config": config, "run_dir": run_dir,
                       "overrides": [*(spec.get("overrides") or []), *over, f"train.name={name}",
                                     f"train.run_dir={run_dir}"]})
    return points


def write_points(spec: dict, points: list[dict]) -> str:
    """points.json beside the points' run directories: what each array task reads its overrides from."""
    root = os.path.dirname(points[0]["run_dir"])
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "points.json")
    with open(path, "w") as f:
        json.dump({"name": spec["name"], "config": spec.get("config") or points[0]["config"], "points": points}, f,
                  indent=1)
    return path


def _point(points_file: str, task: str) -> tuple[dict, dict]:
    with open(points_file) as f:
        sweep = json.load(f)
    points = sweep["points"]
    if not task.isdigit() or int(task) >= len(points):
        raise SweepError(f"array task id {task!r} does not name one of the {len(points)} points of {points_file}")
    return sweep, points[int(task)]


def point_overrides(points_file: str, task: str) -> list[str]:
    """The overrides of one task, for scripts rendered before points had configs: a point with a config
    other than the sweep's is refused (those scripts would train it from the sweep's)."""
    sweep, point = _point(points_file, task)
    if point.get("config", sweep["config"]) != sweep["config"]:
        raise SweepError(f"point {point['name']} of {points_file} has its own config ({point['config']}); this "
                         "script predates per-point configs: submit the sweep again to render a new one")
    return point["overrides"]


def point_argv(points_file: str, task: str) -> list[str]:
    """CONFIG then the overrides of one array task: its point's own config (points.json written before
    points had one: the sweep's)."""
    sweep, point = _point(points_file, task)
    return [point.get("config") or sweep["config"], *point["overrides"]]


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
    pt = verbs.add_parser("point", help="one array task's overrides, one per line (train.sbatch before points had "
                          "configs of their own)")
    pt.add_argument("points_file")
    pt.add_argument("task")
    av = verbs.add_parser("argv", help="(used by train.sbatch) one array task's config, then its overrides, one per line")
    av.add_argument("points_file")
    av.add_argument("task")
    ex = verbs.add_parser("expand", help="list the points of a sweep file without submitting")
    ex.add_argument("sweep_file")
    args = ap.parse_args(argv)
    try:
        if args.verb == "status":
            print(status_table(args.sweep_dir))
        elif args.verb == "point":
            print("\n".join(point_overrides(args.points_file, args.task)))
        elif args.verb == "argv":
            print("\n".join(point_argv(args.points_file, args.task)))
        else:
            for p in expand(load_sweep(args.sweep_file)):
                print(p["name"], p["config"], " ".join(p["overrides"]))
    except (SweepError, FileNotFoundError) as e:
        print(f"slurm.sweep: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
