"""Pins: how a reader of a checkpoint keeps the trainer's retention off it (pretrain/readers.py makes them,
pretrain/checkpoint.py's retention honours them).

A pin is an empty file `checkpoints/.read-step_X-<host>~<pid namespace>-<pid>` beside the checkpoint,
made before the read and removed after. It counts for at most PIN_S after it was made and, where its
process can be asked (the same host and PID namespace), only while that process lives; retention removes
the pins that no longer count. Without pins a reader slower than the saves could lose every race to a
run saving each step with keep_last=1.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import time

from pretrain.runlock import pid_alive

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


def pin_name(checkpoint_name: str) -> str:
    return f".read-{checkpoint_name}-{_process_space()}-{os.getpid()}"


def pinned(root: str) -> tuple[set[str], list[str]]:
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
            live = time.time() - os.stat(path).st_mtime < PIN_S and (m.group(2) != space or pid_alive(int(m.group(3))))
        except OSError:  # its reader just removed it
            continue
        if live:
            names.add(m.group(1))
        else:
            stale.append(path)
    return names, stale


@contextlib.contextmanager
def pinning(ckpt: str):
    """Pin checkpoint `ckpt` for the duration; a directory this process cannot write to reads unpinned, as
    does a checkpoint not named like one that retention prunes (a copy elsewhere)."""
    parent, name = os.path.split(os.path.normpath(ckpt))
    pin = os.path.join(parent, pin_name(name)) if _STEP_NAME.fullmatch(name) else None
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
