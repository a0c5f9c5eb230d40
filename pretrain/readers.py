"""Reading a checkpoint that a running trainer may prune: what `pretrain eval`, `generate` and `export`
do through `read_with_fallback`.

Retention (checkpoint.keep_last / keep_every) renames an old checkpoint aside and deletes it while
readers may be loading it; files are never changed in place, so a read either finishes on the files it
opened, or fails on one that is gone. A failed read of a checkpoint that has since vanished (or been
replaced at the same path: a re-save swapped in) is not an error: it is read again from the newest
complete checkpoint of the same run, with a line saying so. A checkpoint that is still there and
fails keeps its own error (corrupt, incomplete, a wrong architecture).

A reader also pins what it reads: an empty file `checkpoints/.read-step_X-<host>~<pid namespace>-<pid>`,
made before the read and removed after, which retention honours (`pinned`) for at most PIN_S after it
was made and, where its process can be asked (the same host and PID namespace), only while that
process lives. So a reader slower than the trainer's saves still finishes: without pins it could lose
every race to a run saving each step with keep_last=1. The fallback stays for what a pin cannot cover: a run directory this process cannot write
to, and the instant between choosing a checkpoint and pinning it.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from typing import Callable, TypeVar

T = TypeVar("T")
ATTEMPTS = 10  # a reader that loses this many races in a row is told so (each is a whole save apart)
PIN_S = 3600.0  # the longest a pin counts: a read takes seconds to minutes; another host's reader cannot be asked
_PIN = re.compile(r"\.read-(step_\d+)-(.+)-(\d+)")
_STEP_NAME = re.compile(r"step_\d+")


def _process_space() -> str:
    """Where a pin's process id means something: the host, and the PID namespace where there is one (a
    container may share the host's name but not its process ids)."""
    try:
        return f"{socket.gethostname()}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def _pin_name(checkpoint_name: str) -> str:
    return f".read-{checkpoint_name}-{_process_space()}-{os.getpid()}"


def pinned(root: str, alive: Callable[[int], bool]) -> tuple[set[str], list[str]]:
    """(the checkpoint names in `root` that readers pin now, the paths of pins to remove). A pin counts for
    PIN_S after it was made, and where its process id can be asked (same host and PID namespace) only
    while that process lives; so a reader killed before it could remove its pin, on any host, or a pid
    reused by another program, holds a checkpoint for an hour at most."""
    names, stale, space = set(), [], _process_space()
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        if not (m := _PIN.fullmatch(entry)):
            continue
        path = os.path.join(root, entry)
        try:
            live = time.time() - os.stat(path).st_mtime < PIN_S and (m.group(2) != space or alive(int(m.group(3))))
        except OSError:  # its reader just removed it
            continue
        if live:
            names.add(m.group(1))
        else:
            stale.append(path)
    return names, stale


@contextlib.contextmanager
def _pinning(ckpt: str):
    """Pin checkpoint `ckpt` for the duration; a directory this process cannot write to reads unpinned, as
    does a checkpoint not named like one that retention prunes (a copy elsewhere)."""
    parent, name = os.path.split(os.path.normpath(ckpt))
    pin = os.path.join(parent, _pin_name(name)) if _STEP_NAME.fullmatch(name) else None
    try:
        if pin is not None:
            open(pin, "w").close()  # "w": a dead namesake's pin (same host and pid) is taken over, fresh
    except OSError:
        pin = None
    try:
        yield
    finally:
        if pin is not None:
            with contextlib.suppress(OSError):
                os.unlink(pin)


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
            with _pinning(ckpt):
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
