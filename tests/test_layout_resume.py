"""Every registered architecture's checkpoint moves between one process and every layout it supports
(test_layout_matrix's LAYOUTS, 2 and 4 ranks), both ways: a one-process checkpoint resumed under the
layout, and the layout's checkpoint resumed on one process, continue with the losses (rel 1e-4) and
parameters of one uninterrupted one-process run.

Each architecture trains that reference once per module (2 x HALF steps, checkpointed at HALF; once
more for a layout that changes the model or batch, as PP4's depth); its step-HALF checkpoint is the
one-process checkpoint the layouts resume. One spawn of the layout's ranks both resumes it and trains
the layout's own checkpoint from scratch. Layouts an architecture's
registry entry refuses are not generated (test_layout_matrix.py checks the refusals). CI runs ZeRO-3,
whose parameter partitions are padded where 2 ranks do not split a parameter evenly (CART's 3-element
`hyper`), for every architecture; the other layouts are marked slow (`-m slow`).
"""
import os
import shutil

import numpy as np
import pytest

import looped_model  # noqa: F401  (registers the test architectures, also in spawned ranks)
from distributed import run_ranks
from pretrain.models import get_arch
from test_layout_matrix import ARCHS, BASE, LAYOUTS, PARAM_ATOL, _config, needs, parallel_config
from trainer_helpers import step_losses, train_run

HALF = 2  # steps before the checkpoint, and after it
LOSS_REL = 1e-4


def _supported(arch, layout) -> bool:
    return get_arch(arch).supports.refusal(parallel_config(layout)) is None


CI = [(a, "zero3") for a in ARCHS if _supported(a, "zero3")]
SLOW = [(a, layout) for a in ARCHS for layout in LAYOUTS if layout != "zero3" and _supported(a, layout)]


def _shape(layout) -> list[str]:
    """The layout's model and batch overrides (PP4's depth, ...): the one-process runs take them too."""
    return [o for o in LAYOUTS[layout][1] if o.startswith(("model.", "train."))]


def _body(rank, world_size, tmp, corpus, arch, layout):
    """Under the layout: resume the one-process checkpoint to step 2 x HALF, then train HALF steps
    from scratch (the checkpoint the one process resumes)."""
    extra = BASE + LAYOUTS[layout][1]
    _, resumed = train_run(tmp, corpus, "single_to_layout", 2 * HALF, extra, arch_config=_config(arch))
    train_run(tmp, corpus, "layout", HALF, extra, arch_config=_config(arch))
    return resumed


def _copy_run_at(src, dst, step):
    """A copy of run `src` whose latest checkpoint is the one of `step` (the later ones left out)."""
    name = f"step_{step:08d}"
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n > name])
    with open(os.path.join(dst, "checkpoints", "latest"), "w") as f:
        f.write(name)


def _assert_continues(run_dir, params, ref, what):
    """Steps 1 .. 2 x HALF of `run_dir` (those before the checkpoint included) and the final
    parameters equal the uninterrupted one-process run's."""
    losses, (want_losses, want_params) = step_losses(run_dir), ref
    assert sorted(losses) == list(range(1, 2 * HALF + 1)), what
    for step, loss in losses.items():
        assert loss == pytest.approx(want_losses[step], rel=LOSS_REL), f"{what}: step {step}"
    assert sorted(params) == sorted(want_params), what
    for k, want in want_params.items():
        np.testing.assert_allclose(params[k], want, rtol=0, atol=PARAM_ATOL, err_msg=f"{what}: {k}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """reference(arch, shape) -> (run dir, (losses by step, parameters)) of the uninterrupted one-process
    run of 2 x HALF steps with the overrides `shape`, checkpointed at HALF; trained once for each."""
    runs = {}

    def get(arch, shape):
        key = (arch, tuple(shape))
        if key not in runs:
            tmp = str(tmp_path_factory.mktemp(f"reference_{arch}"))
            _, params = train_run(tmp, corpus, "single", 2 * HALF,
                                  BASE + shape + [f"checkpoint.every={HALF}", "checkpoint.keep_last=2"],
                                  arch_config=_config(arch))
            runs[key] = f"{tmp}/single", (step_losses(f"{tmp}/single"), params)
        return runs[key]

    return get


def _round_trip(arch, layout, tmp_path, corpus, reference):
    needs(layout)
    source, ref = reference(arch, _shape(layout))
    tmp = str(tmp_path)
    _copy_run_at(source, f"{tmp}/single_to_layout", HALF)
    params = {}  # every rank's view (a pipeline stage holds its own tensors; the others hold all)
    for held in run_ranks(_body, LAYOUTS[layout][0], args=(tmp, corpus, arch, layout),
                          env={"DS_ACCELERATOR": "cpu"}, timeout=600):
        params.update(held)
    _assert_continues(f"{tmp}/single_to_layout", params, ref, f"{arch}: one process -> {layout}")
    shutil.copytree(f"{tmp}/layout", f"{tmp}/layout_to_single")
    _, params = train_run(tmp, corpus, "layout_to_single", 2 * HALF, BASE + _shape(layout), arch_config=_config(arch))
    _assert_continues(f"{tmp}/layout_to_single", params, ref, f"{arch}: {layout} -> one process")


@pytest.mark.parametrize("arch, layout", CI, ids=["-".join(c) for c in CI])
def test_checkpoint_resumes_under_zero3_and_back(arch, layout, tmp_path, corpus, reference):
    _round_trip(arch, layout, tmp_path, corpus, reference)


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", SLOW, ids=["-".join(c) for c in SLOW])
def test_checkpoint_resumes_across_layouts(arch, layout, tmp_path, corpus, reference):
    _round_trip(arch, layout, tmp_path, corpus, reference)
