"""A paper's table as a recipe: its grid of runs, the figures the paper reports per row, and the metric.

    pretrain repro sps/papers/table2-scales --plan --gpus 64 --gpu h100   # runs, tokens, predicted GPU-hours
    pretrain repro RECIPE --submit --profile P.yaml [--root runs/repro]   # one Slurm array (+ its evaluation job)
    pretrain repro RECIPE --local [--root runs/repro] [overrides]         # one run after another, here
    pretrain repro RECIPE --report runs/repro                             # the paper's table beside ours

A recipe (YAML, shipped under configs/<arch>/papers/; see docs/experiments.md for the fields):
`paper`, `table`, `source` (the spec section of the figures), `metric` (a validation figure at the run's
last evaluation, val_loss_best, or for evaluation rows a figure of `pretrain eval --json`), `name` (the
runs go to ROOT/NAME/RUN), optional `note` and `overrides` (every run), `runs` (each {name, config,
overrides}: one point of a sweep, with its own config), and `rows` (the table: each {run, paper, and
optionally eval: FIELD=VALUE, label, source}). A row with `eval` is the trained run evaluated at one value
of an inference field (CRT's K, CART's R'): the recipe's evaluation step runs `pretrain eval RUN --sweep
FIELD=V1,V2,...` once per run and field and stores the table in RUN/evals/FIELD.json, which the index reads.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_KEYS = {"paper", "table", "source", "metric", "name", "note", "overrides", "runs", "rows"}
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


class RecipeError(ValueError):
    """A recipe that cannot be used, in one sentence naming the file and the problem."""


def recipe_path(source: str) -> str:
    """A YAML file, or a shipped recipe's short name (sps/papers/table2-scales)."""
    from pretrain.config import shipped_file

    if os.path.isfile(source):
        return source
    if shipped_file(source):
        return shipped_file(source)
    known = ", ".join(shipped_recipes()[:3])
    raise RecipeError(f"recipe {source!r} is neither a file nor a shipped recipe (e.g. {known}; "
                      "`pretrain repro --list` lists them)")


def shipped_recipes() -> list[str]:
    from importlib import resources

    root, out = resources.files("configs"), []
    for group in sorted(p.name for p in root.iterdir() if p.is_dir()):
        papers = root.joinpath(group, "papers")
        if papers.is_dir():
            out += [f"{group}/papers/{f.name[:-5]}" for f in sorted(papers.iterdir(), key=lambda f: f.name)
                    if f.name.endswith(".yaml")]
    return out


def load_recipe(source: str, check_configs: bool = True) -> dict:
    """The recipe, every field checked; with check_configs every run's config (and each evaluation value)
    loads, so a missing config or field is refused before anything runs."""
    import yaml

    path = recipe_path(source)
    try:
        with open(path) as f:
            r = yaml.safe_load(f)
    except yaml.YAMLError:
        raise RecipeError(f"recipe {path} is not valid YAML") from None
    where = f"recipe {path}"
    if not isinstance(r, dict):
        raise RecipeError(f"{where} is not a mapping of fields ({', '.join(sorted(_KEYS))})")
    if set(r) - _KEYS:
        raise RecipeError(f"{where}: unknown field {sorted(set(r) - _KEYS)[0]!r} (fields: {', '.join(sorted(_KEYS))})")
    for key in ("paper", "table", "metric", "name", "runs", "rows"):
        if not r.get(key):
            raise RecipeError(f"{where}: missing field {key!r}")
    if not isinstance(r.get("overrides") or [], list):
        raise RecipeError(f"{where}: overrides must be a list of FIELD=VALUE, got {r['overrides']!r}")
    if not re.fullmatch(r"val_[A-Za-z0-9_]+", str(r["metric"])):
        raise RecipeError(f"{where}: metric must be a validation figure (val_loss, val_ppl, val_acc_..., val_loss_best), "
                          f"got {r['metric']!r}")
    if not _NAME.fullmatch(str(r["name"])):
        raise RecipeError(f"{where}: name {r['name']!r} may hold only letters, digits and _ . + -")
    runs = r["runs"]
    if not isinstance(runs, list) or not all(isinstance(x, dict) for x in runs):
        raise RecipeError(f"{where}: runs must be a list of {{name, config, overrides}}")
    names = set()
    for x in runs:
        if set(x) - {"name", "config", "overrides"} or not x.get("name") or not x.get("config"):
            raise RecipeError(f"{where}: each run needs a name and a config (and may have overrides), got {x}")
        if not _NAME.fullmatch(str(x["name"])) or x["name"] in names:
            raise RecipeError(f"{where}: run name {x['name']!r} is repeated or holds characters other than letters, "
                              "digits and _ . + -")
        names.add(x["name"])
        if not isinstance(x.get("overrides") or [], list):
            raise RecipeError(f"{where}: run {x['name']}: overrides must be a list")
    rows = r["rows"]
    if not isinstance(rows, list) or not all(isinstance(x, dict) for x in rows):
        raise RecipeError(f"{where}: rows must be a list of {{run, paper, eval, label, source}}")
    for x in rows:
        if set(x) - {"run", "paper", "eval", "label", "source"} or x.get("run") not in names:
            raise RecipeError(f"{where}: row {x} must name one of the runs ({', '.join(sorted(names))}) and may have "
                              "only paper, eval, label, source")
        if x.get("paper") is not None and not isinstance(x["paper"], (int, float)):
            raise RecipeError(f"{where}: row {x['run']}: paper must be a number or null, got {x['paper']!r}")
        if "eval" in x and not re.fullmatch(r"[A-Za-z0-9_.]+=[^,\s]+", str(x["eval"])):
            raise RecipeError(f"{where}: row {x['run']}: eval must be FIELD=VALUE, got {x['eval']!r}")
    r["path"] = path
    if check_configs:
        check_runs(r)
    return r


def check_runs(recipe: dict, extra: list[str] = ()) -> None:
    from pretrain.config import load_config

    evals = eval_plan(recipe)
    for run in recipe["runs"]:
        over = run_overrides(recipe, run, extra)
        for value in [None, *(f"{f}={v}" for f, vs in evals.get(run["name"], {}).items() for v in vs)]:
            try:
                load_config(run["config"], over + ([value] if value else []), check_data=False, log=lambda *_: None)
            except ValueError as e:
                with_eval = f" evaluated at {value}" if value else ""
                raise RecipeError(f"recipe {recipe['path']}: run {run['name']}{with_eval}: {e}") from None


def run_overrides(recipe: dict, run: dict, extra=()) -> list[str]:
    return [*map(str, recipe.get("overrides") or []), *map(str, run.get("overrides") or []), *extra]


def eval_plan(recipe: dict) -> dict[str, dict[str, list[str]]]:
    """{run: {field: [values in row order]}} of the evaluation rows."""
    out: dict = {}
    for row in recipe["rows"]:
        if "eval" in row:
            field, value = str(row["eval"]).split("=", 1)
            values = out.setdefault(row["run"], {}).setdefault(field, [])
            if value not in values:
                values.append(value)
    return out


def sweep_of(recipe: dict, root: str, extra=()) -> tuple[dict, list[dict]]:
    """The recipe as a sweep (slurm/sweep.py's explicit points, each with its config) and its points."""
    from slurm.sweep import check_sweep, expand

    spec = {"name": recipe["name"], "root": root,
            "points": [{"name": r["name"], "config": r["config"], "overrides": run_overrides(recipe, r, extra)}
                       for r in recipe["runs"]]}
    return spec, expand(check_sweep(spec, f"recipe {recipe['path']}"))


# ---------------------------------------------------------------------------------------------- plan

def plan_lines(recipe: dict, gpus: int, gpu: str, extra=()) -> list[str]:
    """Per run: tokens, the planner's fastest layout that fits on `gpus` GPUs, hours and GPU-hours, when the
    runs go one after another on the whole cluster."""
    from parallel.plan import HARDWARE
    from pretrain.config import load_config
    from pretrain.plan import candidates

    hw = HARDWARE[gpu]
    lines = [f"{recipe['paper']}: {recipe['table']} ({len(recipe['runs'])} runs, each on all {gpus} x {hw.name}, "
             "one after another; the planner's predictions)",
             f"{'run':<28} {'config':<34} {'tokens':>9} {'layout':>24} {'tok/s/GPU':>10} {'hours':>7} {'GPU-h':>8}"]
    total_h = total_tokens = 0.0
    for run in recipe["runs"]:
        cfg = load_config(run["config"], run_overrides(recipe, run, extra), check_data=False, log=lambda *_: None)
        tokens = cfg.tokens_per_step * cfg.train.max_steps
        found, refused = candidates(cfg, gpus, hw, hw.memory_gib)
        best = next((c for c in found if c.fits), None)
        if best is None:
            why = next(iter(refused), "no layout fits in memory")
            lines.append(f"{run['name']:<28} {run['config']:<34} {tokens / 1e9:>8.2f}B  no layout fits on {gpus} GPUs: {why}")
            continue
        hours = cfg.train.max_steps * best.step.total_s / 3600
        total_h += hours
        total_tokens += tokens
        layout = f"tp{best.tp} pp{best.pp} dp{best.dp} {best.engine}"
        lines.append(f"{run['name']:<28} {run['config']:<34} {tokens / 1e9:>8.2f}B {layout:>24} "
                     f"{best.tokens_per_s_per_gpu:>10,.0f} {hours:>7.2f} {hours * gpus:>8,.1f}")
    lines.append(f"total: {total_tokens / 1e9:,.2f}B tokens, {total_h:,.1f} hours on {gpus} GPUs, "
                 f"{total_h * gpus:,.0f} GPU-hours")
    return lines


# ---------------------------------------------------------------------------------------------- running

def run_local(recipe: dict, root: str, extra=(), log=print) -> int:
    """Every run, one after another in a subprocess (`pretrain train`, which resumes a run that has
    a checkpoint; a complete run is skipped), then the evaluation step. Returns the number of failures."""
    from slurm.sweep import write_points

    spec, points = sweep_of(recipe, root, extra)
    check_runs(recipe, extra)
    write_points(spec, points)  # the index lists the runs that have not started as pending
    failed = []
    for i, p in enumerate(points, 1):
        if _complete(p["run_dir"], max_steps_of(p)):
            log(f"[{i}/{len(points)}] {p['name']}: complete, skipped")
            continue
        log(f"[{i}/{len(points)}] {p['name']}: pretrain train {p['config']} ... ({p['run_dir']})")
        rc = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", p["config"], *p["overrides"]]).returncode
        if rc:
            failed.append(p["name"])
            log(f"[{i}/{len(points)}] {p['name']}: failed with exit code {rc}; going on with the others")
    failed += evaluate_runs(recipe, root, log, extra)
    if failed:
        log(f"{len(failed)} of {len(points)} runs failed: {', '.join(failed)}")
    return len(failed)


def max_steps_of(point: dict) -> int:
    from pretrain.config import load_config

    return load_config(point["config"], point["overrides"], check_data=False, log=lambda *_: None).train.max_steps


def _complete(run_dir: str, max_steps: int) -> bool:
    """Whether the run directory holds a run trained to max_steps (the recipe's; a run trained to another
    length, by a quick check say, is not complete: `pretrain train` resumes it)."""
    from pretrain.experiments.index import read_config, read_metrics_tolerant

    try:
        config = read_config(os.path.join(run_dir, "config.yaml"))
        records = read_metrics_tolerant(os.path.join(run_dir, "metrics.jsonl"), last_only=True)
    except (ValueError, OSError):
        return False
    return config["train"].get("max_steps") == max_steps and bool(records) and records[-1]["step"] >= max_steps


def evaluate_runs(recipe: dict, root: str, log=print, extra=()) -> list[str]:
    """The evaluation step: each complete run with evaluation rows evaluated at every value of each field
    (`pretrain eval RUN --sweep FIELD=... --json`), stored in RUN/evals/FIELD.json; a run not complete yet
    is left for a later call. Returns the runs whose evaluation failed."""
    from data_tools.files import atomic_write

    failed = []
    points = {p["name"]: p for p in sweep_of(recipe, root, extra)[1]}
    for run, fields in eval_plan(recipe).items():
        run_dir = points[run]["run_dir"]
        if not _complete(run_dir, max_steps_of(points[run])):
            log(f"{run}: not complete; its evaluation waits")
            continue
        for field, values in fields.items():
            log(f"{run}: pretrain eval --sweep {field}={','.join(values)}")
            res = subprocess.run([sys.executable, "-m", "pretrain.cli", "eval", run_dir, "--sweep",
                                  f"{field}={','.join(values)}", "--json"], capture_output=True, text=True)
            if res.returncode:
                failed.append(run)
                log(f"{run}: evaluation failed: {(res.stderr.strip().splitlines() or ['(no output)'])[-1]}")
                continue
            os.makedirs(os.path.join(run_dir, "evals"), exist_ok=True)
            atomic_write(os.path.join(run_dir, "evals", f"{field}.json"),
                         json.dumps({"field": field, "rows": json.loads(res.stdout)}, indent=1))
    return failed


def submit(recipe: dict, root: str, profile_path: str, extra=(), dry_run: bool = False, log=print) -> None:
    """The runs as one Slurm array (slurm/sweep.py's points, each from its own config), and when the table
    has evaluation rows a job after it (afterany) that runs the evaluation step."""
    import shlex

    from slurm.profile import load_profile
    from slurm.render import render_command
    from slurm.submit import _sbatch, _write, submit_sweep

    profile = load_profile(profile_path)
    spec, points = sweep_of(recipe, root, extra)
    check_runs(recipe, extra)
    job = submit_sweep(spec, points, profile, recipe["name"], dry_run)
    if not eval_plan(recipe):
        return
    folder = os.path.dirname(points[0]["run_dir"])
    command = shlex.join([profile.python, "-m", "pretrain.cli", "repro", os.path.abspath(recipe["path"]), "--eval",
                         "--root", os.path.abspath(root), *extra])
    text = render_command(profile, f"{recipe['name']}-eval", os.path.join(folder, "slurm", "%x-%j.out"), command)
    if dry_run:
        print("# --- then, after the array (afterany): the evaluation step\n" + text, end="")
        return
    # afterany: a point that gave up must not leave the evaluation of the others pending forever
    eval_job = _sbatch(_write(os.path.join(folder, "eval.sbatch"), text), f"--dependency=afterany:{job}")
    log(f"submitted evaluation job {eval_job} (after array {job} ends): pretrain eval --sweep for the evaluation rows")
