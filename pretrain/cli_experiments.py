"""The experiment verbs of `pretrain`: runs (the run database), compare and repro (pretrain/experiments/)."""
from __future__ import annotations

import os
import sys

_RUNS_HELP = """\
Indexes every run directory under ROOT (a directory with a config.yaml, any depth; a sweep's points not
started yet as pending) into ROOT/runs.sqlite, incrementally (only runs whose files changed are read
again), then prints the runs that match. Nothing inside a run directory is written, and no lock taken.

status: running (fresh lock heartbeat), complete (reached train.max_steps), failed / preempted /
crash-looping (from a Slurm job's history), incomplete, pending. Columns: the config's fields (dotted,
e.g. optim.lr) and path name arch status steps max_steps tokens flops params_total params_embedding
params_non_embedding flops_per_token val_loss_last val_loss_best tokens_per_s mfu git slurm_jobs
restart_limit exit_code sweep (--columns all lists every one).

examples:
  pretrain runs runs/
  pretrain runs runs/ --where model.arch=cart --where 'val_loss_best<3.5' --columns path,model.n_loops,val_loss_best
  pretrain runs runs/ --where optim.lr=3e-3 --format csv > lr.csv     # typed: 0.003 matches a run trained with 3e-3
  pretrain runs runs/ --where status=running --format json
"""

_COMPARE_HELP = """\
Groups the indexed runs under ROOT (indexed first, incrementally) by config fields and prints each group's
final figure (mean, standard deviation, lowest and highest over its runs: several seeds of one setting),
then plots every group's curve (its mean, with the band between its runs) to --output.

examples:
  pretrain compare runs/sweeps/cart-stage1 --by model.n_loops
  pretrain compare runs/ --by model.arch,model.d_model --where train.max_steps=3000 --x flops --output cmp.svg
  pretrain compare runs/ --by train.seed --metric loss --x tokens
"""

_REPRO_HELP = """\
A paper's table as a recipe: its runs, the paper's figure per row and the metric (shipped under
configs/<arch>/papers/; `--list` names them). One of:
  --plan      the runs, their tokens and the GPU-hours the planner predicts on --gpus GPUs of kind --gpu
  --local     train the runs here one after another (a complete run is skipped, a started one resumes),
              then the evaluation step
  --submit    one Slurm job array through the sweep machinery (resumable, requeue-safe; each point from its
              own config) and, for evaluation rows, an evaluation job after it ends (--profile P.yaml)
  --eval      the evaluation step alone (what --local runs last and --submit queues after the array)
  --report ROOT   the paper's table beside ours, from the run database of ROOT: markdown, and a plot
Overrides after RECIPE apply to every run (e.g. train.max_steps=20 for a quick check).

examples:
  pretrain repro --list
  pretrain repro rt/papers/table1-300m --plan --gpus 64 --gpu h100
  pretrain repro rt/papers/table1-300m --submit --profile slurm/profiles/example.yaml --root runs/repro
  pretrain repro sps/papers/cpu-standard-vs-sps --local --root runs/repro
  pretrain repro sps/papers/cpu-standard-vs-sps --report runs/repro --output sps.png
"""


def add_verbs(verbs, verb) -> None:
    r = verb(verbs, "runs", "index the run directories under ROOT into an SQLite run database and list or query "
             "them", _RUNS_HELP)
    r.add_argument("root", metavar="ROOT", help="the folder holding the run directories (any depth)")
    _db_and_where(r)
    r.add_argument("--columns", default="", help="comma-separated columns (default: path,arch,status,steps,tokens,"
                   "val_loss_last,val_loss_best,tokens_per_s,mfu; 'all' for every one)")
    r.add_argument("--format", choices=("table", "csv", "json"), default="table",
                   help="table (default), csv, or json (a list of one object per run)")
    r.add_argument("--no-index", action="store_true", help="query the database as it is, without indexing first")

    c = verb(verbs, "compare", "group indexed runs by config fields: final figures (mean and spread over seeds) and "
             "their curves in one plot", _COMPARE_HELP)
    c.add_argument("root", metavar="ROOT", help="the folder holding the run directories")
    c.add_argument("--by", required=True, help="comma-separated config fields to group by, e.g. model.n_loops")
    c.add_argument("--metric", default="val_loss", help="val_loss (default), another evaluation figure (val_ppl, "
                   "val_acc_L0, ...), or loss (the training loss)")
    c.add_argument("--x", choices=("step", "tokens", "flops"), default="step", help="the curves' x axis (default step)")
    c.add_argument("--output", default="compare.png", help="the plot: .png, .pdf or .svg (default compare.png)")
    _db_and_where(c)

    p = verb(verbs, "repro", "a paper's table as a recipe: plan it, run it (here or as a Slurm array), report it "
             "beside the paper's figures", _REPRO_HELP)
    p.add_argument("recipe", nargs="?", default="", metavar="RECIPE", help="a recipe YAML or a shipped recipe's "
                   "short name (e.g. sps/papers/cpu-standard-vs-sps)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. train.max_steps=20")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="runs, tokens and predicted GPU-hours")
    mode.add_argument("--local", action="store_true", help="train the runs here, one after another")
    mode.add_argument("--submit", action="store_true", help="submit the runs as one Slurm array (--profile)")
    mode.add_argument("--eval", action="store_true", help="run the evaluation step of the complete runs")
    mode.add_argument("--report", metavar="ROOT", default="", help="the paper's table beside ours from ROOT's runs")
    mode.add_argument("--list", action="store_true", help="list the shipped recipes")
    p.add_argument("--root", default="runs/repro", help="where --local/--submit/--eval put the runs: ROOT/NAME/RUN "
                   "(default runs/repro)")
    p.add_argument("--gpus", type=int, default=8, help="--plan: the cluster's total GPUs, >= 1 (default 8)")
    p.add_argument("--gpu", choices=("a100", "h100", "h200"), default="h100", help="--plan: the GPU (default h100)")
    p.add_argument("--profile", default="", help="--submit: the cluster profile YAML (see slurm/profiles/example.yaml)")
    p.add_argument("--dry-run", action="store_true", help="--submit: print the scripts, submit nothing")
    p.add_argument("--output", default="", help="--report: the plot (.png/.pdf/.svg; default ROOT/NAME/report.png)")
    p.add_argument("--db", default="", help="--report: the run database (default ROOT/runs.sqlite)")


def _db_and_where(p) -> None:
    p.add_argument("--where", action="append", default=[], metavar="COND",
                   help="FIELD OP VALUE, OP one of = != < <= > >= ~ (contains); repeat to AND them")
    p.add_argument("--db", default="", help="the database file (default ROOT/runs.sqlite)")


def _indexed(root: str, db: str, index: bool = True) -> list[dict]:
    from pretrain.experiments.index import DB_NAME, index_root, load_runs

    if index:
        s = index_root(root, db, log=lambda line: print(line, file=sys.stderr))
        print(f"indexed {s.runs} runs under {os.path.abspath(root)} into {s.db} in {s.seconds:.2f} s ({s.read} read, "
              f"{s.runs - s.read - s.pending} unchanged, {s.pending} pending, {len(s.skipped)} skipped)", file=sys.stderr)
        return load_runs(s.db)
    return load_runs(db or os.path.join(root, DB_NAME))


def runs(args) -> int:
    from pretrain.experiments.query import columns_of, render, select

    found = _indexed(args.root, args.db, not args.no_index)
    chosen = select(found, args.where)
    print(render(chosen, columns_of(args.columns, found), args.format))
    if args.format == "table":
        print(f"{len(chosen)} of {len(found)} runs", file=sys.stderr)
    return 0


def compare(args) -> int:
    from pretrain.experiments import compare as cmp
    from pretrain.experiments.query import check_fields, select

    cmp.check_output(args.output)
    by = [b.strip() for b in args.by.split(",") if b.strip()]
    found = _indexed(args.root, args.db)
    check_fields(by, found, "--by")
    chosen = [r for r in select(found, args.where) if r["status"] != "pending"]
    if not chosen:
        raise ValueError(f"no run under {args.root} matches {' and '.join(args.where) or 'anything'} (pending points left out)")
    grouped = cmp.groups(chosen, by)
    rows = cmp.summary_rows(grouped, by, args.metric, args.x)
    if not any(r["with_metric"] for r in rows):
        raise ValueError(f"no run has a {args.metric!r} curve (val_loss, val_ppl and loss are the usual ones)")
    print(cmp.table(rows, by, args.metric, args.x))
    cmp.plot(grouped, by, args.metric, args.x, args.output)
    print(f"wrote {args.output}")
    return 0


def repro(args) -> int:
    from pretrain.experiments import recipes

    if args.list:
        print("\n".join(recipes.shipped_recipes()))
        return 0
    if not args.recipe:
        raise ValueError("pretrain repro needs a RECIPE (a YAML file or a shipped recipe's name; --list names them)")
    if not (args.plan or args.local or args.submit or args.eval or args.report):
        raise ValueError("pretrain repro needs one of --plan, --local, --submit, --eval or --report ROOT")
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    recipe = recipes.load_recipe(args.recipe)
    if args.plan:
        print("\n".join(recipes.plan_lines(recipe, args.gpus, args.gpu, args.overrides)))
    elif args.local:
        return 1 if recipes.run_local(recipe, args.root, args.overrides) else 0
    elif args.submit:
        if not args.profile:
            raise ValueError("--submit needs --profile P.yaml (the cluster profile; see slurm/profiles/example.yaml)")
        recipes.submit(recipe, args.root, args.profile, args.overrides, args.dry_run)
    elif args.eval:
        return 1 if recipes.evaluate_runs(recipe, args.root, extra=args.overrides) else 0
    else:
        return _report(recipe, args)
    return 0


def _report(recipe: dict, args) -> int:
    from pretrain.experiments import report
    from pretrain.experiments.compare import check_output

    output = args.output or os.path.join(args.report, recipe["name"], "report.png")
    if args.output:
        check_output(output)
    from pretrain.experiments.recipes import max_steps_of, sweep_of

    expected = {p["name"]: max_steps_of(p) for p in sweep_of(recipe, args.report, args.overrides)[1]}
    rows = report.report_rows(recipe, _indexed(args.report, args.db), args.report, expected)
    print(report.markdown(recipe, rows))
    if not args.output:
        os.makedirs(os.path.dirname(output), exist_ok=True)
    report.plot(recipe, rows, output)
    print(f"\nwrote {output}")
    return 0


HANDLERS = {"runs": runs, "compare": compare, "repro": repro}
