"""Reading a checkpoint that a running trainer may prune: what `pretrain eval`, `generate` and `export`
do through `read_with_fallback`.

Retention (checkpoint.keep_last / keep_every) renames an old checkpoint aside and deletes it while
readers may be loading it; files are never changed in place, so a read either finishes on the files it
opened, or fails on one that is gone. A failed read of a checkpoint that has since vanished (or been
replaced at the same path: a re-save swapped in) is not an error: it is read again from the newest
complete checkpoint of the same run, with a line saying so. A checkpoint that is still there and
fails keeps its own error (corrupt, incomplete, a wrong architecture).

A reader also pins what it reads (pretrain/read_pins.py), and retention keeps a pinned checkpoint, so a
reader slower than the trainer's saves still finishes. The fallback stays for what a pin cannot cover:
a run directory this process cannot write to, and the instant between choosing a checkpoint and
pinning it.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

from pretrain import read_pins

T = TypeVar("T")
ATTEMPTS = 10  # a reader that loses this many races in a row is told so (each is a whole save apart)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def read_with_fallback(path: str, read: Callable[[str, bool], T], log=print) -> T:
    """read(checkpoint, is_run) on the checkpoint `path` names (pretrain.checkpoint.checkpoint_to_read);
    when that checkpoint is pruned or replaced under the read, read(newest complete, False) instead."""
    from pretrain.checkpoint import CheckpointError, checkpoint_to_read, latest_checkpoint

    ckpt, is_run = checkpoint_to_read(path, log=log)
    run_dir = path if is_run else os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    for attempt in range(ATTEMPTS):
        before = _identity(ckpt)
        try:
            with read_pins.pinning(ckpt):
                # pinned after `before`: a prune in between shows as a changed identity, as during the read
                result = read(ckpt, is_run)
        except (CheckpointError, OSError) as e:
            after = _identity(ckpt)
            if after is not None and after == before:
                raise  # still there, unchanged: its own problem
            problem, error = ("was pruned" if after is None else "was replaced"), e
        else:
            after = _identity(ckpt)
            if after is None or after == before:  # finished on the files it opened
                return result
            problem, error = "was replaced", None
        newer = latest_checkpoint(run_dir, log=lambda _: None)
        if newer is None:
            raise error or CheckpointError(f"checkpoint {ckpt} {problem} while being read, and {run_dir} has no "
                                           "other complete checkpoint")
        log(f"checkpoint {os.path.basename(ckpt)} {problem} by the trainer while being read; reading "
            f"{os.path.basename(newer)} instead")
        ckpt, is_run = newer, False
    raise CheckpointError(f"{path}: the trainer pruned {ATTEMPTS} checkpoints in a row while they were being read; "
                          "raise checkpoint.keep_last, or read a checkpoint kept by checkpoint.keep_every")
