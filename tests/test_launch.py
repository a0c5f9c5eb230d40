"""The launcher's pieces without a cluster: rendering, profiles, sweeps and every bad input (a
script outside Slurm, a missing profile field, a port in use, an unwritable run directory, a
requeue loop) ending in one clear line."""
import json
import re
import os
import socket
import subprocess
import sys

import pytest

from slurm import job as slurm_job
from slurm.profile import ProfileError, load_profile, profile_from_dict
from slurm.sweep import expand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = {"partition": "gpu", "nodes": 2, "gpus_per_node": 8, "cpus_per_task": 32, "time": "04:00:00",
           "account": "proj", "qos": "high", "env": {"NCCL_DEBUG": "WARN"}, "setup": ["module load cuda"]}


def _py(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def _write_profile(tmp_path, data):
    path = tmp_path / "profile.yaml"
    path.write_text(json.dumps(data))
    return str(path)


def test_dry_run_renders_the_profile_and_bakes_in_the_arguments(tmp_path):
    res = _py("slurm.submit", "train", "baseline/tiny", "optim.lr=1e-3", f"train.run_dir={tmp_path}/run",
              "--profile", _write_profile(tmp_path, PROFILE), "--dry-run")
    assert res.returncode == 0, res.stderr
    script = res.stdout
    for line in ("#SBATCH --partition=gpu", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", "#SBATCH --time=04:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@180",
                 f"#SBATCH --output={tmp_path}/run/slurm/%x-%j.out", "NPROC=8", "module load cuda",
                 "export NCCL_DEBUG=WARN", "set -- baseline/tiny optim.lr=1e-3"):
        assert line in script, line
    assert script.count("#SBATCH --nodes") == 1 and not os.path.exists(tmp_path / "run")  # nothing written
    bash = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr


def test_the_signal_lead_leaves_room_for_the_grace_time(tmp_path):
    res = _py("slurm.submit", "train", "baseline/tiny", "checkpoint.grace_s=300", "--profile",
              _write_profile(tmp_path, PROFILE), "--dry-run")
    assert "#SBATCH --signal=B:USR1@330" in res.stdout


@pytest.mark.parametrize("drop", ["partition", "time", "gpus_per_node"])
def test_a_missing_profile_field_is_named(tmp_path, drop):
    res = _py("slurm.submit", "train", "baseline/tiny", "--dry-run", "--profile",
              _write_profile(tmp_path, {k: v for k, v in PROFILE.items() if k != drop}))
    assert res.returncode == 2 and f"missing field {drop!r}" in res.stderr and res.stdout == ""


def test_profile_values_are_checked():
    with pytest.raises(ProfileError, match="unknown field 'partitoin'"):
        profile_from_dict({**PROFILE, "partitoin": "x"})
    with pytest.raises(ProfileError, match="'time' must look like"):
        profile_from_dict({**PROFILE, "time": "four hours"})
    with pytest.raises(ProfileError, match="'launcher' must be one of"):
        profile_from_dict({**PROFILE, "launcher": "ssh"})
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("/nonexistent/profile.yaml")
    assert load_profile(os.path.join(ROOT, "slurm", "profiles", "example.yaml")).nproc == 8


def test_sbatch_scripts_refuse_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for script in ("train.sbatch", "preprocess.sbatch"):
        res = subprocess.run(["bash", os.path.join(ROOT, "slurm", script), "baseline/tiny"], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
        assert res.returncode == 2 and "not inside a Slurm job" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def _start(tmp_path, run, env=None):
    return _py("slurm.job", "start", "baseline/tiny", f"train.run_dir={run}",
               env={"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", **(env or {})})


def test_job_start_prints_the_variables_and_records_the_run(tmp_path):
    res = _start(tmp_path, tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert f"RUN_DIR={tmp_path}/run" in res.stdout and "PORT=24242" in res.stdout and "START_STEP=0" in res.stdout
    record = json.load(open(tmp_path / "run" / "slurm" / "job-4242-0.json"))
    assert record["git"] and "train:" in record["resolved_config"]


def test_a_torchrun_that_cannot_wait_the_grace_is_named_at_the_start(tmp_path):
    """train.sbatch gives torchrun's agents the grace through TORCH_ELASTIC_SHUTDOWN_TIMEOUT; torch 2.11's
    torchrun has no such setting (nor the --shutdown-timeout flag, which it refused: every Slurm torchrun job
    failed) and kills its workers 30 s after SIGTERM. The start line says so where that cuts the grace."""
    old = {"--nnodes", "--max-restarts"}  # a torchrun without --shutdown-timeout
    note = slurm_job.torchrun_grace_note(60.0, old)
    assert note.startswith("note: torchrun in torch ") and "checkpoint.grace_s=60" in note and "LAUNCHER=srun" in note
    assert slurm_job.torchrun_grace_note(30.0, old) is None  # the grace fits in its 30 s
    assert slurm_job.torchrun_grace_note(60.0, old | {"--shutdown-timeout"}) is None
    res = _start(tmp_path, tmp_path / "run")  # 2.13's torchrun reads the variable: nothing to say there
    assert res.returncode == 0 and ("note:" in res.stderr) == (slurm_job.torchrun_grace_note(60.0) is not None)


def test_a_port_in_use_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        res = _start(tmp_path, tmp_path / "run", env={"RDZV_PORT": str(s.getsockname()[1])})
    assert res.returncode == 2 and "is in use" in res.stderr and "RDZV_PORT" in res.stderr


def test_an_unwritable_run_directory_stops_the_job_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    res = _start(tmp_path, tmp_path / "file" / "run")
    assert res.returncode == 2 and "is not writable" in res.stderr
    assert (tmp_path / "file").read_text() == "not a directory"


def test_a_requeue_loop_gives_up_with_a_message(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "slurm"))
    calls = []
    monkeypatch.setattr(slurm_job.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        subprocess.CompletedProcess(argv, 0, "", ""))
    env = {"SLURM_JOB_ID": "7"}
    codes = [slurm_job.end(run, 1, False, 0, max_restarts=2, env=env)[0] for _ in range(2)]
    assert codes == [slurm_job.EXIT_REQUEUED] * 2 and len(calls) == 2  # two crashes, two restarts
    code, message = slurm_job.end(run, 1, False, 0, max_restarts=2, env=env)  # the third: no more
    assert code == slurm_job.EXIT_GAVE_UP and "not requeued" in message and "max_restarts=2" in message
    assert len(calls) == 2
    with pytest.raises(slurm_job.JobError, match="requeue loop"):
        slurm_job.start("baseline/tiny", [f"train.run_dir={run}"], max_restarts=2,
                        env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost"})


def test_a_launcher_failing_after_a_complete_run_does_not_requeue_it(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "slurm"))
    (tmp_path / "run" / "config.yaml").write_text("train:\n  max_steps: 60\n")
    calls = []
    monkeypatch.setattr(slurm_job.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        subprocess.CompletedProcess(argv, 0, "", ""))
    monkeypatch.setattr(slurm_job, "latest_step", lambda run_dir: 60)
    code, message = slurm_job.end(run, 1, False, 40, max_restarts=2, env={"SLURM_JOB_ID": "7"})
    assert code == slurm_job.EXIT_DONE and "finished at step 60" in message and "exited with code 1" in message
    assert calls == []  # not requeued
    monkeypatch.setattr(slurm_job, "latest_step", lambda run_dir: 50)  # incomplete: requeued as before
    assert slurm_job.end(run, 1, False, 40, max_restarts=2, env={"SLURM_JOB_ID": "7"})[0] == slurm_job.EXIT_REQUEUED


def test_progress_resets_the_restart_count(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "slurm"))
    slurm_job.append_history(run, {"event": "end", "rc": 1, "start_step": 0, "end_step": 0})
    slurm_job.append_history(run, {"event": "end", "rc": 75, "stopped": True, "start_step": 0, "end_step": 40})
    slurm_job.append_history(run, {"event": "end", "rc": 1, "start_step": 40, "end_step": 40})
    assert slurm_job.fruitless_ends(slurm_job.read_history(run)) == 1


def test_sweep_points_are_named_and_carry_their_run_dirs(tmp_path):
    points = expand({"name": "s", "config": "baseline/tiny", "root": str(tmp_path), "overrides": ["train.max_steps=5"],
                     "grid": {"optim.lr": [0.001, 0.01], "model.n_layers": [2, 4]}})
    assert [p["name"] for p in points] == ["p00-lr0.001-n_layers2", "p01-lr0.001-n_layers4", "p02-lr0.01-n_layers2",
                                           "p03-lr0.01-n_layers4"]
    assert points[3]["overrides"] == ["train.max_steps=5", "optim.lr=0.01", "model.n_layers=4", "train.name=p03-lr0.01-n_layers4",
                                      f"train.run_dir={tmp_path}/s/p03-lr0.01-n_layers4"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"name": "s", "config": "baseline/tiny", "grid": {"optim.lr": []}}))
    res = _py("slurm.sweep", "expand", str(bad))
    assert res.returncode == 2 and "non-empty list" in res.stderr


def test_sweep_points_may_carry_their_own_configs(tmp_path):
    """A table that spans configs: config as a grid axis, and listed points; each array task starts from its
    point's config (slurm.sweep argv), and a points.json written before points had configs still works."""
    from slurm.sweep import point_argv, write_points

    spec = {"name": "t", "root": str(tmp_path), "overrides": ["train.max_steps=5", "schedule.warmup_steps=1"],
            "grid": {"config": ["baseline/tiny", "rt/tiny"], "train.seed": [1]},
            "points": [{"name": "sps-xs", "config": "sps/tiny", "overrides": ["model.variant=delayed_state"]}]}
    points = expand(spec)
    assert [(p["name"], p["config"]) for p in points] == [
        ("p00-configbaselinetiny-seed1", "baseline/tiny"), ("p01-configrttiny-seed1", "rt/tiny"), ("sps-xs", "sps/tiny")]
    assert points[1]["overrides"][1:3] == ["schedule.warmup_steps=1", "train.seed=1"]
    assert points[2]["overrides"][1:3] == ["schedule.warmup_steps=1", "model.variant=delayed_state"]
    path = write_points(spec, points)
    assert point_argv(path, "2")[:4] == ["sps/tiny", "train.max_steps=5", "schedule.warmup_steps=1",
                                         "model.variant=delayed_state"]
    res = _py("slurm.sweep", "point", path, "2")  # a script rendered before points had configs: refused, not wrong
    assert res.returncode == 2 and "has its own config (sps/tiny)" in res.stderr
    res = _py("slurm.sweep", "argv", path, "1")
    assert res.returncode == 0 and res.stdout.splitlines()[0] == "rt/tiny"
    old = json.loads(open(path).read())
    for p in old["points"]:
        del p["config"]
    old["config"] = "baseline/tiny"
    with open(path, "w") as f:
        json.dump(old, f)
    assert point_argv(path, "2")[0] == "baseline/tiny"
    res = _py("slurm.submit", "sweep", _sweep_file(tmp_path, spec), "--profile", _write_profile(tmp_path, PROFILE),
              "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "# point 2: sps-xs: sps/tiny train.max_steps=5 schedule.warmup_steps=1" in res.stdout and "SWEEP_POINTS=" in res.stdout
    for bad, message in (({"name": "u", "grid": {"optim.lr": [1]}}, "missing field 'config'"),
                         ({"name": "u", "points": [{"name": "a"}]}, "names no config"),
                         ({"name": "u", "config": "baseline/tiny", "points": [{"name": "a"}, {"name": "a"}]},
                          "appears twice"),
                         ({"name": "u", "config": "baseline/tiny", "points": [{"name": "a", "confg": "x"}]},
                          "unknown field 'confg'"),
                         ({"name": "u", "config": "baseline/tiny", "points": [{"name": "a", "overrides": ["model.nope=1"]}]},
                          "point a: .*nope")):
        res = _py("slurm.submit", "sweep", _sweep_file(tmp_path, bad), "--profile", _write_profile(tmp_path, PROFILE),
                  "--dry-run")
        assert res.returncode == 2 and re.search(message, res.stderr) and res.stderr.count("\n") == 1, res.stderr


def _sweep_file(tmp_path, spec):
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(spec))
    return str(path)
