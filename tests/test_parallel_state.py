"""Parallel state a model carries: sequence-parallel gradient marks, TP-sharded buffers in
checkpoints, refused non-tensor state, and model-owned generators saved and restored."""
import pytest
import torch
from torch import nn

import parallel.mesh as mesh
from distributed import run_ranks
from parallel.engine import FullState
from parallel.layers import RMSNorm, sequence_parallel_params
from pretrain.checkpoint import LocalState, load_checkpoint, save_checkpoint


class Gated(nn.Module):
    """A norm (acts on the sequence slice under SP) and a scalar gate (acts on replicated values)."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(4, 1e-6)
        self.gate = nn.Parameter(torch.ones(()))


@pytest.fixture
def sp_layout(monkeypatch):
    monkeypatch.setattr(mesh, "_LAYOUT", mesh.Layout(tp=2, sp=True))


def test_only_marked_parameters_are_reduced_under_sequence_parallelism(sp_layout):
    model = Gated()
    assert sequence_parallel_params(model) == [model.norm.weight]  # not the gate
    mesh._LAYOUT = mesh.Layout(tp=2, sp=False)
    assert sequence_parallel_params(Gated()) == []
    assert not getattr(Gated().norm.weight, "sequence_parallel", False)  # built without SP: unmarked


class Sharded(nn.Module):
    """A layer holding a TP-sharded buffer (split on dim 0), declared through `tp_buffers`."""

    tp_buffers = {"table": 0}

    def __init__(self, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        self.register_buffer("table", torch.arange(3.0) + 3 * rank)  # rank r holds rows 3r .. 3r+2


def _sharded_buffer_round_trip(rank, world, root):
    mesh._LAYOUT = mesh.Layout(tp=2, tp_rank=rank, tp_group=None)
    model = Sharded(rank)
    view = FullState(LocalState(model), model)
    model_sd, _ = view.get_state()
    full = model_sd["table"].tolist()
    template = view.model_template()["table"].shape
    model.table.zero_()
    view.set_state({"weight": torch.zeros(2), "table": torch.arange(6.0) * 10}, {}, None)
    return full, tuple(template), model.table.tolist()


def test_a_tp_sharded_buffer_is_gathered_and_split_like_a_parameter(tmp_path):
    results = run_ranks(_sharded_buffer_round_trip, 2, args=(str(tmp_path),))
    for rank, (full, template, local) in enumerate(results):
        assert full == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and template == (6,)
        assert local == [30.0 * rank, 30.0 * rank + 10, 30.0 * rank + 20]


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def get_extra_state(self):
        return {"note": "not a tensor"}

    def set_extra_state(self, state):
        raise AssertionError("never loaded: saving this model is refused")


def test_non_tensor_model_state_is_refused_at_save(tmp_path):
    with pytest.raises(ValueError, match="model state _extra_state is a dict, not a tensor: checkpoints hold"):
        save_checkpoint(str(tmp_path), 1, WithExtra(), None, {"config": {}})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


class Noisy(nn.Module):
    """A model that owns a generator (e.g. for its own sampling) besides its parameters."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.inner = nn.Module()
        self.inner.gen = torch.Generator().manual_seed(7)


def test_model_owned_generators_are_saved_and_restored(tmp_path):
    model = Noisy()
    torch.rand(3, generator=model.inner.gen)  # advance it
    save_checkpoint(str(tmp_path), 1, model, None, {"config": {}})
    want = torch.rand(4, generator=model.inner.gen)
    fresh = Noisy()  # its generator is back at seed 7
    load_checkpoint(str(tmp_path / "checkpoints" / "step_00000001"), fresh, restore_rng=True, log=lambda _: None)
    assert torch.equal(torch.rand(4, generator=fresh.inner.gen), want)
