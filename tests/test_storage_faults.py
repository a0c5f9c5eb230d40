"""Storage faults in one sentence (data_tools/storage.py): a full disk during a checkpoint, an export and
a preprocess, through the CLI in real subprocesses, on a small tmpfs where this machine lets the tests
mount one (as root) and otherwise with the fault injected into the writer; a read-only filesystem; the
metrics. Each: one sentence naming the operation, the path and (for space) the bytes needed and free,
exit code 74, no partial files, the previous checkpoint still `latest` and a resume elsewhere that
continues to the same losses as an uninterrupted run."""
import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch

from data_tools.storage import EXIT_STORAGE, StorageError, find_os_error, storage_operation, tree_bytes
from pretrain import checkpoint as ckpt
from pretrain.checkpoint import latest_checkpoint, save_checkpoint
from pretrain.metrics import MetricsLog
from trainer_helpers import step_losses, tiny_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


class SmallFS:
    """A tmpfs of `size` bytes mounted at `path` (None when this machine does not allow it)."""

    def __init__(self, path, size):
        self.path = str(path)
        os.makedirs(self.path, exist_ok=True)
        size = -(-size // 4096) * 4096
        ok = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", self.path], capture_output=True).returncode == 0
        self.mounted = bool(ok)

    def readonly(self):
        subprocess.run(["mount", "-o", "remount,ro", self.path], check=True)

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    made = []

    def make(size):
        fs = SmallFS(tmp_path / f"fs{len(made)}", size)
        made.append(fs)
        return fs

    yield make
    for fs in made:
        fs.close()


def train(tmp_path, corpus, run_dir, steps=4, extra=()):
    over = tiny_overrides(tmp_path, corpus, **{"train.run_dir": str(run_dir), "train.max_steps": steps,
                                                "train.eval_every": 0, "checkpoint.every": 1, "checkpoint.keep_last": 1,
                                                "train.compile": "false"})
    return subprocess.run([sys.executable, "-m", "pretrain.cli", "train", "baseline/tiny", *over, *extra],
                          env=ENV, capture_output=True, text=True, timeout=300)


def test_disk_full_during_a_checkpoint_is_one_sentence_and_the_run_resumes_exactly(tmp_path, corpus, small_fs):
    whole = train(tmp_path, corpus, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    size = tree_bytes(str(tmp_path / "whole" / "checkpoints" / "step_00000004"))
    fs = small_fs(int(1.5 * size) + 96 * 1024)  # one checkpoint fits; the next (written before pruning) does not
    if not fs.mounted:
        pytest.skip("needs a small tmpfs (mount as root), which this machine refuses; the in-process tests of "
                    "this file inject the same fault into the writer")
    run = os.path.join(fs.path, "run")
    out = train(tmp_path, corpus, run)
    assert out.returncode == EXIT_STORAGE, out.stderr
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("pretrain train: error:")]
    assert len(error) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "saving checkpoint step 2 failed: the disk is full" in error[0] and "needs about" in error[0] \
        and "MB free" in error[0] and os.path.join(run, "checkpoints") in error[0], error[0]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_00000001"]  # no partial files
    assert latest_checkpoint(run, log=pytest.fail).endswith("step_00000001")
    moved = tmp_path / "moved"  # resumed elsewhere, to the end: the same losses as the uninterrupted run
    shutil.copytree(run, moved)
    resumed = train(tmp_path, corpus, moved)
    assert resumed.returncode == 0, resumed.stderr
    assert step_losses(moved) == step_losses(tmp_path / "whole")


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def test_a_real_out_of_space_inside_the_checkpoint_writer(tmp_path, small_fs, monkeypatch):
    """Past the space check (disabled here), torch.distributed.checkpoint itself meets ENOSPC."""
    model, opt = model_and_optimizer()
    fs = small_fs(48 * 1024)
    if not fs.mounted:  # the fault injected where DCP writes
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(ckpt.dcp, "save", full)
        where = str(tmp_path / "run")
    else:
        where = os.path.join(fs.path, "run")
        save_checkpoint(where, 1, torch.nn.Linear(4, 4), None, {})  # a small one fits
    monkeypatch.setattr(ckpt, "check_space", lambda *a, **k: None)
    with pytest.raises(StorageError) as e:
        save_checkpoint(where, 2, model, opt, {})
    assert str(e.value).startswith("saving checkpoint step 2 failed: the disk is full (") and "\n" not in str(e.value)
    left = sorted(os.listdir(os.path.join(where, "checkpoints")))
    assert not any(n.startswith(".") for n in left), left  # the temporary directory is gone


def test_read_only_filesystem_and_injected_faults(tmp_path, small_fs, monkeypatch):
    model, opt = model_and_optimizer()
    fs = small_fs(1 << 20)
    if fs.mounted:
        where = os.path.join(fs.path, "run")
        first = save_checkpoint(where, 1, model, opt, {})
        fs.readonly()
        with pytest.raises(StorageError, match=r"^saving checkpoint step 2 failed: the filesystem is read-only \("):
            save_checkpoint(where, 2, model, opt, {})
        assert latest_checkpoint(where, log=pytest.fail) == first
    # any of the errnos, injected into the leader's last writes: one sentence, latest unchanged
    where = str(tmp_path / "injected")
    first = save_checkpoint(where, 1, model, opt, {})
    for code, reason in ((errno.EDQUOT, "the disk quota is exceeded"), (errno.EACCES, "permission is denied")):
        def fail(path, text, code=code):
            raise OSError(code, os.strerror(code), path)
        monkeypatch.setattr(ckpt, "_write_file", fail)
        with pytest.raises(StorageError, match=f"^saving checkpoint step 2 failed: {reason} "):
            save_checkpoint(where, 2, model, opt, {})
        assert latest_checkpoint(where, log=pytest.fail) == first
        assert sorted(os.listdir(os.path.join(where, "checkpoints"))) == ["latest", "step_00000001"]


def test_metrics_and_unrelated_errors(tmp_path, monkeypatch):
    log = MetricsLog(str(tmp_path))

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    log._f = Full()
    with pytest.raises(StorageError, match=r"^writing the metrics of step 7 failed: the disk is full \("):
        log.write({"step": 7, "loss": 1.0})
    with pytest.raises(ValueError, match="not storage"):  # anything else keeps its own exception
        with storage_operation("x", str(tmp_path)):
            raise ValueError("not storage")
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert find_os_error(wrapped).errno == errno.EROFS


def test_export_and_preprocess_to_a_full_disk(tmp_path, corpus, small_fs):
    fs = small_fs(64 * 1024)
    if not fs.mounted:
        pytest.skip("needs a small tmpfs (mount as root), which this machine refuses")
    run = tmp_path / "run"
    assert train(tmp_path, corpus, run).returncode == 0
    out = subprocess.run([sys.executable, "-m", "pretrain.cli", "export", str(run), os.path.join(fs.path, "exp")],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == EXIT_STORAGE and "Traceback" not in out.stderr, out.stderr
    assert f"exporting {run} to {os.path.join(fs.path, 'exp')} failed: the disk is full" in out.stderr
    assert os.listdir(fs.path) == []  # nothing partial left
    text = tmp_path / "big.txt"
    text.write_text(" ".join(f"word{i % 50}" for i in range(200_000)))
    from trainer_helpers import write_word_tokenizer

    tok = write_word_tokenizer(tmp_path / "tok.json")
    pre = subprocess.run([sys.executable, "-m", "data_tools.cli", "preprocess", "--input", str(text),
                          "--output-prefix", os.path.join(fs.path, "data"), "--tokenizer-model", tok],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert pre.returncode == EXIT_STORAGE and "Traceback" not in pre.stderr, pre.stderr
    assert f"preprocessing into {os.path.join(fs.path, 'data')} failed: the disk is full" in pre.stderr
