"""Runs that can move (pretrain/runs.py): a run trained with relative paths is evaluated, sampled,
plotted and resumed from another directory, then again after its project folder is moved; missing
data is one sentence naming the path and the field; `eval`/`generate` take the overrides that keep
the trained weights and refuse the rest."""
import json
import os
import re
import shutil

import pytest

from pretrain.cli import main
from pretrain.metrics import read_metrics
from trainer_helpers import tiny_overrides, write_markov_corpus, write_word_tokenizer


def make_project(root):
    os.makedirs(root / "data")
    write_markov_corpus(root / "data" / "markov")
    write_word_tokenizer(root / "data" / "tok.json")
    return root


def train(monkeypatch, cwd, source, *extra):
    """`pretrain train` from `cwd` (in process: the same code path as the console script)."""
    monkeypatch.chdir(cwd)
    assert main(["train", source, *extra]) == 0


def cli(monkeypatch, capsys, cwd, *argv):
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


RELATIVE = tiny_overrides(".", "data/markov", **{
    "train.run_dir": "runs/r", "data.tokenizer": "data/tok.json", "data.cache_dir": "''", "train.max_steps": 4,
    "checkpoint.every": 2, "train.eval_every": 0, "schedule.warmup_steps": 1})


def test_a_run_works_from_anywhere_and_after_moving(tmp_path, monkeypatch, capsys):
    proj = make_project(tmp_path / "proj")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)
    stored = (proj / "runs" / "r" / "config.yaml").read_text()
    assert f"- {proj}/data/markov" in stored and f"tokenizer: {proj}/data/tok.json" in stored

    run = str(proj / "runs" / "r")
    rc, out, err = cli(monkeypatch, capsys, elsewhere, "eval", run, "--json")
    assert rc == 0, err
    first = json.loads(out)
    assert first["val_tokens"] > 0
    rc, out, err = cli(monkeypatch, capsys, elsewhere, "generate", run, "--prompt", "t5 t9", "--max-tokens", "5",
                       "--temperature", "0")
    assert rc == 0 and out.startswith("t5 t9") and len(out.split()) > 2, err
    rc, out, err = cli(monkeypatch, capsys, elsewhere, "plot", run, "--output", "loss.png")
    assert rc == 0 and (elsewhere / "loss.png").is_file(), err
    train(monkeypatch, elsewhere, run, "train.max_steps=6")  # resume the run directory itself
    assert max(r["step"] for r in read_metrics(run)) == 6 and not (elsewhere / "runs").exists()

    moved = tmp_path / "moved" / "project"
    os.makedirs(moved.parent)
    shutil.move(str(proj), str(moved))
    run = str(moved / "runs" / "r")
    rc, out, err = cli(monkeypatch, capsys, elsewhere, "eval", run, "--json")
    assert rc == 0, err
    assert f"data.train: {proj}/data/markov is now found at {moved}/data/markov" in out
    assert json.loads(out.splitlines()[-1])["val_tokens"] == first["val_tokens"]
    rc, out, err = cli(monkeypatch, capsys, elsewhere, "generate", run, "--prompt", "t5", "--max-tokens", "3")
    assert rc == 0, err
    train(monkeypatch, elsewhere, run, "train.max_steps=8")
    steps = [r["step"] for r in read_metrics(run)]
    assert steps[-2:] == [7, 8] and "step_00000008" in os.listdir(moved / "runs" / "r" / "checkpoints")
    assert not proj.exists()  # nothing was written at the old place


def test_missing_data_names_the_path_and_the_field_to_override(tmp_path, monkeypatch, capsys):
    proj = make_project(tmp_path / "proj")
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)
    lone = tmp_path / "lone"  # the run directory moved without its data
    shutil.move(str(proj / "runs" / "r"), str(lone))
    shutil.move(str(proj / "data"), str(tmp_path / "data-elsewhere"))
    rc, out, err = cli(monkeypatch, capsys, tmp_path, "eval", str(lone))
    assert rc == 2 and err.count("\n") == 1
    assert (f"data.train: dataset '{proj}/data/markov' not found (expected {proj}/data/markov.bin and "
            f"{proj}/data/markov.idx); give its location with the override data.train=[PREFIX]") in err
    data = tmp_path / "data-elsewhere" / "markov"
    rc, out, err = cli(monkeypatch, capsys, tmp_path, "eval", str(lone), f"data.train=[{data}]", "--json")
    assert rc == 0 and json.loads(out)["val_tokens"] > 0, err
    # generation needs no dataset, and the tokenizer falls back to the run's own copy
    rc, out, err = cli(monkeypatch, capsys, tmp_path, "generate", str(lone), "--prompt", "t7", "--max-tokens", "3")
    assert rc == 0 and out.startswith("t7"), err
    rc, out, err = cli(monkeypatch, capsys, tmp_path, "generate", str(lone), "data.tokenizer=nowhere/tok.json")
    assert rc == 2 and "data.tokenizer 'nowhere/tok.json' does not exist; give its location" in err


def test_runs_from_before_absolute_paths_still_resolve(tmp_path, monkeypatch, capsys):
    """Older runs stored the paths as given (relative to where training started)."""
    proj = make_project(tmp_path / "proj")
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)
    ckpt = proj / "runs" / "r" / "checkpoints" / "step_00000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["data"].update(train=["data/markov"], tokenizer="data/tok.json", cache_dir="")
    meta["config"]["train"]["run_dir"] = "runs/r"
    (ckpt / "meta.json").write_text(json.dumps(meta))
    moved = tmp_path / "moved"
    shutil.move(str(proj), str(moved))
    rc, out, err = cli(monkeypatch, capsys, tmp_path, "eval", str(moved / "runs" / "r"), "--json")
    assert rc == 0, err
    assert f"data.train: data/markov is now found at {moved}/data/markov" in out


@pytest.mark.parametrize("override, message", [
    ("model.d_model=64", r"model.d_model=64 would change the trained weights' shapes \(.*\); it cannot be "
                         "overridden after training"),
    ("model.n_layers=3", "model.n_layers=3 would change the trained weights' shapes"),
    ("model.arch=other", "model.arch cannot be overridden after training"),
    ("optim.lr=1", r"optim.lr cannot be overridden after training \(allowed: data.\*, model fields that keep"),
    ("parallel.tp=2", "parallel.tp cannot be overridden after training"),
    ("train.max_steps=9", "train.max_steps cannot be overridden after training"),
])
def test_eval_refuses_overrides_that_do_not_apply_after_training(tmp_path, monkeypatch, capsys, override, message):
    proj = make_project(tmp_path / "proj")
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)
    for verb in ("eval", "generate"):
        rc, out, err = cli(monkeypatch, capsys, proj, verb, "runs/r", override)
        assert rc == 2 and err.count("\n") == 1 and re.search(message, err), err


def test_eval_takes_overrides_that_keep_the_weights(tmp_path, monkeypatch, capsys):
    proj = make_project(tmp_path / "proj")
    train(monkeypatch, proj, "baseline/tiny", *RELATIVE)
    rc, out, err = cli(monkeypatch, capsys, proj, "eval", "runs/r", "train.eval_batches=1", "--json")
    assert rc == 0, err
    one = json.loads(out)
    rc, out, err = cli(monkeypatch, capsys, proj, "eval", "runs/r", "train.eval_batches=2", "model.rope_theta=500",
                       "checkpoint.verify=false", "--json")
    assert rc == 0, err
    two = json.loads(out)
    assert two["val_tokens"] > one["val_tokens"] and two["val_loss"] != one["val_loss"]
