"""What export and import read: a run's checkpoint as full single-device tensors, and a folder written
atomically (a temporary sibling renamed into place at the end, so no partial folder is ever left).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any


@dataclass
class Checkpointed:
    """A checkpoint's model weights, full and named as in the single-device model, with its run."""

    checkpoint: str  # the checkpoint directory read
    run_dir: str  # the run it belongs to (its config's paths are found relative to it)
    meta: dict
    cfg: Any  # the stored RunConfig, paths relocated
    state: dict  # {state_dict name: tensor}, every name the model's state_dict has


def read_checkpoint(path: str, log=print) -> Checkpointed:
    """The newest verified checkpoint of run directory `path` (falling back past a corrupt one with a
    line, as eval does), or checkpoint directory `path` (a corrupt or half-written file is an error
    naming it). Loads the model tensors only (no optimizer), whatever layout saved them."""
    from pretrain.checkpoint import META_FILE, CheckpointError, SavedModel, incomplete, load_checkpoint, load_latest
    from pretrain.config import config_from_dict
    from pretrain.runs import relocate

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    saved = SavedModel()
    looks_like_one = os.path.isfile(os.path.join(path, ".metadata")) or re.fullmatch(r"step_\d+", os.path.basename(
        os.path.normpath(path)))
    if os.path.isfile(os.path.join(path, META_FILE)) or looks_like_one:
        if (why := incomplete(path)) is not None:
            raise CheckpointError(f"checkpoint {path} {why}")
        meta = load_checkpoint(path, saved, restore_rng=False, log=log)
        ckpt = path
    else:
        ckpt, meta = load_latest(path, saved, restore_rng=False, log=log)
        if ckpt is None:
            raise ValueError(f"{path} is neither a checkpoint directory nor a run directory with a complete "
                             "checkpoint")
    stored = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(stored, dict) or not isinstance(stored.get("model"), dict):
        raise CheckpointError(f"checkpoint {ckpt} holds no run config in its {META_FILE}")
    cfg = config_from_dict(stored)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    relocate(cfg, run_dir, log)
    return Checkpointed(ckpt, run_dir, meta, cfg, saved.state)


def tied_aliases(arch: str, model_cfg) -> dict[str, str]:
    """{name: the first name of the same tensor} for state-dict names that share a tensor (a tied
    head), found by building the single-device model on the meta device."""
    import torch

    from parallel.mesh import single_device
    from pretrain.models import get_arch

    with torch.device("meta"), single_device():
        sd = get_arch(arch).build(model_cfg).state_dict(keep_vars=True)
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in sd.items():
        key = id(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def check_output(out: str, force: bool) -> None:
    """Refuse an output that exists (unless force) or that cannot be created, before any work."""
    if os.path.lexists(out) and not force:
        raise ValueError(f"{out} already exists; pass --force to replace it")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} exists and is not a directory; it is not replaced")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # created by atomic_folder; a file in the way is refused now
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{parent} is a file, so {out} cannot be created below it")


@contextlib.contextmanager
def atomic_folder(out: str, force: bool):
    """Yield a temporary directory beside `out`; on success it replaces `out` (an existing one only
    with force, deleted after the swap), on any failure it is removed and `out` is untouched."""
    from data_tools.files import fsync_path

    check_output(out, force)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)  # like mkdir -p: exports/NAME needs no exports/ first
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        for dirpath, _, files in os.walk(tmp):
            for f in files:
                fsync_path(os.path.join(dirpath, f))
            fsync_path(dirpath)
        if os.path.lexists(out):
            aside = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{os.getpid()}")
            os.rename(out, aside)
            os.rename(tmp, out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_path(os.path.dirname(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
