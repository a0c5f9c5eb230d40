"""Checkpoint integrity: xxh3-128 checksums of every file but meta.json, taken at save (each rank
hashes the DCP files it wrote itself, the leader the rest) and verified at load (each rank a share of
the files, all learning the result). See pretrain/checkpoint.py."""
from __future__ import annotations

import os

import torch.distributed as dist

from data_tools.files import file_checksum

CHECKSUM = "xxh3_128"  # ~10 GB/s: verification costs a read of the files, little more
META_FILE = "meta.json"


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank_checksums(tmp: str, multi: bool) -> dict[str, str]:
    """Checksums of the DCP files each rank wrote itself (named `__<rank>_*`, visible to it whatever
    the filesystem's caching), gathered on every rank; collective under several ranks."""
    if not multi:
        return {}
    own = f"__{dist.get_rank()}_"
    mine = {n: file_checksum(os.path.join(tmp, n)) for n in os.listdir(tmp) if n.startswith(own)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _remaining_checksums(tmp: str, sums: dict[str, str]) -> dict[str, str]:
    """The leader's: `sums` plus the files in `tmp` nobody claimed (all of them on one process)."""
    sums = dict(sums)
    for n in os.listdir(tmp):
        if n not in sums and n != META_FILE and os.path.isfile(os.path.join(tmp, n)):
            sums[n] = file_checksum(os.path.join(tmp, n))
    return dict(sorted(sums.items()))


def _verify(path: str, meta: dict) -> str | None:
    """None if every file meta.json lists matches its checksum, else the problem (following the
    checkpoint's name). Collective under several ranks: each checks a share, all learn the result."""
    record = meta.get("checksums")
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None  # checked by the caller: an unverifiable checkpoint is said, not refused
    if record.get("algorithm") != CHECKSUM:
        return f"has checksums of an unknown algorithm {str(record.get('algorithm'))[:40]!r}"
    names = sorted(record["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if _multi() else (0, 1)
    problems = {}
    for name in names[rank::world]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems[name] = f"is incomplete (file {name} is missing)"
        elif file_checksum(file) != record["files"][name]:
            problems[name] = f"is corrupt ({name} does not match the checksum recorded when it was saved)"
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, problems)
        problems = {k: v for part in parts for k, v in part.items()}
    return problems[min(problems)] if problems else None
