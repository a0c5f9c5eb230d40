"""`pretrain compare ROOT --by FIELD[,FIELD]`: indexed runs grouped by config fields, each group's final
figure (mean, spread over its runs: several seeds of one setting) and its curves in one plot.

The metric is a curve the index keeps: `val_loss` (default) or another evaluation figure (`val_ppl`,
`val_acc_L0`, ...) at every evaluation, or `loss` (the training loss, thinned to the index's curve
points). A run's final figure is its last point. In the plot each group is its mean curve over the x
values all its runs share, with the band between its runs' lowest and highest; a group whose runs share
no x value is drawn run by run.
"""
from __future__ import annotations

import json
import math
import os
import statistics


def curve(run: dict, metric: str, x: str) -> list[tuple[float, float]]:
    """[(x, metric)] of one indexed run; x in step, tokens, flops."""
    fpt = run.get("flops_per_token") or 0.0
    if metric == "loss":
        points = [(step, tokens, loss) for step, tokens, loss in run.get("curve_train") or []]
    else:
        points = [(r["step"], r.get("tokens", 0), r[metric]) for r in run.get("curve_val") or [] if metric in r]
    pick = {"step": lambda s, t: s, "tokens": lambda s, t: t, "flops": lambda s, t: t * fpt}[x]
    return [(float(pick(s, t)), float(v)) for s, t, v in points if v is not None and math.isfinite(v)]


def group_key(run: dict, by: list[str]) -> tuple:
    """The run's values of the `by` fields; a list or mapping (data.train) as its JSON text."""
    return tuple(json.dumps(v) if isinstance(v, (list, dict)) else v for v in (run.get(f) for f in by))


def groups(runs: list[dict], by: list[str]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault(group_key(r, by), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: tuple((v is None, str(type(v)), v if v is not None else 0)
                                                           for v in kv[0])))


def summary_rows(grouped: dict, by: list[str], metric: str, x: str) -> list[dict]:
    rows = []
    for key, runs in grouped.items():
        finals = [c[-1] for c in (curve(r, metric, x) for r in runs) if c]
        values = [v for _, v in finals]
        at = sorted({x_ for x_, _ in finals})
        rows.append({**dict(zip(by, key)), "runs": len(runs), "with_metric": len(values),
                     "mean": statistics.fmean(values) if values else None,
                     "std": statistics.stdev(values) if len(values) > 1 else None,
                     "min": min(values) if values else None, "max": max(values) if values else None,
                     f"final_{x}": (f"{at[0]:,.4g}" if len(at) == 1 else f"{at[0]:,.4g}-{at[-1]:,.4g} (differs)")
                     if at else None,
                     "status": ",".join(sorted({r["status"] for r in runs}))})
    return rows


def table(rows: list[dict], by: list[str], metric: str, x: str) -> str:
    head = [*by, "runs", f"{metric} mean", "± std", "min", "max", f"at {x}", "status"]
    body = []
    for r in rows:
        def f(v, fmt="{:.4f}"):
            return "-" if v is None else fmt.format(v)
        body.append([*(str(r[b]) for b in by), f"{r['with_metric']}/{r['runs']}", f(r["mean"]), f(r["std"]), f(r["min"]),
                     f(r["max"]), r[f"final_{x}"] or "-", r["status"]])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= len(by) and i < len(head) - 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in [head, *body])


def pyplot(what: str):
    """matplotlib.pyplot on the file-only Agg backend, or one sentence saying that `what` needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"{what} needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(grouped: dict, by: list[str], metric: str, x: str, output: str) -> None:
    plt = pyplot("pretrain compare's plot")
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, runs in grouped.items():
        label = ", ".join(f"{f.split('.')[-1]}={v}" for f, v in zip(by, key))
        curves = [dict(c) for c in (curve(r, metric, x) for r in runs) if c]
        if not curves:
            continue
        shared = sorted(set.intersection(*(set(c) for c in curves)))
        if not shared:
            for i, c in enumerate(curves):
                xs = sorted(c)
                ax.plot(xs, [c[v] for v in xs], label=label if i == 0 else None)
            continue
        mean = [statistics.fmean(c[v] for c in curves) for v in shared]
        line, = ax.plot(shared, mean, "o-" if metric != "loss" else "-", markersize=3,
                        label=f"{label} (n={len(curves)})" if len(curves) > 1 else label)
        if len(curves) > 1:
            ax.fill_between(shared, [min(c[v] for c in curves) for v in shared],
                            [max(c[v] for c in curves) for v in shared], color=line.get_color(), alpha=0.2)
    ax.set_xlabel({"step": "step", "tokens": "tokens seen", "flops": "training FLOPs"}[x])
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(output, dpi=120, bbox_inches="tight")
    plt.close(fig)


def check_output(output: str) -> None:
    if os.path.splitext(output)[1].lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--output {output}: give a .png, .pdf or .svg file name")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {output}: the folder {folder} does not exist")
