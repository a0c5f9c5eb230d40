"""Storage faults in one sentence: a full disk, an exceeded quota, a read-only, vanished or forbidden
directory, met while writing a checkpoint, the metrics, a tokenizer copy, an export or a preprocessed
dataset, become a `StorageError` that names the operation, the path and (for space) the bytes needed
and free, instead of a traceback from whichever library was writing (torch.distributed.checkpoint
wraps the OSError of every rank in its own exception).

    with storage_operation("saving checkpoint step 100", path, needed=bytes_estimate):
        ... write ...

Only these errnos are translated; any other failure keeps its traceback. The callers remove their
partial files (they write into temporaries and rename) and the CLIs exit with EXIT_STORAGE, which says
that nothing already written was lost and that the same command resumes once the storage is fixed.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil

EXIT_STORAGE = 74  # EX_IOERR (sysexits.h): a storage fault; nothing lost, the same command resumes

REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "permission is denied",
    errno.ENOENT: "a directory it writes into vanished",
    errno.ESTALE: "the file handle went stale (the directory was removed or the share remounted)",
}
_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageError(OSError):
    """A storage fault, in one sentence (str(e)); `errno` is the underlying one."""

    def __str__(self) -> str:  # the sentence alone, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


def find_os_error(e: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError with a storage errno behind `e`: itself, its cause or context, or one of the
    per-rank failures torch.distributed.checkpoint collects (CheckpointException.failures)."""
    if e is None or depth > 8:
        return None
    if isinstance(e, OSError) and e.errno in REASONS:
        return e
    for inner in getattr(e, "failures", {}).values() if isinstance(getattr(e, "failures", None), dict) else ():
        found = find_os_error(inner[0] if isinstance(inner, tuple) else inner, depth + 1)
        if found is not None:
            return found
    return find_os_error(e.__cause__, depth + 1) or find_os_error(e.__context__, depth + 1)


def free_bytes(path: str) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem holding `path` (its nearest existing
    ancestor); None when it cannot be asked."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def describe(operation: str, path: str, code: int, needed: int | None = None) -> str:
    """"<operation> failed: <reason> (<path>; needs about X MB, Y MB free)"."""
    detail = [path]
    if code in _SPACE:
        free = free_bytes(path)
        if needed:
            detail.append(f"needs about {mb(needed)}")
        if free is not None:
            detail.append(f"{mb(free)} free")
    return f"{operation} failed: {REASONS.get(code, os.strerror(code))} ({'; '.join(detail)})"


@contextlib.contextmanager
def storage_operation(operation: str, path: str, needed: int | None = None):
    """Turns a storage fault raised inside into a StorageError naming `operation` and `path`."""
    try:
        yield
    except StorageError:
        raise
    except BaseException as e:  # noqa: BLE001 - only storage errnos are translated, the rest re-raised
        found = find_os_error(e)
        if found is None:
            raise
        raise StorageError(found.errno, describe(operation, getattr(found, "filename", None) or path,
                                                 found.errno, needed)) from None


def check_space(operation: str, path: str, needed: int, margin: float = 1.05) -> None:
    """StorageError before anything is written when the filesystem of `path` has less than `needed`
    bytes (times a margin for file-system overhead) free."""
    free = free_bytes(path)
    if free is not None and free < needed * margin:
        raise StorageError(errno.ENOSPC, describe(operation, path, errno.ENOSPC, needed))


def tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total
