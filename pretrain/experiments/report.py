"""`pretrain repro RECIPE --report ROOT`: the paper's table beside ours, from the run database.

Each row: the paper's figure, ours (the recipe's metric: at the run's last evaluation, its best
validation loss, or the evaluation step's figure for an evaluation row), the difference (ours - paper)
and the row's state: missing (no run directory under ROOT/NAME), pending, running, incomplete (our figure
so far), failed / preempted / crash-looping (from the Slurm history), not evaluated (trained, the
evaluation step has not run), or complete. Markdown on stdout, and a plot of both columns.
"""
from __future__ import annotations

import os


def ours(row: dict, run: dict | None, metric: str, max_steps: int | None = None) -> tuple[float | None, str]:
    """(our figure or None, the row's state); a run trained to another length than the recipe's says so."""
    if run is None:
        return None, "missing"
    state = run["status"]
    if max_steps is not None and run.get("max_steps") != max_steps:
        state = f"{state} (train.max_steps {run.get('max_steps')}, the recipe's {max_steps})"
    if "eval" in row:
        field, value = str(row["eval"]).split("=", 1)
        for r in run.get("evals", {}).get(field, []):
            if str(r.get(field)) == value:
                return r.get(metric), state
        return None, "not evaluated" if state == "complete" else state
    if metric == "val_loss_best":
        return run.get("val_loss_best"), state
    return (run.get("last_eval") or {}).get(metric), state


def label_of(row: dict) -> str:
    return row.get("label") or (f"{row['run']} @ {row['eval']}" if "eval" in row else row["run"])


def report_rows(recipe: dict, runs: list[dict], root: str, max_steps: dict | None = None) -> list[dict]:
    """One dict per recipe row: label, paper, ours, diff, state, source. `max_steps`: {run: the recipe's
    train.max_steps} to check each run against."""
    by_path = {os.path.normpath(r["dir"]): r for r in runs}
    out = []
    for row in recipe["rows"]:
        run = by_path.get(os.path.normpath(os.path.join(os.path.abspath(root), recipe["name"], row["run"])))
        value, state = ours(row, run, recipe["metric"], (max_steps or {}).get(row["run"]))
        paper = row.get("paper")
        out.append({"label": label_of(row), "paper": paper, "ours": value, "state": state,
                    "diff": value - paper if value is not None and paper is not None else None,
                    "source": row.get("source") or recipe.get("source", "")})
    return out


def markdown(recipe: dict, rows: list[dict]) -> str:
    def f(v, sign=""):
        return "" if v is None else f"{v:{sign}.4f}"

    metric = recipe["metric"]
    lines = [f"## {recipe['paper']}: {recipe['table']}", "",
             f"Metric: `{metric}`; the paper's figures from {recipe.get('source') or 'the paper'}.", "",
             "| row | paper | ours | ours - paper | state |", "|---|---:|---:|---:|---|"]
    lines += [f"| {r['label']} | {f(r['paper'])} | {f(r['ours'])} | {f(r['diff'], '+')} | {r['state']} |" for r in rows]
    missing = [r["label"] for r in rows if r["state"] == "missing"]
    open_ = [r["label"] for r in rows if r["state"] not in ("missing", "complete")]
    done = sum(r["state"] == "complete" and r["ours"] is not None for r in rows)
    lines += ["", f"{done} of {len(rows)} rows complete" + (f"; missing: {', '.join(missing)}" if missing else "")
              + (f"; not finished: {', '.join(open_)}" if open_ else "") + "."]
    if recipe.get("note"):
        lines += ["", f"Note: {recipe['note'].strip()}"]
    return "\n".join(lines)


def plot(recipe: dict, rows: list[dict], output: str) -> None:
    from pretrain.experiments.compare import pyplot

    plt = pyplot("the report's plot")
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    for key, marker, name in (("paper", "s", "paper"), ("ours", "o", "ours")):
        pts = [(x, r[key]) for x, r in zip(xs, rows) if r[key] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=name, markersize=7, alpha=0.8)
    ax.set_xticks(list(xs), [r["label"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(recipe["metric"])
    import textwrap

    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_title(textwrap.fill(recipe["table"], 90), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(output, dpi=120, bbox_inches="tight")
    plt.close(fig)
