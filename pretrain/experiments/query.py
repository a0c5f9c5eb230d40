"""Filters and printers over the indexed runs (pretrain/experiments/index.py's load_runs records).

    --where model.arch=cart --where 'val_loss_best<3.5' --where 'train.name~lr'
    --columns model.n_loops,val_loss_best        --format table|csv|json

A --where compares typed values: the value is read as YAML (3e-3, 0.003 and 3.0e-3 are one number; true,
null and strings as written), numbers compare as numbers (equal within 1e-9 relative), the rest as text;
`~` is "contains". A field no run has is an error naming it (with the closest names).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re

from pretrain.experiments.index import COLUMNS

DEFAULT_COLUMNS = ("path", "arch", "status", "steps", "tokens", "val_loss_last", "val_loss_best", "tokens_per_s", "mfu")
_OPS = ("!=", "<=", ">=", "=", "<", ">", "~")
_WHERE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(!=|<=|>=|=|<|>|~)\s*(.*?)\s*$")


def parse_where(text: str) -> tuple[str, str, object]:
    m = _WHERE.match(text)
    if not m:
        raise ValueError(f"--where {text!r}: write FIELD OP VALUE with OP one of {' '.join(_OPS)}, e.g. "
                         "model.arch=cart or 'val_loss_best<3.5'")
    field, op, raw = m.groups()
    return field, op, raw


def _typed(raw: str):
    import yaml

    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw
    return value if isinstance(value, (int, float, str, bool)) or value is None else raw


def _number(v) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def matches(value, op: str, raw: str) -> bool:
    """`value` (a run's) against the --where text `raw`: typed as YAML, except that ~ and text compare the
    text as written (YAML 1.1 reads on/yes/no as booleans), and a boolean equals only a boolean."""
    if op == "~":
        return raw in str(value)
    want = _typed(raw)
    if isinstance(value, bool) or isinstance(want, bool):
        if not (isinstance(value, bool) and isinstance(want, bool)):
            want = raw  # compared as text: seed 1 is not true, a name "on" is not True
    a, b = _number(value), _number(want)
    if a is not None and b is not None and not isinstance(want, bool) and not isinstance(value, bool):
        if op in ("=", "!="):
            same = math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
            return same if op == "=" else not same
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
    if op in ("=", "!="):
        same = value == want or (value is not None and str(value).lower() == raw.lower())
        return same if op == "=" else not same
    if value is None or want is None:
        return False
    return {"<": str(value) < str(want), "<=": str(value) <= str(want), ">": str(value) > str(want),
            ">=": str(value) >= str(want)}[op]


def known_fields(runs: list[dict]) -> list[str]:
    names = dict.fromkeys(COLUMNS)
    for r in runs:
        names.update(dict.fromkeys(k for k in r if "." in k))
    return list(names)


def check_fields(fields: list[str], runs: list[dict], what: str) -> None:
    import difflib

    known = set(known_fields(runs)) | {"dir"}
    for f in fields:
        if f not in known:
            close = difflib.get_close_matches(f, sorted(known), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{what} {f!r}: no indexed run has this field{hint}")


def select(runs: list[dict], wheres: list[str]) -> list[dict]:
    conditions = [parse_where(w) for w in wheres]
    check_fields([c[0] for c in conditions], runs, "--where")
    return [r for r in runs if all(matches(r.get(f), op, v) for f, op, v in conditions)]


def columns_of(text: str, runs: list[dict]) -> list[str]:
    if not text:
        return list(DEFAULT_COLUMNS)
    if text == "all":
        return [c for c in COLUMNS] + sorted(k for k in known_fields(runs) if "." in k)
    cols = [c.strip() for c in text.split(",") if c.strip()]
    check_fields(cols, runs, "--columns")
    return cols


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e7 or abs(v) < 1e-3):
            return f"{v:.4g}"
        return f"{v:,.4f}".rstrip("0").rstrip(".") if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def render(runs: list[dict], columns: list[str], fmt: str) -> str:
    if fmt == "json":  # NaN and infinities as null: strict JSON readers refuse them
        return json.dumps([{c: _finite(r.get(c)) for c in columns} for r in runs], indent=1, allow_nan=False)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([["" if r.get(c) is None else r.get(c) for c in columns] for r in runs])
        return buf.getvalue().rstrip("\n")
    cells = [columns] + [[_cell(r.get(c)) for c in columns] for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    numeric = [all(_number(r.get(c)) is not None or r.get(c) is None for r in runs) and c != "path" for c in columns]
    lines = ["  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric)).rstrip()
             for row in cells]
    return "\n".join(lines)
