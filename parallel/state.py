"""The checkpoint view of a model and its optimizer: the protocol between pretrain/checkpoint.py,
which writes and reads checkpoints, and the engines of parallel/, which own the (possibly sharded)
state. It lives here so that both can see it and parallel/ imports nothing of pretrain/.

A view has five members: `has_optimizer`, `get_state() -> (model state, optimizer state or None)`,
`model_template()`, `optim_template()` and `set_state(model state, optimizer state, param_groups)`;
every engine hands over full, unsharded tensors keyed by the single-device model's names, which is
what makes a checkpoint loadable under any layout.
"""
from __future__ import annotations

from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_model_state_dict,
    set_optimizer_state_dict)


class LocalState:
    """The checkpoint view of a model and optimizer living whole in this process (or replicated by
    DDP): FQN-keyed state through torch's get_/set_*_state_dict. Engines that shard or wrap the
    model provide their own object with the same five members (see parallel/engine.py); every one
    hands over full, unsharded tensors keyed by the single-device model's names, which is what makes
    a checkpoint loadable under any layout."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self.has_optimizer = optimizer is not None

    def get_state(self) -> tuple[dict, dict | None]:
        """(model state, optimizer state dict {"state", "param_groups"} or None), FQN-keyed."""
        if self.optimizer is None:
            return get_model_state_dict(self.model), None
        had_state = bool(self.optimizer.state)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if not had_state:  # get_state_dict initialised it with a zero-lr step: undo, save it empty
            self.optimizer.state.clear()
            optim_sd = {"state": {}, "param_groups": optim_sd["param_groups"]}
        return model_sd, optim_sd

    def model_template(self) -> dict:
        return get_model_state_dict(self.model)

    def optim_template(self) -> dict:
        # DSD creates a fresh optimizer's lazy state for DCP to load into, but only without grads
        self.optimizer.zero_grad(set_to_none=True)
        return get_optimizer_state_dict(self.model, self.optimizer)["state"]

    def set_state(self, model_sd: dict, optim_state: dict, groups: list | None) -> None:
        set_model_state_dict(self.model, model_sd)
        if groups is not None:
            if not optim_state:
                self.optimizer.state.clear()
            set_optimizer_state_dict(self.model, self.optimizer, {"state": optim_state, "param_groups": groups})


class WeightsOnly:
    """The model half of another view (an engine's): a checkpoint loads only the weights through it,
    by the inner view's own path (TP re-split, ZeRO partitions, megatron's fp32 copies), and the
    optimizer is left as it is (a new run's: fresh)."""

    has_optimizer = False

    def __init__(self, inner):
        self.inner = inner

    def get_state(self) -> tuple[dict, None]:
        return self.inner.get_state()[0], None

    def model_template(self) -> dict:
        return self.inner.model_template()

    def set_state(self, model_sd: dict, optim_state: dict | None = None, groups: list | None = None) -> None:
        self.inner.set_state(model_sd, {}, None)  # groups None: the optimizer is not touched


class SavedModel:
    """A checkpoint view without a model: pretrain.checkpoint's load_checkpoint/load_latest put the
    saved model tensors, full and keyed by the single-device model's names, into `state` (for a
    conversion into another architecture, which has no model of the source's to load into); it sets
    `template` from the checkpoint's own metadata first."""

    has_optimizer = False

    def __init__(self):
        self.template: dict = {}
        self.state: dict = {}

    def get_state(self) -> tuple[dict, None]:
        return self.state, None

    def model_template(self) -> dict:
        return self.template

    def set_state(self, model_sd: dict, optim_state=None, groups=None) -> None:
        self.state = model_sd


def as_state(model, optimizer=None):
    """`model` itself when it is already a checkpoint view (an engine's), else LocalState."""
    if hasattr(model, "get_state") and hasattr(model, "model_template"):
        return model
    return LocalState(model, optimizer)
