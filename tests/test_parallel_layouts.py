"""Every layout gives the single-process result, and checkpoints move between layouts.

Three optimizer steps under megatron-core DDP (with and without its distributed optimizer), tensor
parallelism (TP2, TP2+SP, megatron layers forced at TP1) and TP2 x DP2 give the losses and the
parameters of one process running the same global batch (fp32; summation orders differ, hence the
tolerances). Checkpoints written by one layout resume under another (TP1 -> TP2, TP2 -> TP1,
distributed optimizer -> one process) and the following steps match an uninterrupted run.
"""
import importlib.util
import shutil

import numpy as np
import pytest

import looped_model  # noqa: F401  (registers the test_looped architecture, also in spawned ranks)
from distributed import run_ranks
from trainer_helpers import step_losses, train_run, write_markov_corpus

pytest.importorskip("megatron.core", reason="tensor parallelism and megatron DDP need megatron-core")

NO_COMPILE = ["train.compile=false"]
TWO_RANKS = {
    "megatron-ddp": ["parallel.data_parallel=megatron"],
    "megatron-distopt": ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"],
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp2-sp-megatron": ["parallel.tp=2", "parallel.sp=true", "parallel.data_parallel=megatron"],
    "megatron-layers-tp1-ddp": ["parallel.megatron_layers=true"],
}
FOUR_RANKS = {
    "tp2xdp2-ddp": ["parallel.tp=2"],
    "tp2xdp2-distopt": ["parallel.tp=2", "parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"],
}
# fp32 with sums in other orders. Adam divides by sqrt(v), so an element whose gradient is ~0 can move
# by a visible fraction of one step (lr = 2e-3) on a rounding difference: parameters within 1% of it.
LOOPED = ["model.arch=test_looped", "model.n_layers=1"]
LOOPED_ENGINES = {
    "looped-ddp": [],
    "looped-megatron": ["parallel.data_parallel=megatron"],
    "looped-distopt": ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"],
    "looped-tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
}
if importlib.util.find_spec("deepspeed"):
    LOOPED_ENGINES.update({f"looped-zero{z}": ["parallel.data_parallel=deepspeed", f"parallel.zero_stage={z}"]
                           for z in (1, 2, 3)})
LOSS_REL, PARAM_ATOL = 1e-5, 2e-5


def _layouts_body(rank, world_size, tmp, corpus, layouts, resumes):
    out = {name: train_run(tmp, corpus, name, 3, NO_COMPILE + extra)[1] for name, extra in layouts.items()}
    for run, extra in resumes.items():  # continue a copied run directory under this layout
        out[run] = train_run(tmp, corpus, run, 5, NO_COMPILE + extra)[1]
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def _assert_same(tmp, name, params, ref_losses, ref_params, steps=3):
    losses = step_losses(f"{tmp}/{name}")
    assert sorted(losses) == list(range(1, steps + 1)), name
    for s in losses:
        assert losses[s] == pytest.approx(ref_losses[s], rel=LOSS_REL), f"{name}: step {s}"
    assert sorted(params) == sorted(ref_params), name
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=0, atol=PARAM_ATOL, err_msg=f"{name}: {k}")


def test_layouts_equal_one_process_and_checkpoints_cross_layouts(tmp_path, corpus):
    tmp = str(tmp_path)
    _, single = train_run(tmp, corpus, "single", 3, NO_COMPILE)
    _, single5 = train_run(tmp, corpus, "single5", 5, NO_COMPILE)
    ref_losses = step_losses(f"{tmp}/single5")
    shutil.copytree(f"{tmp}/single", f"{tmp}/tp1_to_tp2")

    results = run_ranks(_layouts_body, 2, args=(tmp, corpus, TWO_RANKS, {"tp1_to_tp2": ["parallel.tp=2"]}),
                        timeout=600)
    for name in TWO_RANKS:
        _assert_same(tmp, name, results[0][name], ref_losses, single)
        for other in results[1:]:  # every rank gathers the same full parameters
            for k, v in other[name].items():
                np.testing.assert_array_equal(v, results[0][name][k])
    # TP1 -> TP2: two more steps under TP2 continue the single-process run exactly
    for k in single5:
        np.testing.assert_allclose(results[0]["tp1_to_tp2"][k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=k)

    # TP2 -> TP1 and distributed optimizer -> one process
    for name in ("tp2-sp", "megatron-distopt"):
        _, resumed = train_run(tmp, corpus, name, 5, NO_COMPILE)
        for k in single5:
            np.testing.assert_allclose(resumed[k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=f"{name}: {k}")


def test_tp2_by_dp2_equals_one_process(tmp_path, corpus):
    tmp = str(tmp_path)
    _, single = train_run(tmp, corpus, "single", 3, NO_COMPILE)
    results = run_ranks(_layouts_body, 4, args=(tmp, corpus, FOUR_RANKS, {}), timeout=900)
    for name in FOUR_RANKS:
        _assert_same(tmp, name, results[0][name], step_losses(f"{tmp}/single"), single)


def test_a_block_reused_within_a_step_with_recompute_under_every_engine(tmp_path, corpus):
    """One block applied three times per step, activation checkpointing on: every engine reduces its
    gradients once and matches one process without recomputation."""
    tmp = str(tmp_path)
    _, single = train_run(tmp, corpus, "single", 3, NO_COMPILE + LOOPED)
    engines = {name: LOOPED + ["parallel.recompute=full"] + extra for name, extra in LOOPED_ENGINES.items()}
    results = run_ranks(_layouts_body, 2, args=(tmp, corpus, engines, {}), env={"DS_ACCELERATOR": "cpu"},
                        timeout=900)
    for name in engines:
        _assert_same(tmp, name, results[0][name], step_losses(f"{tmp}/single"), single)
