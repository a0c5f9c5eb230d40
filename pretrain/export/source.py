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
    naming it). Loads the model tensors only (no optimizer), whatever layout saved them, and checks
    them against the model its config builds (names and shapes)."""
    from pretrain.checkpoint import CheckpointError, SavedModel, load_checkpoint, load_latest
    from pretrain.readers import read_with_fallback
    from pretrain.models import get_arch, weight_shapes
    from pretrain.runs import stored_config

    def read(ckpt: str, is_run: bool):  # again from a newer checkpoint if a trainer prunes this one meanwhile
        saved = SavedModel()
        if is_run:
            ckpt, _ = load_latest(path, saved, restore_rng=False, log=log, start=ckpt)
        else:
            load_checkpoint(ckpt, saved, restore_rng=False, log=log)
        return ckpt, saved, stored_config(ckpt, log=lambda _: None)

    ckpt, saved, (meta, cfg, run_dir) = read_with_fallback(path, read, log)
    saved.state = get_arch(cfg.model.arch).upgrade_state(saved.state, cfg.model)
    shapes = weight_shapes(cfg.model)
    for name, shape in shapes.items():
        got = tuple(saved.state[name].shape) if name in saved.state else None
        if got != shape:
            held = f"{name} of shape {got}" if got is not None else f"no tensor {name}"
            raise CheckpointError(f"checkpoint {ckpt} has {held}, but model.arch {cfg.model.arch!r} of its config has "
                                  f"{shape} (saved by an older version of the model, or a different model)")
    extra = sorted(set(saved.state) - set(shapes))
    if extra:
        raise CheckpointError(f"checkpoint {ckpt} has {extra[0]}, which model.arch {cfg.model.arch!r} of its config "
                              f"lacks (and {len(extra) - 1} more)")
    return Checkpointed(ckpt, run_dir, meta, cfg, saved.state)


def tied_aliases(model) -> dict[str, str]:
    """{name: the first name of the same tensor} for the state-dict names of `model` that share a
    tensor (a tied head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def check_output(out: str, force: bool, source: str | None = None) -> None:
    """Refuse, before any work, an output that exists (unless force), that cannot be created, or that
    is or holds the source (--force would delete what it reads)."""
    if source is not None and os.path.exists(source):
        src, dest = os.path.realpath(source), os.path.realpath(out)
        if os.path.commonpath([src, dest]) == dest:
            raise ValueError(f"{out} is or contains the source {source}; choose another output folder")
        if os.path.lexists(out) and os.path.commonpath([src, dest]) == src:  # replacing a part of the source
            raise ValueError(f"{out} is inside the source {source} and exists; choose another output folder")
    if os.path.lexists(out) and not force:
        raise ValueError(f"{out} already exists; pass --force to replace it")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} exists and is not a directory; it is not replaced")
    if os.path.isdir(out):  # a run directory a trainer holds (pretrain/runlock.py) is not replaced under it
        from pretrain.runlock import refuse_if_held

        refuse_if_held(out, "--force")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # created by atomic_folder; a file in the way is refused now
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{parent} is a file, so {out} cannot be created below it")


def _remove_leftovers(out: str) -> None:
    """Temporary or set-aside siblings of `out` left by killed processes (their pid is gone)."""
    from pretrain.runlock import pid_alive

    parent, name = os.path.split(out)
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:tmp|old)-(\d+)")
    for entry in os.listdir(parent):
        if (m := pattern.fullmatch(entry)) and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(out: str, force: bool, source: str | None = None):
    """Yield a temporary directory beside `out`; on success it replaces `out` (an existing one only
    with force, deleted after the swap), on any failure it is removed and `out` is untouched."""
    from data_tools.files import fsync_path

    check_output(out, force, source)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)  # like mkdir -p: exports/NAME needs no exports/ first
    _remove_leftovers(out)
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
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(aside, out)  # the old folder back in place
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_path(os.path.dirname(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
