"""The launchers against a real two-node Slurm (tests/slurm_cluster.py): torchrun across both nodes,
one srun task per process, preemption warning -> checkpoint -> requeue -> identical resume, a job
array sweep, and the preprocess array with its merge."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from slurm_cluster import INSTALL, KILL_WAIT_S, SlurmCluster, missing_binaries
from trainer_helpers import step_losses, tiny_overrides, write_markov_corpus

pytestmark = pytest.mark.slurm
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): {INSTALL}")
    # munged needs every directory above its socket world-executable, which pytest's tmp dirs are not
    root = tempfile.mkdtemp(prefix="slurm-ci-")
    os.chmod(root, 0o755)
    c = SlurmCluster(root)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def _profile(tmp, launcher="torchrun", nodes=2):
    path = os.path.join(tmp, f"profile-{launcher}-{nodes}.yaml")
    with open(path, "w") as f:
        json.dump({"partition": "debug", "nodes": nodes, "gpus_per_node": 0, "cpus_per_task": 1, "time": "15:00",
                   "launcher": launcher, "python": sys.executable, "max_restarts": 2,
                   "env": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}}, f)  # JSON is YAML
    return path


def _submit(cluster, *args):
    res = cluster.run(sys.executable, "-m", "slurm.submit", *args, env={"PYTHONPATH": ROOT}, cwd=ROOT)
    job = res.stdout.split("job ")[1].split()[0].rstrip(":")
    return job, res.stdout


def _train_overrides(tmp, corpus, run, steps=60):
    return tiny_overrides(tmp, corpus, **{"train.run_dir": os.path.join(str(tmp), run), "train.max_steps": steps,
                                          "checkpoint.every": 0, "train.eval_every": 0, "model.d_model": 64,
                                          "data.seq_len": 64, "train.name": run})


def _output(run_dir):
    logs = [os.path.join(run_dir, "slurm", f) for f in sorted(os.listdir(os.path.join(run_dir, "slurm")))
            if f.endswith(".out")]
    return "".join(open(f).read() for f in logs)


@pytest.fixture(scope="module")
def reference(cluster, corpus, tmp_path_factory):
    """An uninterrupted 2-node torchrun job: what the other starts must reproduce."""
    tmp = str(tmp_path_factory.mktemp("ref"))
    job, _ = _submit(cluster, "train", "baseline/tiny", *_train_overrides(tmp, corpus, "ref"), "--profile", _profile(tmp))
    state = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    run = os.path.join(tmp, "ref")
    assert state == "COMPLETED", _output(run)
    return run


def test_torchrun_across_two_nodes_trains_to_completion(reference):
    out = _output(reference)
    assert "training finished at step 60" in out, out
    assert sorted(step_losses(reference)) == list(range(1, 61))
    assert {"rank0.log", "rank1.log"} <= set(os.listdir(os.path.join(reference, "logs")))  # two ranks ran
    record = json.load(open([os.path.join(reference, "slurm", f) for f in os.listdir(os.path.join(reference, "slurm"))
                             if f.startswith("job-")][0]))
    assert record["nodes"] == "n[1-2]" and record["git"] and "model:" in record["resolved_config"]


def test_one_srun_task_per_process_reaches_the_same_training(cluster, corpus, reference, tmp_path):
    job, _ = _submit(cluster, "train", "baseline/tiny", *_train_overrides(tmp_path, corpus, "srun"),
                     "--profile", _profile(str(tmp_path), "srun"))
    run = os.path.join(str(tmp_path), "srun")
    assert cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", _output(run)
    assert step_losses(run) == step_losses(reference)  # same 2-rank process groups, same numbers


def test_warning_signal_checkpoints_requeues_and_resumes_identically(cluster, corpus, reference, tmp_path):
    job, _ = _submit(cluster, "train", "baseline/tiny", *_train_overrides(tmp_path, corpus, "pre"),
                     "--profile", _profile(str(tmp_path)))
    run = os.path.join(str(tmp_path), "pre")
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 180
    while time.time() < deadline and not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 10):
        time.sleep(0.1)
    assert os.path.exists(metrics), _output(run)
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # what Slurm sends --signal-lead before the end
    cluster.wait_state(job, ("PENDING",), timeout=180)
    # Slurm holds a requeued job ~2 min; start it sooner, but not within the second its old credential was
    # revoked: slurmd refuses a credential made in or before that second ("Job credential revoked"), and
    # the job then ends FAILED without running (seen in CI when StartTime=now allocated it 0.5 s later)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+3")
    state = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"))
    # the daemons' last words with it: a requeued job once ended FAILED without a line of its own output
    assert state == "COMPLETED", _output(run) + "\n" + cluster.diagnose(job)
    assert cluster.job_field(job, "Restarts") == "1"
    out = _output(run)
    assert "warning signal" in out and "requeued" in out and "training finished at step 60" in out, out
    history = [json.loads(x) for x in open(os.path.join(run, "slurm", "history.jsonl"))]
    stop = [h for h in history if h["event"] == "end"][0]
    assert stop["stopped"] and 10 <= stop["end_step"] < 60, history
    starts = [h for h in history if h["event"] == "start"]
    assert [h["start_step"] for h in starts] == [0, stop["end_step"]]
    # the requeued job ends at once: its batch shell does not sit out KillWait until Slurm's SIGKILL
    assert starts[1]["time"] - stop["time"] < KILL_WAIT_S, history
    assert step_losses(run) == step_losses(reference)  # every step, bit for bit


def test_sweep_runs_as_a_four_task_array_and_reports(cluster, corpus, tmp_path):
    """Two grid points and two listed ones, one of them from a config of its own (each array task starts
    from its point's config)."""
    own = os.path.join(str(tmp_path), "slow-lr.yaml")
    with open(os.path.join(ROOT, "configs", "baseline", "tiny.yaml")) as f:
        text = f.read()
    with open(own, "w") as f:
        f.write(text.replace("lr: 2.0e-3", "lr: 5.0e-4"))
    sweep = os.path.join(str(tmp_path), "sweep.yaml")
    with open(sweep, "w") as f:
        json.dump({"name": "lr-width", "config": "baseline/tiny", "root": os.path.join(str(tmp_path), "sweeps"),
                   "overrides": _train_overrides(tmp_path, corpus, "unused", steps=8)[:-1]
                   + ["train.eval_every=0", "train.eval_batches=2"],
                   "grid": {"optim.lr": [0.001, 0.003], "model.d_model": [32]},
                   "points": [{"name": "d64", "overrides": ["model.d_model=64"]},
                              {"name": "slow-lr", "config": own, "overrides": ["model.d_model=64"]}]}, f)
    job, _ = _submit(cluster, "sweep", sweep, "--profile", _profile(str(tmp_path), "srun", nodes=1))
    sweep_dir = os.path.join(str(tmp_path), "sweeps", "lr-width")
    deadline = time.time() + 400
    while time.time() < deadline:
        states = cluster.array_states(job)
        if len(states) == 4 and all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states):
            break
        time.sleep(1)
    assert cluster.array_states(job) == ["COMPLETED"] * 4
    status = subprocess.run([sys.executable, "-m", "slurm.sweep", "status", sweep_dir], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    rows = status.stdout.splitlines()[1:]
    assert len(rows) == 4 and all(" done " in r and r.split()[-1] != "-" for r in rows), status.stdout
    assert {r.split()[0] for r in rows} == {"p00-lr0.001-d_model32", "p01-lr0.003-d_model32", "d64", "slow-lr"}
    import yaml

    lrs = {name: yaml.safe_load(open(os.path.join(sweep_dir, name, "config.yaml")))["optim"]["lr"]
           for name in ("d64", "slow-lr")}
    assert lrs == {"d64": 2e-3, "slow-lr": 5e-4}  # the sweep's config, then the point's own


def test_preprocess_array_then_merge(cluster, tmp_path):
    import pydoc_data.topics as t

    from data_tools.indexed import IndexedDataset
    from data_tools.tokenizer import train_sentencepiece

    texts = [t.topics[k] for k in sorted(t.topics)][:60]
    spm = train_sentencepiece(texts, str(tmp_path / "spm"), 400, num_threads=1)
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"shard{i}.jsonl"))
        with open(files[-1], "w") as f:
            f.writelines(json.dumps({"text": x}) + "\n" for x in texts[i::3])
    out = str(tmp_path / "data" / "corpus")
    job, _ = _submit(cluster, "preprocess", "--profile", _profile(str(tmp_path), "srun", nodes=1), "--tasks", "2",
                     "--inputs", *files, "--output-prefix", out, "--", "--tokenizer-model", spm, "--workers", "1")
    # the merge job's output appears (by rename) a moment before Slurm records the job as finished
    assert cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300) == "COMPLETED"
    merged = IndexedDataset(out + "_text_document")
    parts = [IndexedDataset(str(tmp_path / "data" / "corpus.parts" / f"part{i:04d}_text_document")) for i in range(2)]
    assert len(merged) == sum(len(p) for p in parts) == len(texts)  # 2 tasks: files 0,2 and file 1
