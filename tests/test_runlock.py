"""One writer per run directory (pretrain/runlock.py): the lock itself, then through `pretrain train`
in real subprocesses: a second trainer refused naming the holder (one process and torchrun with 2
ranks), a dead holder's lock taken over, a requeued Slurm job taking its own lock over."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.metrics import read_metrics
from pretrain.preemption import EXIT_REQUEUE
from pretrain.runlock import LOCK_NAME, RunLock, RunLockError, read_holder
from trainer_helpers import tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(run_dir, host=HOST, pid=None, job="", task="", age=0.0, token="stale0token"):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid if pid is not None else _dead_pid(), "slurm_job_id": job,
                   "slurm_array_task_id": task, "started": time.time() - age - 5, "token": token}, f)
    t = time.time() - age
    os.utime(path, (t, t))
    return path


# -- the lock -------------------------------------------------------------------------------------
def test_acquire_refuse_release(tmp_path):
    run = str(tmp_path / "run")
    lines = []
    with RunLock(run, 60, log=lines.append) as lock:
        holder, _ = read_holder(lock.path)
        assert (holder.host, holder.pid) == (HOST, os.getpid())
        with pytest.raises(RunLockError) as e:
            RunLock(run, 60, env={"SLURM_JOB_ID": ""}).acquire()
        msg = str(e.value)
        assert f"is in use by another trainer: process {os.getpid()} on {HOST}, started " in msg
        assert "UTC" in msg and "delete" in msg and "\n" not in msg
    assert not os.path.exists(os.path.join(run, LOCK_NAME)) and lines == []


def test_the_refusal_names_the_slurm_job(tmp_path):
    run = str(tmp_path / "run")
    _write_lock(run, host="other-node", pid=123, job="991", task="4")
    with pytest.raises(RunLockError, match="process 123 on other-node, Slurm job 991 array task 4, started"):
        RunLock(run, 60, env={}).acquire()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
    run = str(tmp_path / "run")
    pid = _dead_pid()
    _write_lock(run, pid=pid)
    lines = []
    lock = RunLock(run, 60, log=lines.append, env={}).acquire()
    assert len(lines) == 1 and f"taking over the lock of {run} from process {pid} on {HOST}" in lines[0]
    assert f"process {pid} no longer runs" in lines[0]
    assert read_holder(lock.path)[0].token == lock.me.token
    lock.release()
    assert os.listdir(run) == []  # nothing left aside


def test_a_stale_heartbeat_on_another_host_is_taken_over(tmp_path):
    run = str(tmp_path / "run")
    _write_lock(run, host="other-node", pid=1, age=30)
    with pytest.raises(RunLockError):  # fresh enough for a 60 s timeout
        RunLock(run, 60, env={}).acquire()
    lines = []
    RunLock(run, 10, log=lines.append, env={}).acquire().release()
    assert "from process 1 on other-node" in lines[0] and "heartbeat is 30 s old" in lines[0]


def test_the_same_slurm_job_and_array_task_takes_its_lock_over(tmp_path):
    run = str(tmp_path / "run")
    _write_lock(run, host="other-node", pid=1, job="4242", task="3")
    with pytest.raises(RunLockError):  # outside the job, a live holder
        RunLock(run, 60, env={}).acquire()
    lines = []
    RunLock(run, 60, log=lines.append, env={"SLURM_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3"}).acquire().release()
    assert "this same Slurm job, requeued" in lines[0]


def test_a_slurm_job_waits_for_another_jobs_heartbeat_to_stop(tmp_path):
    run = str(tmp_path / "run")
    _write_lock(run, host="other-node", pid=1, job="1000")
    lines, t0 = [], time.monotonic()
    RunLock(run, 1.0, log=lines.append, env={"SLURM_JOB_ID": "1001"}, poll_s=0.05).acquire().release()
    assert 0.5 < time.monotonic() - t0 < 5
    assert "locked by process 1 on other-node, Slurm job 1000" in lines[0] and "waits up to 1 s" in lines[0]
    assert "taking over" in lines[1] and "heartbeat is 1 s old" in lines[1]


def test_a_waiting_slurm_job_is_refused_once_the_heartbeat_moves(tmp_path):
    run = str(tmp_path / "run")
    path = _write_lock(run, host="other-node", pid=1, job="1000")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            os.utime(path)

    threading.Thread(target=beat, daemon=True).start()
    try:
        with pytest.raises(RunLockError, match="its heartbeat is still being refreshed"):
            RunLock(run, 2.0, log=lambda _: None, env={"SLURM_JOB_ID": "1001"}, poll_s=0.05).acquire()
    finally:
        stop.set()


def test_the_heartbeat_refreshes_the_lock(tmp_path):
    lock = RunLock(str(tmp_path / "run"), 0.2, env={}).acquire()
    try:
        t = time.time() - 100
        os.utime(lock.path, (t, t))
        time.sleep(0.3)
        assert time.time() - read_holder(lock.path)[1] < 1
    finally:
        lock.release()


def test_a_lock_timeout_must_be_positive():
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=f"checkpoint.lock_timeout_s must be a positive number of seconds, got "
                                              f"{float(bad)}"):
            load_config("baseline/tiny", [f"checkpoint.lock_timeout_s={bad}"], check_data=False)
    with pytest.raises(ConfigError, match=r"checkpoint.lock_timeout_s \(120 s\) must be shorter than parallel.timeout_s "
                                          r"\(60 s\)"):
        load_config("baseline/tiny", ["parallel.timeout_s=60"], check_data=False)


# -- through the CLI --------------------------------------------------------------------------------
def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_"))}
    return dict(env, PYTHONPATH=f"{ROOT}:{ROOT}/tests", OMP_NUM_THREADS="1", **extra)


def _over(tmp_path, corpus, steps, **extra):
    return tiny_overrides(tmp_path, corpus, **{"train.max_steps": steps, "checkpoint.every": 0,
                                               "train.eval_every": 0, "schedule.warmup_steps": 1, **extra})


def _cli(*args, launcher=None):
    return [*(launcher or [sys.executable, "-m", "pretrain.cli"]), "train", "baseline/tiny", *args]


def _wait_for_steps(metrics, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the first trainer did not log {n} steps: {proc.poll()}")


def _second_trainer_refused(tmp_path, corpus, launcher=None, readers=False):
    run = tmp_path / "run"
    # its own process group: a launcher's workers are stopped with it, never left training after the test
    first = subprocess.Popen(_cli(*_over(tmp_path, corpus, 100000, **{"checkpoint.every": 2}), launcher=launcher),
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _wait_for_steps(run / "metrics.jsonl", 2, first)
        deadline = time.time() + 120  # and its first checkpoint: from then on its top-level entries stay the same
        while time.time() < deadline and first.poll() is None and not (run / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        before = {p: os.stat(run / p).st_mtime_ns for p in ("config.yaml", LOCK_NAME)}
        listing = sorted(os.listdir(run))
        second = subprocess.run(_cli(*_over(tmp_path, corpus, 100000), launcher=launcher), env=_env(),
                                capture_output=True, text=True, timeout=300)
        assert {p: os.stat(run / p).st_mtime_ns for p in before} == before and sorted(os.listdir(run)) == listing
        if readers:  # the read-only verbs work while it trains (on a complete checkpoint)
            for verb in (["eval", str(run), "--batches", "1", "--json"], ["export", str(run), str(tmp_path / "out")]):
                out = subprocess.run([sys.executable, "-m", "pretrain.cli", *verb], env=_env(), capture_output=True,
                                     text=True, timeout=300)
                assert out.returncode == 0, out.stderr
        assert first.poll() is None, "the first trainer must still run"
        first.send_signal(2 if launcher else 15)  # torchrun forwards SIGINT to its workers
        _, err = first.communicate(timeout=120)
        # torchrun may return before its workers have exited: the lock goes with rank 0's process
        deadline = time.time() + 60
        while (run / LOCK_NAME).exists() and time.time() < deadline:
            time.sleep(0.1)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        first.wait()
    steps = [r["step"] for r in read_metrics(str(run))]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2, steps  # every step once
    assert not (run / LOCK_NAME).exists(), f"the lock is released at exit; the first trainer's stderr ends: {err[-3000:]}"
    if launcher:  # Ctrl-C as torchrun forwards it: every rank finishes its step and saves it, then exits
        assert "pretrain train: interrupted: stopped by SIGINT after step" in err, err[-3000:]
    return first.returncode, err, second


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path, corpus):
    rc, err, second = _second_trainer_refused(tmp_path, corpus, readers=True)
    assert rc == EXIT_REQUEUE, err  # the preemption path still works while the lock is held
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr.startswith(f"pretrain train: error: {tmp_path / 'run'} is in use by another trainer: process ")
    assert f" on {HOST}, started " in second.stderr and len(second.stderr.strip().splitlines()) == 1


def test_a_second_torchrun_job_is_refused(tmp_path, corpus):
    torchrun = [shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun", "--standalone",
                "--nproc-per-node", "2", "-m", "pretrain.cli"]
    _, _, second = _second_trainer_refused(tmp_path, corpus, launcher=torchrun)
    assert second.returncode != 0
    assert f"{tmp_path / 'run'} is in use by another trainer: process " in second.stderr, second.stderr[-3000:]
    assert "rank 0 could not take the lock" in second.stderr  # rank 1 stops too instead of waiting


@pytest.mark.parametrize("where", ["dead here", "stale elsewhere"])
def test_a_dead_trainers_lock_is_taken_over(tmp_path, corpus, where):
    pid, host = (_dead_pid(), HOST) if where == "dead here" else (1, "other-node")
    _write_lock(str(tmp_path / "run"), host=host, pid=pid, age=0 if where == "dead here" else 60)
    out = subprocess.run(_cli(*_over(tmp_path, corpus, 2, **{"checkpoint.lock_timeout_s": 30})), env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    why = f"process {pid} no longer runs" if where == "dead here" else " s old, over checkpoint.lock_timeout_s=30"
    assert f"taking over the lock of {tmp_path / 'run'} from process {pid} on {host}" in out.stdout and why in out.stdout
    assert [r["step"] for r in read_metrics(str(tmp_path / "run"))] == [1, 2]
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path, corpus):
    _write_lock(str(tmp_path / "run"), host="node-that-died", pid=77, job="31337")
    out = subprocess.run(_cli(*_over(tmp_path, corpus, 2)), env=_env(SLURM_JOB_ID="31337"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "from process 77 on node-that-died, Slurm job 31337" in out.stdout and "requeued" in out.stdout


def test_a_bad_lock_timeout_is_one_line_before_any_work(tmp_path, corpus):
    out = subprocess.run(_cli(*_over(tmp_path, corpus, 2, **{"checkpoint.lock_timeout_s": 0})), env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip() == \
        "pretrain train: error: checkpoint.lock_timeout_s must be a positive number of seconds, got 0.0"
    assert not (tmp_path / "run").exists()


def test_export_and_import_force_do_not_replace_a_held_run_directory(tmp_path):
    from pretrain.export.source import check_output

    run = str(tmp_path / "run")
    with RunLock(run, 60, env={}):
        with pytest.raises(RunLockError, match=f"{run} is in use by a trainer \\(process {os.getpid()} on "):
            check_output(run, force=True)
    check_output(run, force=True)  # released: replaceable
    _write_lock(run)  # a dead holder's lock does not stop it either
    check_output(run, force=True)


def test_a_storage_fault_taking_the_lock_is_one_sentence(tmp_path, monkeypatch):
    import errno

    from data_tools.storage import StorageError
    from pretrain.runlock import hold_run_dir

    def read_only(self):
        raise OSError(errno.EROFS, "Read-only file system", self.path)

    monkeypatch.setattr(RunLock, "_create", read_only)
    with pytest.raises(StorageError, match="taking the run directory's lock failed: .*\\.lock"):
        with hold_run_dir(str(tmp_path / "run"), 60, env={}):
            pass


def test_slurm_job_start_is_refused_before_writing_when_the_trainer_would_be(tmp_path):
    """python -m slurm.job start writes records in the run directory before training: it refuses
    exactly when the trainer would refuse at once, and stays silent for a takeover or a wait."""
    from pretrain.runlock import refuse_before_start

    run = str(tmp_path / "run")
    _write_lock(run, pid=os.getpid(), job="7")  # a live trainer of another job on this host
    with pytest.raises(RunLockError, match=f"process {os.getpid()} on {HOST}, Slurm job 7"):
        refuse_before_start(run, 60, env={"SLURM_JOB_ID": "8"})
    assert sorted(os.listdir(run)) == [LOCK_NAME]
    _write_lock(run, host="other-node", pid=1, job="9")
    refuse_before_start(run, 60, env={"SLURM_JOB_ID": "8"})  # another node: the trainer would wait
    _write_lock(run, pid=_dead_pid())
    refuse_before_start(run, 60, env={})  # a dead holder: taken over
    refuse_before_start(str(tmp_path / "none"), 60, env={})  # no lock at all
