"""A directory cache of numpy index arrays, built once per key and safe under concurrent ranks.

Every rank of a job constructs the same datasets at the same moment, so the first call for a key
races. The protocol:

1. If `<root>/<key>/` exists it is complete (it only ever appears by an atomic rename): load it
   without taking any lock.
2. Otherwise take an exclusive `flock` on `<root>/<key>.lock`, so one process builds while the
   others wait, and re-check: the winner may have published while we waited.
3. Build into a unique temporary directory inside `<root>` (same filesystem, so the rename is
   atomic), fsync every file and the directory, then `os.rename` it to `<root>/<key>`.
   If the rename fails because the final directory now exists, another process won a race the lock
   did not prevent (e.g. a filesystem whose flock is a no-op): its arrays are identical, use them.

Arrays are loaded with `np.load(mmap_mode="r")`, so a cache shared by 8 ranks on a node is paged in
once.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable

import numpy as np

from data_tools.errors import first_line
from data_tools.files import fsync_path, write_file

META_FILE = "key.json"  # the inputs the key was derived from, for humans debugging a cache


def canonical_json(obj) -> str:
    """JSON with sorted keys and no whitespace: equal inputs always give equal bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def stable_hash(obj) -> str:
    """sha256 hex digest of the canonical JSON of `obj` (never Python's salted `hash()`)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _load(final: str, names: list[str]) -> dict[str, np.ndarray]:
    try:
        return {n: np.load(os.path.join(final, n + ".npy"), mmap_mode="r") for n in names}
    except (OSError, ValueError, EOFError) as e:  # a damaged or hand-edited cache entry
        raise OSError(f"index cache {final} is unreadable ({first_line(e)}); delete that directory to rebuild it") from e


def _publish(root: str, key: str, inputs, build: Callable[[], dict[str, np.ndarray]]) -> bool:
    """Build into a temp dir and rename it to `<root>/<key>`; False if another process won."""
    final = os.path.join(root, key)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=root)
    try:
        arrays = build()
        for name, arr in arrays.items():
            path = os.path.join(tmp, name + ".npy")
            np.save(path, np.ascontiguousarray(arr))
            fsync_path(path)
        write_file(os.path.join(tmp, META_FILE), canonical_json(inputs))
        fsync_path(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            # Linux reports an existing non-empty target as ENOTEMPTY, some systems as EEXIST.
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isdir(final):
                return False
            raise
        fsync_path(root)  # make the new directory entry durable
        return True
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def load_or_build(
    root: str,
    inputs,
    build: Callable[[], dict[str, np.ndarray]],
    names: list[str],
    *,
    _lock: bool = True,
) -> tuple[dict[str, np.ndarray], bool, str]:
    """Arrays cached under the hash of `inputs`, building them with `build()` on a miss.

    Returns (arrays memory-mapped read-only, whether this call built them, the cache directory).
    `_lock=False` skips the flock (tests use it to show the atomic rename alone is enough).
    """
    key = stable_hash(inputs)
    final = os.path.join(root, key)
    if os.path.isdir(final):  # published directories are complete: no lock needed
        return _load(final, names), False, final
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"cannot create the index cache directory {root!r} ({e.strerror}); "
            "pass cache_dir= pointing to a writable directory"
        ) from e
    built = False
    if _lock:
        with open(final + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not os.path.isdir(final):  # the previous holder may have published it
                    built = _publish(root, key, inputs, build)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    else:
        built = _publish(root, key, inputs, build)
    return _load(final, names), built, final
