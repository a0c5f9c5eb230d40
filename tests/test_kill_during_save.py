"""A kill during a checkpoint (issue 25 point 5), through the CLI in real subprocesses: SIGKILL at random
moments of a save (3 trials here, 20 in the slow test), then resume: every resume starts from a
complete, verified checkpoint and continues to the losses of an uninterrupted run, and no partial
directory is left once the resumed run has saved. SIGINT or SIGTERM landing in a save ends as cleanly
as between steps: no traceback, the interrupted line or the requeue exit, the same losses on resume."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from pretrain.checkpoint import latest_checkpoint, read_meta
from pretrain.preemption import EXIT_REQUEUE
from trainer_helpers import step_losses, tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
STEPS = 12
TEMP = re.compile(r"\.step_\d+\.tmp-\d+")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("whole")
    out = subprocess.run(command(tmp, corpus, tmp / "run"), env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return step_losses(tmp / "run")


def command(tmp, corpus, run_dir):
    # wide enough that a save (about 40 MB with the optimizer's moments, fsynced) takes a while to hit
    over = tiny_overrides(tmp, corpus, **{"train.run_dir": str(run_dir), "train.max_steps": STEPS,
                                          "train.eval_every": 0, "checkpoint.every": 1, "checkpoint.keep_last": 2,
                                          "train.compile": "false", "model.d_model": 256, "model.n_layers": 4})
    return [sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny", *over]


def start_and_signal_in_a_save(tmp, corpus, run_dir, sig, rng, min_step=2):
    """Start a run, wait until a save of step >= min_step is under way (its temporary directory exists),
    then send `sig` after a random fraction of a save's duration."""
    proc = subprocess.Popen(command(tmp, corpus, run_dir), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    root = os.path.join(run_dir, "checkpoints")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        names = os.listdir(root) if os.path.isdir(root) else []
        steps = [int(n.split("_")[1].split(".")[0]) for n in names if TEMP.fullmatch(n)]
        if steps and max(steps) >= min_step:
            time.sleep(rng.uniform(0.0, 0.03))
            proc.send_signal(sig)
            break
        time.sleep(0.0005)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def resume_to_the_end(tmp, corpus, run_dir):
    before = latest_checkpoint(str(run_dir), log=lambda _: None)
    if before is not None:  # what the resume will start from is complete and verifies
        read_meta(before)
    out = subprocess.run(command(tmp, corpus, run_dir), env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    leftovers = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith(".")]
    assert leftovers == [], leftovers  # partial directories of the killed save are cleaned up
    return out


def kill_trials(tmp_path, corpus, reference, trials, seed):
    rng = random.Random(seed)
    for trial in range(trials):
        run_dir = tmp_path / f"trial{trial}"
        rc, _, _ = start_and_signal_in_a_save(tmp_path, corpus, run_dir, signal.SIGKILL, rng,
                                              min_step=rng.randint(2, STEPS - 2))
        assert rc == -signal.SIGKILL
        resume_to_the_end(tmp_path, corpus, run_dir)
        assert step_losses(run_dir) == reference, f"trial {trial}"


def test_sigkill_during_saves_resumes_exactly(tmp_path, corpus, reference):
    kill_trials(tmp_path, corpus, reference, trials=3, seed=0)


@pytest.mark.slow
def test_sigkill_during_saves_resumes_exactly_20_trials(tmp_path, corpus, reference):
    kill_trials(tmp_path, corpus, reference, trials=20, seed=1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_a_save_ends_cleanly(tmp_path, corpus, reference, sig):
    rc, _, err = start_and_signal_in_a_save(tmp_path, corpus, tmp_path / "run", sig, random.Random(2))
    assert "Traceback" not in err and "CheckpointException" not in err, err
    if sig == signal.SIGINT:
        assert rc == 130 and "pretrain train: interrupted" in err, err
    else:
        assert rc == EXIT_REQUEUE, err
    saved = latest_checkpoint(str(tmp_path / "run"), log=pytest.fail)
    assert saved is not None
    read_meta(saved)
    resume_to_the_end(tmp_path, corpus, tmp_path / "run")
    assert step_losses(tmp_path / "run") == reference
