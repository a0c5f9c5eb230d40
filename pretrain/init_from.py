"""Starting a run from another run's trained weights (`checkpoint.init_from`), across architectures
through the registry.

    checkpoint.init_from = a run directory (its latest verified checkpoint) or a checkpoint directory

A run with no checkpoint of its own loads the source's model weights before its first step: the
optimizer, the step, the data position and the RNG stay a new run's. The same architecture loads the
weights as they are (the shapes must match); another one goes through the target architecture's
registry `convert(source_arch, source_cfg, source_state, target_cfg)`. `check` runs inside
RunConfig.validate and decides everything on the meta device (the source's stored config, both
models' shapes, the conversion's output) before any work; `load_initial_weights` then does the same
with the real tensors, through the checkpoint code's own load path (verification, fallback to an
older checkpoint, the engine's checkpoint view that re-splits full tensors into any layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class Source:
    """What checkpoint.init_from names: the checkpoint read now, and how its weights become the run's."""

    given: str  # checkpoint.init_from as configured
    checkpoint: str  # the checkpoint directory (for a run directory: its latest complete one)
    is_run: bool  # a run directory: loading falls back past a corrupt newest checkpoint
    arch: str  # the source's model.arch
    model: Any  # the source's model config
    convert: Any  # the target architecture's convert, or None for the same architecture


def _quiet(_line: str) -> None:
    pass


def applies(cfg) -> bool:
    """init_from is set and the run has no checkpoint of its own (when it has one, resuming wins)."""
    from pretrain.checkpoint import latest_checkpoint

    return bool(cfg.checkpoint.init_from) and latest_checkpoint(cfg.train.run_dir, log=_quiet) is None


def resolve(cfg) -> Source:
    """The source checkpoint.init_from names and its stored config; ConfigError (one sentence naming
    it) when it is missing, not a checkpoint, unreadable, or of an unknown architecture."""
    from pretrain.checkpoint import CheckpointError, checkpoint_to_read
    from pretrain.run_config import ConfigError
    from pretrain.models import get_arch
    from pretrain.runs import stored_config

    given = cfg.checkpoint.init_from
    name = f"checkpoint.init_from {given!r}"
    if not os.path.exists(given):
        raise ConfigError(f"{name} does not exist")
    try:
        path, is_run = checkpoint_to_read(given)
        source = stored_config(path, log=_quiet)[1].model
    except (CheckpointError, ValueError) as e:  # ConfigError and an unknown model.arch are ValueErrors
        raise ConfigError(f"{name} cannot be used: {e}") from None
    spec = get_arch(cfg.model.arch)
    convert = None
    if source.arch != cfg.model.arch:
        if not spec.converts:
            raise ConfigError(f"{name} holds model.arch {source.arch!r}, and model.arch {cfg.model.arch!r} has no "
                              "conversion from another architecture (no `convert` in its registry entry)")
        convert = spec.convert
    return Source(given, path, is_run, source.arch, source, convert)


def check(cfg) -> None:
    """RunConfig.validate's part: when init_from applies, its weights fit this run's model (the same
    shapes, or a conversion that succeeds and returns them), decided on the meta device."""
    if not applies(cfg):
        return
    from pretrain.models import meta_model, weight_shapes

    source = resolve(cfg)
    state_for(source, cfg, meta_model(source.model).state_dict(), weight_shapes(cfg.model))


def state_for(source: Source, cfg, state: dict, shapes: dict, name: str = "") -> dict:
    """The run's initial state from the source's `state` (converted when the architectures differ),
    checked against the model's `shapes`; ConfigError naming the source (`name`, by default
    "checkpoint.init_from PATH") and the first tensor that does not fit."""
    from pretrain.run_config import ConfigError

    name = name or f"checkpoint.init_from {source.given!r}"
    if source.convert is not None:
        from parallel.mesh import single_device

        try:  # single_device: a conversion may build a model of its own (for fresh initial values) unsplit
            with single_device():
                state = source.convert(source.arch, source.model, state, cfg.model)
        except ValueError as e:
            raise ConfigError(f"{name}: model.arch {source.arch!r} cannot be converted to {cfg.model.arch!r} "
                              f"({str(e).rstrip('.')})") from None
        there = f"the conversion from {source.arch!r} returns"
    else:
        there = "the source has"
    for key, shape in shapes.items():  # in the model's order: the first mismatch is named
        got = tuple(state[key].shape) if key in state else None
        if got != shape:
            held = f"{key} of shape {got}" if got is not None else f"no {key}"
            raise ConfigError(f"{name}: {there} {held}, this run's model has {shape} (its model.* fields must "
                              "match the source's)")
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise ConfigError(f"{name}: {there} {extra[0]}, which this run's model lacks (and {len(extra) - 1} more)")
    return state


def load_initial_weights(cfg, engine, log=print) -> str:
    """Load the weights init_from names into `engine` (a checkpoint view: the engine of any layout);
    return the line saying where they came from. Only the model is touched."""
    from parallel.state import WeightsOnly
    from pretrain.checkpoint import CheckpointError, SavedModel, load_checkpoint, load_latest

    source = resolve(cfg)
    view = WeightsOnly(engine)

    def load(target, arch):
        kw = dict(restore_rng=False, expect_arch=arch, verify=cfg.checkpoint.verify, log=log)
        if source.is_run:
            path, _ = load_latest(source.given, target, **kw)
            if path is None:  # (validate saw one: it was removed since)
                raise CheckpointError(f"checkpoint.init_from {source.given!r} has no complete checkpoint any more")
            return path
        load_checkpoint(source.given, target, **kw)
        return source.given

    if source.convert is None:
        path = load(view, cfg.model.arch)
        how = ""
    else:  # the saved tensors as they are, converted, then through the engine's view like a checkpoint
        saved = SavedModel()
        path = load(saved, source.arch)
        template = view.model_template()
        state = state_for(source, cfg, saved.state, {k: tuple(v.shape) for k, v in template.items()})
        del template, saved
        view.set_state(state)
        how = f", converted from model.arch {source.arch!r} to {cfg.model.arch!r} by the registry's convert"
    return (f"initial weights from {os.path.abspath(path)} (checkpoint.init_from{how}); optimizer, step and data "
            "order start fresh")
