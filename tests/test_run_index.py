"""The run database (pretrain/experiments/index.py, query.py) and `pretrain runs` / `pretrain compare`:
columns and statuses, typed queries, incremental indexing, torn and half-written runs, bad roots and
database files, two indexers at once, and that nothing in a run directory changes."""
import json
import multiprocessing
import os
import sqlite3
import time

import pytest

from pretrain.cli import main
from pretrain.experiments.index import APPLICATION_ID, SCHEMA, RunDBError, index_root, load_runs
from pretrain.experiments.query import select


def make_run(root, rel, logged=10, max_steps=10, lr=1e-3, seed=0, d_model=None, eval_every=5):
    """A run directory as the trainer leaves it: its resolved config.yaml and metrics.jsonl."""
    from pretrain.config import load_config, to_yaml

    run_dir = os.path.join(str(root), rel)
    os.makedirs(run_dir, exist_ok=True)
    over = [f"optim.lr={lr}", f"train.max_steps={max_steps}", f"train.seed={seed}", f"train.run_dir={run_dir}",
            f"train.name={os.path.basename(rel)}", "schedule.warmup_steps=1"] + ([f"model.d_model={d_model}"] if d_model else [])
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(load_config("baseline/tiny", over, check_data=False, log=lambda *_: None)))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s in range(1, logged + 1):
            r = {"step": s, "loss": 6.0 - 0.1 * s - seed * 0.01, "tokens": s * 4096, "tokens_per_s": 1000.0 + s,
                 "mfu": 0.5}
            if s % eval_every == 0:
                r.update(val_loss=5.5 - 0.1 * s + lr * 100 + seed * 0.02, val_ppl=100.0)
            f.write(json.dumps(r) + "\n")
    return run_dir


def history(run_dir, *records):
    os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
    with open(os.path.join(run_dir, "slurm", "history.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def quiet(*_):
    pass


def by_path(db):
    return {r["path"]: r for r in load_runs(db)}


def test_columns_statuses_and_typed_queries(tmp_path):
    make_run(tmp_path, "a/done", lr=3e-3)
    make_run(tmp_path, "a/half", logged=6)
    live = make_run(tmp_path, "b/deep/live", logged=3)
    with open(os.path.join(live, ".lock"), "w") as f:
        f.write("{}")
    failed = make_run(tmp_path, "slurm/failed", logged=4)
    history(failed, {"event": "start", "job": "11", "start_step": 0, "git": "abc123", "max_restarts": 2},
            {"event": "end", "job": "11", "rc": 1, "stopped": False, "start_step": 0, "end_step": 4})
    pre = make_run(tmp_path, "slurm/preempted", logged=4)
    history(pre, {"event": "start", "job": "12", "start_step": 0, "git": "abc", "max_restarts": 3},
            {"event": "end", "job": "12", "rc": 75, "stopped": True, "start_step": 0, "end_step": 4})
    loop = make_run(tmp_path, "slurm/loop", logged=4)
    history(loop, *[r for j in range(3) for r in (
        {"event": "start", "job": f"2{j}", "start_step": 4, "git": "def", "max_restarts": 1},
        {"event": "end", "job": f"2{j}", "rc": 1, "stopped": False, "start_step": 4, "end_step": 4})])

    s = index_root(str(tmp_path), log=quiet)
    assert (s.runs, s.read, s.skipped) == (6, 6, [])
    runs = by_path(s.db)
    assert {p: r["status"] for p, r in runs.items()} == {
        "a/done": "complete", "a/half": "incomplete", "b/deep/live": "running", "slurm/failed": "failed",
        "slurm/preempted": "preempted", "slurm/loop": "crash-looping"}
    done = runs["a/done"]
    from pretrain.config import load_config
    from pretrain.models import count_parameters, get_arch, meta_model

    cfg = load_config("baseline/tiny", check_data=False, log=quiet)
    assert done["params_total"] == count_parameters(meta_model(cfg.model))["total"]
    fpt = get_arch("baseline").flops_per_token(cfg.model, cfg.data.seq_len, None)
    assert (done["steps"], done["tokens"], done["flops"]) == (10, 40960, 40960 * fpt)
    assert done["val_loss_last"] == pytest.approx(5.5 - 1.0 + 0.3) and done["val_loss_best"] == done["val_loss_last"]
    assert done["tokens_per_s"] == pytest.approx(1006.0)  # the median of the steps after the first
    assert done["model.arch"] == "baseline" and done["optim.lr"] == 3e-3
    assert (runs["slurm/failed"]["git"], runs["slurm/failed"]["slurm_jobs"], runs["slurm/failed"]["exit_code"],
            runs["slurm/failed"]["restart_limit"]) == ("abc123", "11", 1, 2)
    assert runs["slurm/loop"]["slurm_jobs"] == "20,21,22" and runs["slurm/loop"]["restart_limit"] == 1

    every = load_runs(s.db)
    assert [r["path"] for r in select(every, ["optim.lr=0.003"])] == ["a/done"]  # typed: 0.003 is 3e-3
    assert [r["path"] for r in select(every, ["optim.lr=3.0e-3", "model.arch=baseline"])] == ["a/done"]
    assert {r["path"] for r in select(every, ["steps<6"])} == {"b/deep/live", "slurm/failed", "slurm/preempted",
                                                             "slurm/loop"}
    assert [r["path"] for r in select(every, ["status~loop"])] == ["slurm/loop"]
    with pytest.raises(ValueError, match="optim.lrr.*did you mean optim.lr"):
        select(every, ["optim.lrr=1"])
    with pytest.raises(ValueError, match="FIELD OP VALUE"):
        select(every, ["optim.lr"])


def test_incremental_index_reads_only_what_changed(tmp_path):
    for i in range(3):
        make_run(tmp_path, f"r{i}", logged=5)
    assert index_root(str(tmp_path), log=quiet).read == 3
    again = index_root(str(tmp_path), log=quiet)
    assert (again.runs, again.read) == (3, 0)
    with open(tmp_path / "r1" / "metrics.jsonl", "a") as f:  # a live run appends
        f.write(json.dumps({"step": 6, "loss": 1.0, "tokens": 6 * 4096}) + "\n")
    s = index_root(str(tmp_path), log=quiet)
    assert s.read == 1 and by_path(s.db)["r1"]["steps"] == 6
    # a fresh start moves metrics.jsonl aside and writes a new one: a new inode, even at the same size
    os.replace(tmp_path / "r2" / "metrics.jsonl", tmp_path / "r2" / "metrics.jsonl.old")
    with open(tmp_path / "r2" / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "loss": 9.0, "tokens": 4096}) + "\n")
    s = index_root(str(tmp_path), log=quiet)
    assert s.read == 1 and by_path(s.db)["r2"]["steps"] == 1
    os.remove(tmp_path / "r0" / "config.yaml")  # a run that is gone leaves the index
    assert set(by_path(index_root(str(tmp_path), log=quiet).db)) == {"r1", "r2"}


def test_torn_and_half_written_runs(tmp_path):
    make_run(tmp_path, "ok")
    live = make_run(tmp_path, "torn-tail", logged=7)
    with open(os.path.join(live, "metrics.jsonl"), "a") as f:
        f.write('{"step": 8, "loss": 1.2')  # a write under way: skipped, not the run
    braced = make_run(tmp_path, "torn-tail-braced", logged=7)
    with open(os.path.join(braced, "metrics.jsonl"), "a") as f:
        f.write('{"step": 8, "time_split": {"data": 0.1}')  # torn just after an inner brace
    mid = make_run(tmp_path, "torn-middle", logged=7)
    with open(os.path.join(mid, "metrics.jsonl")) as f:
        lines = f.readlines()
    lines[2] = lines[2][:15] + "\n"
    with open(os.path.join(mid, "metrics.jsonl"), "w") as f:
        f.writelines(lines)
    half = make_run(tmp_path, "half-config")
    with open(os.path.join(half, "config.yaml"), "w") as f:
        f.write("model:\n  arch: [baseline\n")
    os.makedirs(tmp_path / "no-arch")
    with open(tmp_path / "no-arch" / "config.yaml", "w") as f:
        f.write("train:\n  max_steps: 3\n")
    lines_seen = []
    s = index_root(str(tmp_path), log=lines_seen.append)
    runs = by_path(s.db)
    assert set(runs) == {"ok", "torn-tail", "torn-tail-braced"}
    assert runs["torn-tail"]["steps"] == runs["torn-tail-braced"]["steps"] == 7
    assert len(s.skipped) == 3 and lines_seen == s.skipped and all(len(x.splitlines()) == 1 for x in s.skipped)
    assert any("torn-middle" in x and "line 3" in x for x in s.skipped)
    assert any("half-config" in x and "not valid YAML" in x for x in s.skipped)
    assert any("no-arch" in x and "model.arch" in x for x in s.skipped)


def test_values_of_unexpected_types_skip_the_run_not_the_index(tmp_path):
    """Whatever a run's files hold, the index goes on: one line per run it leaves out, every time."""
    make_run(tmp_path, "ok")
    bad_val = make_run(tmp_path, "val-null")
    with open(os.path.join(bad_val, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 11, "loss": 1.0, "val_loss": None}) + "\n")
    hist = make_run(tmp_path, "history-list")
    history(hist, ["not", "a", "record"], {"event": "end"})
    steps = make_run(tmp_path, "steps-text")
    text = open(os.path.join(steps, "config.yaml")).read().replace("max_steps: 10", "max_steps: ten")
    with open(os.path.join(steps, "config.yaml"), "w") as f:
        f.write(text)
    nan = make_run(tmp_path, "nan-eval")
    with open(os.path.join(nan, "metrics.jsonl"), "a") as f:
        f.write('{"step": 11, "loss": 1.0, "val_loss": NaN}\n')
    for _ in range(2):  # the second index has the model figures cached: the same checks still apply
        s = index_root(str(tmp_path), log=quiet)
        assert sorted(x.split(": ")[0].rsplit("/", 1)[1] for x in s.skipped) == ["history-list", "steps-text", "val-null"]
    runs = by_path(s.db)
    assert runs["nan-eval"]["val_loss_best"] == pytest.approx(4.6)  # the best finite one
    assert runs["nan-eval"]["val_loss_last"] is None  # SQLite keeps NaN as NULL


def test_odd_root_names_and_query_values(tmp_path, capsys):
    root = tmp_path / "odd #1 ?x %20"
    make_run(root, "one", seed=1)
    make_run(root, "mono", seed=0)
    assert index_root(str(root), log=quiet).read == 2
    assert index_root(str(root), log=quiet).read == 0  # the file is found again: incremental, not rebuilt
    runs = load_runs(str(root / "runs.sqlite"))
    assert [r["path"] for r in select(runs, ["train.name~on"])] == ["mono", "one"]  # "on", not YAML 1.1's True
    assert [r["path"] for r in select(runs, ["train.name=one"])] == ["one"]
    assert select(runs, ["train.seed=true"]) == [] and len(select(runs, ["train.seed=1"])) == 1
    assert len(select(runs, ["model.tie_embeddings=true"])) == 2
    assert main(["compare", str(root), "--by", "data.train", "--output", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith('["')  # the list, as its JSON text
    for r in runs:
        r["val_loss_last"] = float("nan")
    from pretrain.experiments.query import render

    assert json.loads(render(runs, ["path", "val_loss_last"], "json"))[0]["val_loss_last"] is None


def test_bad_roots_and_database_files(tmp_path):
    run = make_run(tmp_path / "root", "r")
    with pytest.raises(RunDBError, match="is itself a run directory"):
        index_root(run, log=quiet)
    os.makedirs(tmp_path / "empty" / "sub")
    with pytest.raises(RunDBError, match="holds no runs"):
        index_root(str(tmp_path / "empty"), log=quiet)
    root = str(tmp_path / "root")
    db = os.path.join(root, "runs.sqlite")
    with open(db, "w") as f:
        f.write("not a database, and not ours to overwrite")
    with pytest.raises(RunDBError, match="is not a run database"):
        index_root(root, log=quiet)
    assert open(db).read() == "not a database, and not ours to overwrite"
    os.remove(db)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE runs (path TEXT)")
    con.execute(f"PRAGMA user_version={SCHEMA + 1}")
    con.execute(f"PRAGMA application_id={APPLICATION_ID}")
    con.commit()
    con.close()
    before = open(db, "rb").read()
    with pytest.raises(RunDBError, match=f"newer version of pretrain \\(schema {SCHEMA + 1}"):
        index_root(root, log=quiet)
    assert open(db, "rb").read() == before
    os.remove(db)
    with pytest.raises(RunDBError, match="cannot write the run database .*--db PATH"):
        index_root(root, db=os.path.join(run, "config.yaml", "runs.sqlite"), log=quiet)  # a folder that cannot exist
    con = sqlite3.connect(db)  # another program's SQLite file: refused, never rebuilt
    con.execute("CREATE TABLE important (x TEXT)")
    con.commit()
    con.close()
    before = open(db, "rb").read()
    with pytest.raises(RunDBError, match="SQLite file of another program"):
        index_root(root, log=quiet)
    assert open(db, "rb").read() == before
    os.remove(db)
    con = sqlite3.connect(db)  # an older layout of ours (schema 0: a table of another shape) is rebuilt
    con.execute(f"PRAGMA application_id={APPLICATION_ID}")
    con.execute("CREATE TABLE runs (path TEXT, loss REAL)")
    con.execute("INSERT INTO runs VALUES ('x', 1.0)")
    con.commit()
    con.close()
    said = []
    s = index_root(root, log=said.append)
    assert s.rebuilt and said == [s.rebuilt] and list(by_path(db)) == ["r"]


def _index_repeatedly(root, n, out):
    try:
        for _ in range(n):
            index_root(root, log=quiet)
        out.put("ok")
    except Exception as e:  # noqa: BLE001  (reported to the test)
        out.put(repr(e))


def test_two_indexers_at_once_leave_one_consistent_file(tmp_path):
    for i in range(12):
        make_run(tmp_path, f"g{i % 3}/r{i}", logged=40)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_index_repeatedly, args=(str(tmp_path), 4, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert results == ["ok", "ok"]
    runs = by_path(str(tmp_path / "runs.sqlite"))
    assert len(runs) == 12 and all(r["steps"] == 40 for r in runs.values())
    assert sorted(os.listdir(tmp_path)) == ["g0", "g1", "g2", "runs.sqlite"]  # no temporary left behind


def _snapshot(root):
    out = {}
    for here, _, files in os.walk(root):
        for f in files:
            p = os.path.join(here, f)
            st = os.stat(p)
            out[p] = (st.st_mtime_ns, st.st_size, open(p, "rb").read())
    return out


def test_indexing_writes_nothing_inside_run_directories(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "a")
    lock = make_run(runs, "b")
    with open(os.path.join(lock, ".lock"), "w") as f:
        f.write('{"host": "h", "pid": 1}')
    before = _snapshot(runs)
    index_root(str(runs), db=str(tmp_path / "elsewhere.sqlite"), log=quiet)
    index_root(str(runs), db=str(tmp_path / "elsewhere.sqlite"), log=quiet)
    assert _snapshot(runs) == before
    assert sorted(os.listdir(runs)) == ["a", "b"]  # the database went where --db said


def test_pending_points_of_a_sweep(tmp_path, monkeypatch):
    from slurm.sweep import expand, write_points

    spec = {"name": "s", "config": "baseline/tiny", "root": str(tmp_path), "grid": {"optim.lr": [1e-3, 3e-3]},
            "points": [{"name": "wide", "overrides": ["model.d_model=512", "model.n_heads=8"]}]}
    points = expand(spec)
    write_points(spec, points)
    make_run(tmp_path, "s/" + points[0]["name"], lr=1e-3)
    s = index_root(str(tmp_path), log=quiet)
    runs = by_path(s.db)
    assert (s.runs, s.pending) == (3, 2)
    assert runs["s/" + points[0]["name"]]["status"] == "complete"
    assert runs["s/" + points[1]["name"]]["status"] == "pending" and runs["s/" + points[1]["name"]]["optim.lr"] == 3e-3
    wide = runs["s/wide"]
    assert wide["status"] == "pending" and wide["model.d_model"] == 512 and wide["sweep"] == "s"
    assert wide["params_total"] > runs["s/" + points[0]["name"]]["params_total"]
    import pretrain.config

    def no_loading(*_, **__):
        raise AssertionError("an unchanged points.json's pending points are not loaded again")

    monkeypatch.setattr(pretrain.config, "load_config", no_loading)
    again = index_root(str(tmp_path), log=quiet)
    assert (again.runs, again.pending, again.read) == (3, 2, 0) and by_path(again.db)["s/wide"]["model.d_model"] == 512


def test_cli_runs_prints_table_csv_and_json(tmp_path, capsys):
    make_run(tmp_path, "a", lr=1e-3)
    make_run(tmp_path, "b", lr=3e-3, logged=4)
    assert main(["runs", str(tmp_path), "--format", "json", "--where", "optim.lr=0.003",
                 "--columns", "path,optim.lr,status,steps"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"path": "b", "optim.lr": 0.003, "status": "incomplete", "steps": 4}]
    assert main(["runs", str(tmp_path), "--format", "csv", "--columns", "path,val_loss_best"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "path,val_loss_best"
    assert main(["runs", str(tmp_path), "--no-index"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["path", "arch", "status"] and len(out) == 3
    assert main(["runs", str(tmp_path / "a")]) == 2
    assert "is itself a run directory" in capsys.readouterr().err
    assert main(["runs", str(tmp_path), "--where", "nope=1"]) == 2
    assert capsys.readouterr().err.count("\n") == 2  # the index's summary line, then the one-line error


def test_compare_groups_seeds_into_mean_and_spread(tmp_path, capsys):
    for lr in (1e-3, 3e-3):
        for seed in (0, 1):
            make_run(tmp_path, f"lr{lr}-s{seed}", lr=lr, seed=seed)
    out = tmp_path / "cmp.svg"
    assert main(["compare", str(tmp_path), "--by", "optim.lr", "--x", "tokens", "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["optim.lr", "runs"] and len(lines) == 4 and out.stat().st_size > 1000
    first = lines[1].split()  # lr 1e-3: val loss at step 10 = 4.5 + 0.1 + 0.02 * seed -> mean 4.61, std 0.0141
    assert first[1] == "2/2" and float(first[2]) == pytest.approx(4.61) and float(first[3]) == pytest.approx(0.0141, abs=1e-4)
    assert main(["compare", str(tmp_path), "--by", "optim.lr", "--metric", "nope", "--output", str(out)]) == 2
    assert "no run has a 'nope' curve" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), "--by", "optim.lr", "--output", str(tmp_path / "x.txt")]) == 2


def test_a_running_runs_heartbeat_decides(tmp_path):
    run = make_run(tmp_path, "r", logged=3)
    with open(os.path.join(run, ".lock"), "w") as f:
        f.write("{}")
    old = time.time() - 600  # older than checkpoint.lock_timeout_s: a holder that died
    os.utime(os.path.join(run, ".lock"), (old, old))
    assert by_path(index_root(str(tmp_path), log=quiet).db)["r"]["status"] == "incomplete"
    os.utime(os.path.join(run, ".lock"))
    assert by_path(index_root(str(tmp_path), log=quiet).db)["r"]["status"] == "running"
