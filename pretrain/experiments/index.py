"""The run database: every run directory under ROOT indexed into one SQLite file.

    summary = index_root("runs/")              # writes runs/runs.sqlite (or db=PATH)
    runs = load_runs("runs/runs.sqlite")       # [{"path", "status", "val_loss_best", "model.arch", ...}]

A run directory is a directory holding a `config.yaml` (any depth below ROOT; its own subfolders are not
searched). A sweep's folder (a `points.json`) adds its points that have not started as `pending` runs.

What is stored per run: the resolved config flattened (`optim.lr`, `model.arch`, ...), the parameter
counts and FLOPs per token computed from the config through the registry (cached per model config),
steps, tokens and FLOPs seen, the last and best validation loss and the last evaluation's other figures,
throughput and MFU (the median of the last SPEED_WINDOW logged steps, never the first, which holds
compilation), the
status, the git revision and Slurm job ids the Slurm job recorded, evaluation sweeps stored by
`pretrain repro` (RUN/evals/*.json), and the curves (every evaluation; the training loss thinned to at
most CURVE_POINTS points) for `pretrain compare`.

Status, first that applies: `running` (the run's lock heartbeat, RUN/.lock's mtime, is younger than its
checkpoint.lock_timeout_s), `complete` (the last logged step reached train.max_steps), then from the
Slurm history when the run has one (RUN/slurm/history.jsonl): `crash-looping` (more starts in a row
without a new checkpoint than the job's restart limit, which is stored), `preempted` (its last end was
stopped by the warning signal or exited 75) or `failed` (a non-zero exit, stored in exit_code); else
`incomplete`. `pending`: a sweep's point with no run directory yet.

Incremental: each run's files are keyed on (inode, size, mtime); a run whose keys are unchanged is not
read again (only its status is refreshed from the lock's heartbeat). metrics.jsonl is rewritten on resume
and moved aside on a fresh start, both a new inode, so either is noticed.

Writing: the indexer builds the whole database in a temporary file beside the target and renames it into
place: readers and a second indexer always see one complete file (two indexers at once both finish; the
last rename wins, and both files are complete), nothing relies on file locks (which network filesystems
often do not honour), and the journal is SQLite's rollback journal (WAL does not work over NFS). Nothing
is written inside a run directory, and no run's lock is taken.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import statistics
import time
from dataclasses import dataclass, field

SCHEMA = 1  # PRAGMA user_version of the files this code writes
APPLICATION_ID = 0x70724442  # PRAGMA application_id ("prDB"): a run database, not some other SQLite file
DB_NAME = "runs.sqlite"
CURVE_POINTS = 256
SPEED_WINDOW = 50  # throughput and MFU: the median of the last this many logged steps
_RUN_FILES = ("config.yaml", "metrics.jsonl", os.path.join("slurm", "history.jsonl"), ".lock")
# the stored columns besides the config's fields, in the order `pretrain runs --columns all` lists them
COLUMNS = ("path", "name", "arch", "status", "steps", "max_steps", "tokens", "flops", "params_total",
           "params_embedding", "params_non_embedding", "flops_per_token", "val_loss_last", "val_loss_best",
           "tokens_per_s", "mfu", "git", "slurm_jobs", "restart_limit", "exit_code", "sweep")


class RunDBError(ValueError):
    """A root, a database file or a run that cannot be indexed, in one sentence."""


@dataclass
class Summary:
    db: str
    runs: int = 0
    read: int = 0  # run directories (re)read this time
    pending: int = 0
    skipped: list[str] = field(default_factory=list)  # one line per run directory left out
    seconds: float = 0.0
    rebuilt: str = ""  # why the database was rebuilt from scratch, if it was


# ---------------------------------------------------------------------------------------------- finding runs

def find_runs(root: str) -> tuple[list[str], list[str]]:
    """(run directories, sweep points.json files) under root, sorted."""
    runs, sweeps = [], []
    for here, dirs, files in os.walk(root):
        if "config.yaml" in files and here != root:
            runs.append(here)
            dirs[:] = []  # a run's own folders (checkpoints, tokenizer, slurm) hold no runs
            continue
        if "points.json" in files:
            sweeps.append(os.path.join(here, "points.json"))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(runs), sorted(sweeps)


def _key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def file_keys(run_dir: str) -> dict:
    """{file: [inode, size, mtime_ns]} of what the index reads from a run (the lock apart: its heartbeat
    changes every few seconds and is read for the status alone)."""
    keys = {f: _key(os.path.join(run_dir, f)) for f in _RUN_FILES[:3]}
    evals = os.path.join(run_dir, "evals")
    if os.path.isdir(evals):
        keys.update({f"evals/{f}": _key(os.path.join(evals, f)) for f in sorted(os.listdir(evals)) if f.endswith(".json")})
    return keys


# ---------------------------------------------------------------------------------------------- reading a run

def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def metrics_lines(path: str) -> list[tuple[int, bytes]]:
    """(line number, line) of metrics.jsonl's records, checked cheaply (one JSON object per line, the last
    one parsed); a torn last line (a live run's write under way) is left out, a torn line before it is an
    error naming it."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    out = []
    for n in range(last + 1):
        line = lines[n].strip()
        if not line:
            continue
        if line[:1] != b"{" or line[-1:] != b"}":
            if n == last:
                break
            raise RunDBError(f"metrics.jsonl line {n + 1} is not a JSON record")
        out.append((n + 1, line))
    if out:  # a torn last line can still end in a brace: parsed, and dropped if it is not JSON
        try:
            json.loads(out[-1][1])
        except ValueError:
            out.pop()
    return out


def _record(number: int, line: bytes) -> dict:
    try:
        r = json.loads(line)
    except ValueError:
        raise RunDBError(f"metrics.jsonl line {number} is not a JSON record") from None
    if not isinstance(r, dict) or not isinstance(r.get("step"), int):
        raise RunDBError(f"metrics.jsonl line {number} is not a record with a step")
    return r


def read_metrics_tolerant(path: str, last_only: bool = False) -> list[dict]:
    """metrics.jsonl's records (or its last one), a torn last line left out (see metrics_lines)."""
    lines = metrics_lines(path)
    return [_record(n, line) for n, line in (lines[-1:] if last_only else lines)]


def summarize_metrics(path: str) -> dict:
    """The metrics-derived columns and curves of one run. Only the lines kept are parsed: the evaluations,
    every k-th step for the training curve (at most CURVE_POINTS), and the last SPEED_WINDOW steps for
    the throughput (a 10,000-step file is read in milliseconds)."""
    lines = metrics_lines(path) if path else []
    n = len(lines)
    every = max(1, math.ceil(n / CURVE_POINTS))
    recent = range(max(1, n - SPEED_WINDOW), n)  # not the first logged step: it holds compilation
    kept = {i: _record(*lines[i]) for i in range(n)
            if i % every == 0 or i == n - 1 or i in recent or b'"val_loss"' in lines[i][1]}
    evals = [r for r in kept.values() if "val_loss" in r]
    last = kept[n - 1] if n else {}
    speed = [kept[i] for i in recent if kept[i].get("tokens_per_s")] or [r for r in kept.values() if "loss" in r][-1:]
    evals_kept = [{k: v for k, v in r.items() if k in ("step", "tokens") or (k.startswith("val_") and isinstance(v, (int, float)))}
                  for r in evals]
    return {
        "steps": int(last.get("step", 0)),
        "tokens": int(last.get("tokens", 0) or 0),
        "val_loss_last": evals[-1]["val_loss"] if evals else None,
        "val_loss_best": min(finite) if (finite := [float(r["val_loss"]) for r in evals
                                                   if math.isfinite(float(r["val_loss"]))]) else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in speed) if speed and "tokens_per_s" in speed[0] else None,
        "mfu": statistics.median(r.get("mfu", 0.0) for r in speed) if speed and "mfu" in speed[0] else None,
        "last_eval": evals_kept[-1] if evals_kept else {},
        "curve_val": evals_kept,
        "curve_train": [[r["step"], r.get("tokens", 0), r["loss"]] for i, r in kept.items()
                        if (i % every == 0 or i == n - 1) and "loss" in r],
    }


def slurm_state(run_dir: str) -> dict:
    """Job ids, git revision, restart limit and the history's verdict (failed, preempted, crash-looping)."""
    from pretrain.preemption import EXIT_REQUEUE
    from slurm.job import fruitless_ends

    path = os.path.join(run_dir, "slurm", "history.jsonl")
    if not os.path.exists(path):
        return dict(_NO_SLURM)
    history = read_history_tolerant(path)
    starts = [r for r in history if r.get("event") == "start"]
    ends = [r for r in history if r.get("event") == "end"]
    jobs = list(dict.fromkeys(str(r.get("job", "")) for r in starts if r.get("job")))
    limit = next((r["max_restarts"] for r in reversed(starts) if isinstance(r.get("max_restarts"), int)), None)
    state, code = "", None
    if ends:
        end = ends[-1]
        code = end.get("rc")
        if fruitless_ends(history) > (3 if limit is None else limit):  # 3: slurm.job's default
            state = "crash-looping"
        elif end.get("stopped") or code == EXIT_REQUEUE:
            state = "preempted"
        elif code:
            state = "failed"
    return {"slurm_jobs": ",".join(jobs), "git": starts[-1].get("git", "") if starts else "", "restart_limit": limit,
            "history_state": state, "exit_code": code}


def read_history_tolerant(path: str) -> list[dict]:
    """slurm/history.jsonl's records, a torn last line left out (a job may be writing it)."""
    with open(path) as f:
        lines = f.read().splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line)) if line.strip() else None
        except ValueError:
            if n < len(lines):
                raise RunDBError(f"slurm/history.jsonl line {n} is not a JSON record") from None
    return out


def model_figures(config: dict, cache: dict) -> dict:
    """Parameter counts and FLOPs per token of a config (a dict as config.yaml holds it), through the
    registry; cached on the model section and the sequence length, which alone decide them."""
    key = hashlib.sha1(json.dumps([config.get("model"), (config.get("data") or {}).get("seq_len")],
                                  sort_keys=True, default=str).encode()).hexdigest()
    if key not in cache:
        from pretrain.config import config_from_dict
        from pretrain.models import count_parameters, get_arch, meta_model

        cfg = config_from_dict(config)
        counts = count_parameters(meta_model(cfg.model))
        cache[key] = {"params_total": counts["total"], "params_embedding": counts["embedding"],
                      "params_non_embedding": counts["non_embedding"],
                      "flops_per_token": get_arch(cfg.model.arch).flops_per_token(cfg.model, cfg.data.seq_len, None)}
    return cache[key]


def read_config(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise RunDBError(f"config.yaml cannot be read ({e})") from None
    except yaml.YAMLError:
        raise RunDBError("config.yaml is not valid YAML (torn or half-written?)") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) or "arch" not in config["model"]:
        raise RunDBError("config.yaml is not a run's resolved config (no model.arch)")
    return config


def read_run(run_dir: str, cache: dict) -> dict:
    """One run directory's row (status aside); RunDBError when its files cannot be read."""
    config = read_config(os.path.join(run_dir, "config.yaml"))
    try:
        figures = model_figures(config, cache)
    except ValueError as e:
        raise RunDBError(f"config.yaml does not load: {e}") from None
    m = summarize_metrics(os.path.join(run_dir, "metrics.jsonl"))
    train = config.get("train") or {}
    if not isinstance(train.get("max_steps"), int) or isinstance(train.get("max_steps"), bool):
        raise RunDBError(f"config.yaml's train.max_steps is not an integer: {train.get('max_steps')!r}")
    timeout = (config.get("checkpoint") or {}).get("lock_timeout_s", 120.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise RunDBError(f"config.yaml's checkpoint.lock_timeout_s is not a number: {timeout!r}")
    row = {"name": train.get("name", ""), "arch": config["model"]["arch"], "max_steps": train.get("max_steps"),
           "lock_timeout_s": timeout,
           "config": flatten(config), **figures, **m, **slurm_state(run_dir), "evals": read_evals(run_dir)}
    row["flops"] = row["tokens"] * figures["flops_per_token"]
    return row


def read_evals(run_dir: str) -> dict:
    """{field: [{field: value, val_loss, ...}, ...]} from RUN/evals/<field>.json (pretrain repro's
    evaluation step)."""
    out, folder = {}, os.path.join(run_dir, "evals")
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    d = json.load(f)
                out[d["field"]] = d["rows"]
            except (OSError, ValueError, KeyError, TypeError):
                raise RunDBError(f"evals/{name} is not an evaluation sweep's JSON (torn?)") from None
    return out


def status_of(row: dict, run_dir: str, now: float) -> str:
    lock = _key(os.path.join(run_dir, ".lock"))
    if lock is not None and now - lock[2] / 1e9 < float(row.get("lock_timeout_s") or 120.0):
        return "running"
    if row.get("max_steps") and row["steps"] >= row["max_steps"]:
        return "complete"
    return row.get("history_state") or "incomplete"


def read_points(points_file: str, log) -> dict | None:
    """A sweep's points.json ({"name", "config", "points": [{...}, ...]}), or None when it is torn or not one
    (said in a line)."""
    try:
        with open(points_file) as f:
            sweep = json.load(f)
        points = sweep["points"]
        if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        log(f"skipped {points_file}: not a sweep's points.json (torn?)")
        return None
    return sweep


def pending_points(points_file: str, sweep: dict, cache: dict, log, known: dict | None = None) -> list[tuple[str, dict]]:
    """(run_dir, row) of a sweep's points (read_points) whose run directory has no config.yaml yet. `known`:
    rows of an earlier index by run_dir, reused (without loading the config again) when points.json is
    unchanged."""
    key, known = {"points.json": _key(points_file)}, known or {}
    out = []
    for p in sweep["points"]:
        run_dir = p.get("run_dir", "")
        if not isinstance(run_dir, str) or not run_dir or os.path.isfile(os.path.join(run_dir, "config.yaml")):
            continue
        if (known.get(os.path.abspath(run_dir)) or {}).get("files") == key:
            out.append((run_dir, known[os.path.abspath(run_dir)]))
            continue
        from pretrain.config import load_config  # torch comes with it: only when a point must be read

        try:
            cfg = load_config(p.get("config") or sweep["config"], p["overrides"], check_data=False, log=lambda *_: None)
        except (ValueError, KeyError) as e:
            log(f"skipped pending point {p.get('name')} of {points_file}: {e}")
            continue
        config = cfg.to_dict()
        figures = model_figures(config, cache)
        out.append((run_dir, {"name": p.get("name", ""), "arch": cfg.model.arch, "max_steps": cfg.train.max_steps,
                              "config": flatten(config), **figures, **summarize_metrics(""), "flops": 0,
                              "status": "pending", "evals": {}, "files": key, **_NO_SLURM}))
    return out


_NO_SLURM = {"slurm_jobs": "", "git": "", "restart_limit": None, "history_state": "", "exit_code": None}


# ---------------------------------------------------------------------------------------------- the database

_JSON = ("config", "last_eval", "evals", "curve_train", "curve_val", "files")
_SQL = """
CREATE TABLE runs (path TEXT PRIMARY KEY, name TEXT, arch TEXT, status TEXT, steps INTEGER, max_steps INTEGER,
  tokens INTEGER, flops REAL, params_total INTEGER, params_embedding INTEGER, params_non_embedding INTEGER,
  flops_per_token REAL, val_loss_last REAL, val_loss_best REAL, tokens_per_s REAL, mfu REAL, git TEXT,
  slurm_jobs TEXT, restart_limit INTEGER, exit_code INTEGER, sweep TEXT, history_state TEXT, lock_timeout_s REAL,
  config TEXT, last_eval TEXT, evals TEXT, curve_train TEXT, curve_val TEXT, files TEXT);
CREATE TABLE model_figures (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE info (key TEXT PRIMARY KEY, value TEXT);
"""
_FIELDS = ("path", "name", "arch", "status", "steps", "max_steps", "tokens", "flops", "params_total", "params_embedding",
           "params_non_embedding", "flops_per_token", "val_loss_last", "val_loss_best", "tokens_per_s", "mfu", "git",
           "slurm_jobs", "restart_limit", "exit_code", "sweep", "history_state", "lock_timeout_s", *_JSON[:-1], "files")


def open_db(path: str) -> sqlite3.Connection | None:
    """An existing database of this schema or an older one (None: no file); a newer schema, or a file that
    is not SQLite, is refused in one sentence (and left as it is)."""
    if not os.path.exists(path):
        return None
    from urllib.parse import quote

    try:
        con = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=60)
        version = con.execute("PRAGMA user_version").fetchone()[0]
        app = con.execute("PRAGMA application_id").fetchone()[0]
        tables = con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as e:
        raise RunDBError(f"{path} is not a run database ({e}); move it aside or give another --db") from None
    if app != APPLICATION_ID and tables:  # another program's SQLite file: never ours to rebuild
        con.close()
        raise RunDBError(f"{path} is an SQLite file of another program, not a run database; give another --db")
    if version > SCHEMA:
        con.close()
        raise RunDBError(f"{path} was written by a newer version of pretrain (schema {version}; this one reads up to "
                         f"{SCHEMA}): upgrade, or index into another file with --db PATH")
    return con


def load_rows(con: sqlite3.Connection) -> dict[str, dict]:
    con.row_factory = sqlite3.Row
    out = {}
    for r in con.execute("SELECT * FROM runs"):
        row = dict(r)
        for k in _JSON:
            row[k] = json.loads(row[k]) if row[k] else ({} if k != "curve_train" and k != "curve_val" else [])
        out[row["path"]] = row
    return out


def index_root(root: str, db: str = "", log=print, now: float | None = None) -> Summary:
    """Index every run under root into db (default ROOT/runs.sqlite); see the module's docstring."""
    t0 = time.perf_counter()
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise RunDBError(f"{root} is not a directory")
    if os.path.isfile(os.path.join(root, "config.yaml")):
        raise RunDBError(f"{root} is itself a run directory; give the folder that holds the runs (e.g. "
                         f"{os.path.dirname(root)})")
    db = os.path.abspath(db or os.path.join(root, DB_NAME))
    summary = Summary(db)
    runs, sweeps = find_runs(root)
    old, cache = {}, {}
    con = open_db(db)
    if con is not None:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA:
            old = load_rows(con)
            cache = {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM model_figures")}
        else:  # an older layout: the index is derived from the run directories alone, so it is rebuilt
            summary.rebuilt = f"{db} had schema {version}; rebuilt from the run directories (schema {SCHEMA})"
            log(summary.rebuilt)
        con.close()
    now = time.time() if now is None else now
    sweep_of = {}
    pending = []
    known = {os.path.join(root, rel): row for rel, row in old.items() if row["status"] == "pending"}
    for points_file in sweeps:
        sweep = read_points(points_file, log)
        if sweep is None:
            continue
        name = str(sweep.get("name", ""))
        for run_dir, row in pending_points(points_file, sweep, cache, log, known):
            pending.append((run_dir, {**row, "sweep": name}))
        for p in sweep["points"]:
            if isinstance(p.get("run_dir"), str):
                sweep_of[os.path.abspath(p["run_dir"])] = name
    if not runs and not pending:
        raise RunDBError(f"{root} holds no runs: no directory below it has a config.yaml, and no sweep's points.json "
                         "lists a pending point")
    rows = {}
    for run_dir in runs:
        rel = os.path.relpath(run_dir, root)
        keys = file_keys(run_dir)
        row = old.get(rel)
        if row is None or row["files"] != keys or row["status"] == "pending":
            try:
                row = {**read_run(run_dir, cache), "files": keys}
            except (RunDBError, ValueError, TypeError, KeyError, AttributeError) as e:  # one run, never the index
                why = e if isinstance(e, ValueError) else f"a file holds a value of an unexpected type ({type(e).__name__}: {e})"
                summary.skipped.append(f"skipped {run_dir}: {why}")
                log(summary.skipped[-1])
                continue
            summary.read += 1
        row.update(path=rel, sweep=sweep_of.get(run_dir, ""))
        row["status"] = status_of(row, run_dir, now)
        rows[rel] = row
    for run_dir, row in pending:
        rel = os.path.relpath(run_dir, root)
        if rel not in rows:
            rows[rel] = {**row, "path": rel}
            summary.pending += 1
    _write(db, rows, cache, root)
    summary.runs = len(rows)
    summary.seconds = time.perf_counter() - t0
    return summary


def _write(db: str, rows: dict, cache: dict, root: str) -> None:
    """The whole database into a temporary file beside db, then renamed over it (see the docstring)."""
    import secrets

    tmp = f"{db}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.makedirs(os.path.dirname(db), exist_ok=True)
        con = sqlite3.connect(tmp)
        con.execute("PRAGMA journal_mode=DELETE")
        con.executescript(_SQL)
        con.execute(f"PRAGMA user_version={SCHEMA}")
        con.execute(f"PRAGMA application_id={APPLICATION_ID}")
        con.executemany(f"INSERT INTO runs ({', '.join(_FIELDS)}) VALUES ({', '.join('?' * len(_FIELDS))})",
                        [tuple(json.dumps(r.get(k)) if k in _JSON else r.get(k) for k in _FIELDS) for r in rows.values()])
        con.executemany("INSERT INTO model_figures VALUES (?, ?)", [(k, json.dumps(v)) for k, v in cache.items()])
        con.executemany("INSERT INTO info VALUES (?, ?)", [("root", root), ("indexed_at", str(time.time()))])
        con.commit()
        con.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, db)
    except (OSError, sqlite3.Error) as e:  # a read-only ROOT, a full disk: the old database is left as it was
        raise RunDBError(f"cannot write the run database {db} ({e}); index into a writable place with --db PATH") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_runs(db: str) -> list[dict]:
    """Every indexed run as one flat record: the config's fields (`model.arch`, ...), the columns, and
    `dir` (the run directory's absolute path), in path order."""
    con = open_db(db)
    if con is None:
        raise RunDBError(f"{db} does not exist: index the runs first (pretrain runs ROOT)")
    if con.execute("PRAGMA user_version").fetchone()[0] != SCHEMA:
        raise RunDBError(f"{db} has an older schema: index again (pretrain runs ROOT) to rebuild it")
    root = dict(con.execute("SELECT key, value FROM info").fetchall()).get("root", "")
    rows = load_rows(con)
    con.close()
    out = []
    for path in sorted(rows):
        row = rows[path]
        out.append({**row.pop("config"), **row, "dir": os.path.join(root, path)})
    return out
