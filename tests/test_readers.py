"""Retention with readers (issue 25 point 4): `pretrain eval`, `generate` and `export` read a checkpoint
that the trainer may prune meanwhile; they finish on it or read the newest complete one with a line,
never fail half-way nor read a mix; pruning never deletes the checkpoint `latest` names."""
import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from data_tools.files import atomic_write
from pretrain import checkpoint as ckpt
from pretrain import read_pins
from pretrain.config import load_config
from pretrain.export.source import read_checkpoint
from pretrain.generate import load_for_inference
from pretrain.trainer import Trainer
from trainer_helpers import tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(tmp, corpus, run_dir, steps, keep_last):
    return tiny_overrides(tmp, corpus, **{"train.run_dir": str(run_dir), "train.max_steps": steps,
                                          "train.eval_every": 0, "checkpoint.every": 1,
                                          "checkpoint.keep_last": keep_last, "train.compile": "false",
                                          "schedule.warmup_steps": 0})


def read_while_the_trainer_saves(tmp_path, corpus, monkeypatch, reader, once_pinned=False):
    """Read a run whose latest is step 2 while, mid-read (or, with `once_pinned`, just after the reader chose
    and pinned step 2), the trainer saves step 3 and applies keep_last=1; return (the checkpoints' root, the
    weights read, the reader's lines, the pins present then, {step: its weights})."""
    run = tmp_path / "run"
    Trainer(load_config("baseline/tiny", overrides(tmp_path, corpus, run, 3, 3)), log=lambda *_: None).fit()
    root = run / "checkpoints"
    want = {s: read_checkpoint(str(root / f"step_0000000{s}"), log=pytest.fail).state for s in (2, 3)}
    shutil.move(root / "step_00000003", tmp_path / "later")  # the trainer has not written step 3 yet
    atomic_write(str(root / "latest"), "step_00000002\n")
    real_load, lines, pins = ckpt.dcp.load, [], []

    def the_trainer_saves_and_prunes():
        if (tmp_path / "later").exists():  # step 3 appears, latest moves, keep_last=1 prunes the rest
            pins.extend(n for n in os.listdir(root) if n.startswith(".read-"))
            shutil.move(tmp_path / "later", root / "step_00000003")
            atomic_write(str(root / "latest"), "step_00000003\n")
            ckpt._retain(str(root), 3, 1, 0)

    def load(*args, **kwargs):
        the_trainer_saves_and_prunes()
        return real_load(*args, **kwargs)

    @contextlib.contextmanager
    def pinning(ckpt_path):
        with real_pinning(ckpt_path):
            the_trainer_saves_and_prunes()
            yield

    real_pinning = read_pins.pinning
    if once_pinned:  # a run's read must then load what it pinned, not whatever `latest` names by now
        monkeypatch.setattr(read_pins, "pinning", pinning)
    else:
        monkeypatch.setattr(ckpt.dcp, "load", load)
    if reader == "eval":
        model, *_ = load_for_inference(str(run), log=lines.append, need=())
        got = model.state_dict()
    else:
        got = read_checkpoint(str(run), log=lines.append).state
    return root, got, lines, pins, want


def assert_weights(got, want):
    for name, tensor in want.items():  # entirely one checkpoint's weights: no mix
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_a_checkpoint_pruned_during_the_read_is_read_from_the_newest(tmp_path, corpus, monkeypatch, reader):
    # a reader that cannot pin (a run directory it cannot write to) loses its checkpoint to retention
    monkeypatch.setattr(read_pins, "pinning", lambda ckpt: contextlib.nullcontext())
    root, got, lines, pins, want = read_while_the_trainer_saves(tmp_path, corpus, monkeypatch, reader)
    assert pins == [] and sorted(os.listdir(root)) == ["latest", "step_00000003"]
    assert any("step_00000002 was pruned by the trainer while being read; reading step_00000003 instead" in ln
               for ln in lines), lines
    assert_weights(got, want[3])


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_retention_keeps_the_checkpoint_a_reader_is_loading(tmp_path, corpus, monkeypatch, reader):
    root, got, lines, pins, want = read_while_the_trainer_saves(tmp_path, corpus, monkeypatch, reader)
    assert pins == [read_pins.pin_name("step_00000002")]
    assert not lines, lines  # finished on step 2, no fallback
    assert_weights(got, want[2])
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000003"]  # the pin is gone...
    ckpt._retain(str(root), 3, 1, 0)
    assert sorted(os.listdir(root)) == ["latest", "step_00000003"]  # ...so the next save prunes step 2


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_a_run_is_read_from_the_checkpoint_its_reader_pinned(tmp_path, corpus, monkeypatch, reader):
    root, got, lines, pins, want = read_while_the_trainer_saves(tmp_path, corpus, monkeypatch, reader,
                                                                once_pinned=True)
    assert pins == [read_pins.pin_name("step_00000002")] and not lines, lines
    assert_weights(got, want[2])


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_a_checkpoint_pruned_during_its_verification_is_not_called_corrupt(tmp_path, corpus, monkeypatch, reader):
    """Unpinned, a run read whose checkpoint is pruned while its checksums are checked reads the newest one;
    it does not fall back to an older kept one (keep_every) as if the pruned one were corrupt."""
    monkeypatch.setattr(read_pins, "pinning", lambda ckpt: contextlib.nullcontext())
    run = tmp_path / "run"
    Trainer(load_config("baseline/tiny", overrides(tmp_path, corpus, run, 4, 4)), log=lambda *_: None).fit()
    root = run / "checkpoints"
    want = read_checkpoint(str(root / "step_00000004"), log=pytest.fail).state
    shutil.move(root / "step_00000004", tmp_path / "later")
    atomic_write(str(root / "latest"), "step_00000003\n")
    real_verify = ckpt._verify

    def verify_while_the_trainer_saves(path, meta):
        if (tmp_path / "later").exists():  # step 4 appears; keep_last=1, keep_every=2 keep steps 2 and 4
            shutil.move(tmp_path / "later", root / "step_00000004")
            atomic_write(str(root / "latest"), "step_00000004\n")
            ckpt._retain(str(root), 4, 1, 2)
        return real_verify(path, meta)

    monkeypatch.setattr(ckpt, "_verify", verify_while_the_trainer_saves)
    lines = []
    if reader == "eval":
        got = load_for_inference(str(run), log=lines.append, need=())[0].state_dict()
    else:
        got = read_checkpoint(str(run), log=lines.append).state
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004"]
    assert lines == ["checkpoint step_00000003 was pruned by the trainer while being read; reading step_00000004 "
                     "instead"], lines
    assert_weights(got, want)


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_the_checkpoint_a_reader_falls_back_to_is_pinned_too(tmp_path, corpus, monkeypatch, reader):
    """The pinned checkpoint fails its checksums, so the read falls back to the one before it; a save with
    keep_last=1 during that load keeps both (the fallback is pinned like the first)."""
    from test_checkpoint_integrity import flip_byte_in_tensor_data

    run = tmp_path / "run"
    Trainer(load_config("baseline/tiny", overrides(tmp_path, corpus, run, 4, 4)), log=lambda *_: None).fit()
    root = run / "checkpoints"
    want = read_checkpoint(str(root / "step_00000002"), log=pytest.fail).state
    shutil.move(root / "step_00000004", tmp_path / "later")  # the trainer has not written step 4 yet
    atomic_write(str(root / "latest"), "step_00000003\n")
    bad = flip_byte_in_tensor_data(str(root / "step_00000003"))
    real_load, pins = ckpt.dcp.load, []

    def load_while_the_trainer_saves(*args, **kwargs):
        if (tmp_path / "later").exists():  # step 4 appears, latest moves, keep_last=1 prunes the rest
            pins.extend(sorted(n for n in os.listdir(root) if n.startswith(".read-")))
            shutil.move(tmp_path / "later", root / "step_00000004")
            atomic_write(str(root / "latest"), "step_00000004\n")
            ckpt._retain(str(root), 4, 1, 0)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "load", load_while_the_trainer_saves)
    lines = []
    if reader == "eval":
        got = load_for_inference(str(run), log=lines.append, need=())[0].state_dict()
    else:
        got = read_checkpoint(str(run), log=lines.append).state
    assert pins == sorted(read_pins.pin_name(f"step_0000000{s}") for s in (2, 3))
    assert lines == [f"checkpoint step_00000003 is corrupt ({bad} does not match the checksum recorded when it was "
                     "saved); falling back to step_00000002"], lines
    assert_weights(got, want)
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000003", "step_00000004"]  # pins gone


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_an_unusable_latest_is_said_once(tmp_path, corpus, reader):
    run = tmp_path / "run"
    Trainer(load_config("baseline/tiny", overrides(tmp_path, corpus, run, 2, 2)), log=lambda *_: None).fit()
    (run / "checkpoints" / "latest").unlink()
    lines = []
    if reader == "eval":
        load_for_inference(str(run), log=lines.append, need=())
    else:
        read_checkpoint(str(run), log=lines.append)
    assert lines == ["checkpoints/latest is missing; falling back to step_00000002"], lines


def test_pins_of_dead_readers_are_removed_and_old_pins_expire(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(str(tmp_path), step, model, None, {}, keep_last=5)
    root = tmp_path / "checkpoints"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    here, mine = read_pins._process_space(), read_pins.pin_name("step_00000002")
    elsewhere = f".read-step_00000003-other-host-{dead}"  # a pid that is dead here means nothing there
    for name in (f".read-step_00000001-{here}-{dead}", mine, elsewhere):
        (root / name).touch()
    ckpt._retain(str(root), 4, 1, 0)  # the dead reader's pin goes, with its checkpoint; the others keep theirs
    assert sorted(os.listdir(root)) == [mine, elsewhere, "latest", "step_00000002", "step_00000003",
                                        "step_00000004"]
    old = time.time() - read_pins.PIN_S - 1
    os.utime(root / elsewhere, (old, old))  # that host's reader was killed an hour ago
    os.utime(root / mine, (old, old))  # a live pid, but not a reader any more (a reused pid)
    ckpt._retain(str(root), 4, 1, 0)  # pins older than an hour count no more, and go
    assert sorted(os.listdir(root)) == ["latest", "step_00000004"]


def test_a_pin_sits_beside_the_checkpoint_however_it_is_named(tmp_path):
    (tmp_path / "checkpoints" / "step_00000007").mkdir(parents=True)
    (tmp_path / "copy").mkdir()
    pin = read_pins.pin_name("step_00000007")
    with read_pins.pinning(str(tmp_path / "checkpoints" / "step_00000007") + "/"):  # a trailing slash, as typed
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [pin, "step_00000007"]
        assert os.listdir(tmp_path / "checkpoints" / "step_00000007") == []  # never inside the checkpoint
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000007"]
    with read_pins.pinning(str(tmp_path / "copy")):  # not a name retention prunes: nothing to pin
        assert sorted(os.listdir(tmp_path)) == ["checkpoints", "copy"]


def test_a_checkpoint_that_is_still_there_keeps_its_own_error(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(load_config("baseline/tiny", overrides(tmp_path, corpus, run, 1, 1)), log=lambda *_: None).fit()
    (run / "checkpoints" / "step_00000001" / "optim.json").unlink()  # damaged, not pruned
    with pytest.raises(ckpt.CheckpointError, match="step_00000001"):
        read_checkpoint(str(run / "checkpoints" / "step_00000001"), log=lambda _: None)


def test_pruning_never_deletes_what_latest_names(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(str(tmp_path), step, model, None, {}, keep_last=5)
    root = tmp_path / "checkpoints"
    atomic_write(str(root / "latest"), "step_00000001\n")  # say a reader's fallback or an operator moved it
    ckpt._retain(str(root), 3, 1, 0)
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000003"]


def test_evals_while_a_trainer_prunes_every_step(tmp_path, corpus):
    """Real processes: a trainer saving every step with keep_last=1 and evaluations reading the run."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny",
                                *overrides(tmp_path, corpus, run, 60, 1)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (run / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        evals = 0
        while trainer.poll() is None and evals < 4:
            out = subprocess.run([sys.executable, "-m", "pretrain.cli", "eval", str(run), "--batches", "1"],
                                 env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines()[-1].startswith("val loss"), out.stdout  # after any fallback lines
            assert all(ln.startswith(("val loss", "checkpoint step_")) for ln in out.stdout.splitlines()), out.stdout
            evals += 1
        assert evals >= 1
    finally:
        trainer.kill()
        trainer.wait()
