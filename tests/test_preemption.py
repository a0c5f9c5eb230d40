"""Stop on a signal: finish the step, checkpoint together, exit 75; the resumed run is bit-identical."""
import os
import signal
import subprocess
import sys
import time

import pytest

from distributed import run_ranks
from pretrain.config import ConfigError, load_config
from pretrain.metrics import read_metrics
from pretrain.preemption import EXIT_REQUEUE, StopRequested
from trainer_helpers import step_losses, tiny_overrides, write_markov_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def _overrides(tmp_path, corpus, run):
    # no scheduled checkpoint before the end: the stop's checkpoint is the only one to resume from
    return tiny_overrides(tmp_path, corpus, **{"train.run_dir": os.path.join(str(tmp_path), run), "train.max_steps": 30,
                                               "checkpoint.every": 0, "train.eval_every": 0})


def test_sigterm_checkpoints_exits_75_and_resumes_bit_identical(tmp_path, corpus):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cli = [sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny"]
    whole = subprocess.run(cli + _overrides(tmp_path, corpus, "whole"), env=env, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr

    proc = subprocess.Popen(cli + _overrides(tmp_path, corpus, "run"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_REQUEUE, err
    assert "stopped by SIGTERM after step" in err and "checkpoint written" in err
    ckpts = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    stopped_at = len(read_metrics(str(tmp_path / "run")))
    assert 5 <= stopped_at < 30 and f"step_{stopped_at:08d}" in ckpts, (ckpts, stopped_at)

    resumed = subprocess.run(cli + _overrides(tmp_path, corpus, "run"), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert step_losses(tmp_path / "run") == step_losses(tmp_path / "whole")  # every step, bit for bit


def _one_rank_signalled(rank, world, tmp, corpus):
    from pretrain.trainer import Trainer

    trainer = Trainer(load_config("baseline/tiny", _overrides(tmp, corpus, "ddp")), log=lambda *_: None)
    engine_step = trainer.engine.step

    def step_then_signal_rank1():
        engine_step()
        if rank == 1 and trainer.step == 3:  # the 4th step is under way: only rank 1 hears the signal
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer.engine.step = step_then_signal_rank1
    try:
        trainer.fit()
    except StopRequested as e:
        return e.step, str(e)
    return None, "not stopped"


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, corpus):
    results = run_ranks(_one_rank_signalled, 2, args=(str(tmp_path), corpus))
    assert [step for step, _ in results] == [4, 4], results
    assert "SIGUSR1" in results[1][1] and "another rank" in results[0][1]
    assert os.path.isdir(tmp_path / "ddp" / "checkpoints" / "step_00000004")


def _ctrl_c_at_different_points(rank, world, tmp, corpus):
    from pretrain.trainer import Trainer

    trainer = Trainer(load_config("baseline/tiny", _overrides(tmp, corpus, "ctrl-c")), log=lambda *_: None)
    engine_step, forward_backward = trainer.engine.step, trainer.engine.forward_backward

    def step_then_interrupt():  # rank 0: after the 4th step's optimizer update, before its end
        engine_step()
        if rank == 0 and trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    def interrupt_then_forward(*args, **kwargs):  # rank 1: as the 4th step's forward starts
        if rank == 1 and trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return forward_backward(*args, **kwargs)

    trainer.engine.step, trainer.engine.forward_backward = step_then_interrupt, interrupt_then_forward
    try:
        trainer.fit()
    except StopRequested as e:
        return e.step, e.signame
    return None, "not stopped"


def test_ctrl_c_at_different_points_of_a_step_stops_every_rank_after_it_with_a_checkpoint(tmp_path, corpus):
    """Ranks hear Ctrl-C at different points of the same step (one mid-step, one between its update and
    its end): none stops where it stood (the others would wait in a collective); all finish the step,
    save it together and stop."""
    results = run_ranks(_ctrl_c_at_different_points, 2, args=(str(tmp_path), corpus))
    assert results == [(4, "SIGINT"), (4, "SIGINT")], results
    assert os.path.isdir(tmp_path / "ctrl-c" / "checkpoints" / "step_00000004")


def test_a_second_ctrl_c_stops_at_once():
    from pretrain.preemption import StopOnSignal

    lines = []
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN when the suite runs as a background job)
    stop = StopOnSignal(["SIGTERM"], announce=lines.append)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signame == "SIGINT" and lines == [
            "SIGINT: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_signals_are_validated():
    with pytest.raises(ConfigError, match="SIGKILL.* is not a signal that can be caught"):
        load_config("baseline/tiny", ["train.stop_signals=[SIGKILL]"], check_data=False)
    with pytest.raises(ConfigError, match="grace_s"):
        load_config("baseline/tiny", ["checkpoint.grace_s=0"], check_data=False)
