"""Paper tables as recipes (pretrain/experiments/recipes.py, report.py; `pretrain repro`): every shipped
recipe loads, bad recipes are refused in one sentence, the plan and the Slurm submission render, and a
CPU-scale recipe runs end to end at a tiny scale: run here, index, report."""
import json

import pytest

from pretrain.cli import main
from pretrain.experiments.recipes import RecipeError, load_recipe, shipped_recipes
from trainer_helpers import VOCAB, write_markov_corpus

ARCHS = ("sps", "crt", "gpn", "rt", "cart")


def test_every_paper_has_a_table_and_a_cpu_recipe_and_each_loads():
    names = shipped_recipes()
    recipes = {name: load_recipe(name) for name in names}  # every run's config, overrides and evaluation values load
    for arch in ARCHS:
        mine = [n for n in names if n.startswith(f"{arch}/papers/")]
        assert any("/cpu-" in n for n in mine), (arch, mine)
        # a table of the paper with the paper's figures (a table of downstream scores only has none to compare)
        assert any("/cpu-" not in n and any(row.get("paper") is not None for row in recipes[n]["rows"])
                   for n in mine), (arch, mine)
    for r in recipes.values():
        assert r["source"] and r["rows"] and r["metric"].startswith("val_")


def _recipe(tmp_path, **changes):
    r = {"paper": "P", "table": "Table 1", "source": "spec §1", "metric": "val_loss", "name": "t",
         "runs": [{"name": "a", "config": "baseline/tiny"}, {"name": "b", "config": "crt/tiny"}],
         "rows": [{"run": "a", "paper": 3.0}, {"run": "b", "eval": "model.eval_k=2", "paper": 2.9}]}
    r.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(r))
    return str(path)


@pytest.mark.parametrize("changes, message", [
    ({"runs": [{"name": "a", "config": "baseline/nope"}, {"name": "b", "config": "crt/tiny"}]},
     r"run a: config 'baseline/nope' is neither"),
    ({"runs": [{"name": "a", "config": "baseline/tiny", "overrides": ["model.n_loops=3"]},
               {"name": "b", "config": "crt/tiny"}]}, r"run a: .*n_loops"),
    ({"rows": [{"run": "c", "paper": 1.0}]}, r"must name one of the runs \(a, b\)"),
    ({"rows": [{"run": "b", "eval": "model.eval_kk=2"}]}, r"run b evaluated at model.eval_kk=2: .*eval_kk"),
    ({"rows": [{"run": "a", "paper": "3.1 nats"}]}, r"paper must be a number or null"),
    ({"rows": [{"run": "a", "eval": "k"}]}, r"eval must be FIELD=VALUE"),
    ({"tabel": "x"}, r"unknown field 'tabel'"),
    ({"name": "a/b"}, r"name 'a/b' may hold only"),
    ({"overrides": "train.seed=1"}, r"overrides must be a list"),
    ({"metric": "vall_loss"}, r"metric must be a validation figure"),
])
def test_a_bad_recipe_is_refused_in_one_sentence(tmp_path, capsys, changes, message):
    import re

    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, **changes))
    assert main(["repro", _recipe(tmp_path, **changes), "--plan"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1


def test_plan_lists_runs_tokens_and_gpu_hours(tmp_path, capsys):
    assert main(["repro", _recipe(tmp_path), "--plan", "--gpus", "8", "--gpu", "a100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "8 x A100" in out[0] and [line.split()[0] for line in out[2:4]] == ["a", "b"]
    assert out[-1].startswith("total: ") and "GPU-hours" in out[-1]
    assert main(["repro", _recipe(tmp_path), "--gpus", "0", "--plan"]) == 2
    assert main(["repro", _recipe(tmp_path)]) == 2 and "needs one of --plan" in capsys.readouterr().err


def test_submit_renders_one_array_from_per_point_configs_and_an_evaluation_job(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    profile.write_text(json.dumps({"partition": "gpu", "nodes": 1, "gpus_per_node": 8, "cpus_per_task": 8,
                                   "time": "01:00:00", "setup": ["module load cuda"]}))
    root = tmp_path / "repro"
    assert main(["repro", _recipe(tmp_path), "--submit", "--profile", str(profile), "--root", str(root), "--dry-run",
                 "train.max_steps=7", "schedule.warmup_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "# point 0: a: baseline/tiny train.max_steps=7 schedule" in out and "# point 1: b: crt/tiny train.max_steps=7" in out
    assert "#SBATCH --array=0-1" in out and f"SWEEP_POINTS={root}/t/points.json" in out
    eval_job = out.split("evaluation step\n", 1)[1]
    assert "repro" in eval_job and "--eval --root" in eval_job and "train.max_steps=7" in eval_job
    assert "module load cuda" in eval_job and not root.exists()  # a dry run writes nothing
    import subprocess

    for script in (out.split("# --- then", 1)[0].split("#!/bin/bash", 1)[1], eval_job):
        check = subprocess.run(["bash", "-n"], input="#!/bin/bash" + script.split("#!/bin/bash", 1)[-1],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert main(["repro", _recipe(tmp_path), "--submit"]) == 2 and "needs --profile" in capsys.readouterr().err


def test_a_cpu_recipe_runs_here_then_indexes_and_reports(tmp_path, capsys):
    """crt/papers/cpu-k-sweep at a tiny scale: three runs, the evaluation step over model.eval_k, the index,
    the report with every row filled; a second --local skips the complete runs."""
    corpus = write_markov_corpus(tmp_path / "markov")
    root = tmp_path / "repro"
    tiny = [f"data.train=[{corpus}]", "data.valid=[]", "data.tokenizer=''", "data.split=90,10",
            f"data.cache_dir={tmp_path / 'cache'}", f"model.vocab_size={VOCAB}", "model.d_model=32",
            "model.max_seq_len=32", "data.seq_len=32", "train.max_steps=3", "train.global_batch_seqs=4",
            "train.micro_batch_seqs=4", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=3",
            "schedule.warmup_steps=1", "train.threads=1"]
    assert main(["repro", "crt/papers/cpu-k-sweep", "--local", "--root", str(root), *tiny]) == 0
    out = capsys.readouterr().out
    assert out.count(": pretrain train crt/tiny") == 3 and out.count("pretrain eval --sweep model.eval_k=") == 2
    evals = json.loads((root / "crt-cpu" / "crt-k2to5" / "evals" / "model.eval_k.json").read_text())
    assert [r["model.eval_k"] for r in evals["rows"]] == ["1", "2", "3", "5", "10", "-1"]

    png = tmp_path / "report.png"
    assert main(["repro", "crt/papers/cpu-k-sweep", "--report", str(root), "--output", str(png), *tiny]) == 0
    report = capsys.readouterr().out
    table = [line for line in report.splitlines() if line.startswith("| CRT") or line.startswith("| roformer")]
    assert len(table) == 13 and all(line.rstrip().endswith("| complete |") for line in table), report
    assert all(float(line.split("|")[3]) > 1.0 for line in table)  # ours: a perplexity on every row
    assert "13 of 13 rows complete." in report and png.stat().st_size > 1000

    assert main(["repro", "crt/papers/cpu-k-sweep", "--local", "--root", str(root), *tiny]) == 0
    assert capsys.readouterr().out.count("complete, skipped") == 3
    assert main(["runs", str(root), "--where", "sweep=crt-cpu", "--columns", "path,status", "--format", "json"]) == 0
    assert {r["status"] for r in json.loads(capsys.readouterr().out)} == {"complete"}


def test_report_names_missing_and_unfinished_rows(tmp_path, capsys):
    from test_run_index import make_run

    recipe = _recipe(tmp_path, runs=[{"name": "a", "config": "baseline/tiny"}, {"name": "b", "config": "baseline/tiny"},
                                     {"name": "c", "config": "baseline/tiny"}],
                     rows=[{"run": "a", "paper": 4.0}, {"run": "b", "paper": 3.0}, {"run": "c", "paper": 3.0}])
    root = tmp_path / "runs"
    make_run(root, "t/a")  # complete; its last val_loss is 4.6
    make_run(root, "t/b", logged=5)  # incomplete
    assert main(["repro", recipe, "--report", str(root), "--output", str(tmp_path / "r.svg")]) == 0
    out = capsys.readouterr().out  # the runs were trained to 10 steps, the recipe's config asks more
    assert "| a | 4.0000 | 4.6000 | +0.6000 | complete (train.max_steps 10, the recipe's 250) |" in out, out
    assert main(["repro", recipe, "--report", str(root), "--output", str(tmp_path / "r.svg"), "train.max_steps=10",
                 "schedule.warmup_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "| a | 4.0000 | 4.6000 | +0.6000 | complete |" in out
    assert "| b | 3.0000 | 5.1000 | +2.1000 | incomplete |" in out and "| c | 3.0000 |  |  | missing |" in out
    assert "1 of 3 rows complete; missing: c; not finished: b." in out
