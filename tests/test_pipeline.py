"""Pipeline parallelism (parallel/pipeline.py): checkpoints move between a PP2 run and one process both
ways, evaluation runs through the stages, `pretrain export` reads a PP checkpoint, a SIGKILL-and-resume
under PP2 (torchrun) is bit-identical, and the splits that cannot be made are one sentence. Parity of
every architecture under PP2, TP2 x PP2 and PP2 x DP2 is in tests/test_layout_matrix.py."""
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from distributed import run_ranks
from pretrain.config import ConfigError, load_config
from pretrain.metrics import read_metrics
from trainer_helpers import step_losses, tiny_overrides, train_run, write_markov_corpus

pytest.importorskip("megatron.core", reason="pipeline parallelism runs megatron-core's schedules")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_COMPILE = ["train.compile=false"]
PP2 = NO_COMPILE + ["parallel.pp=2"]
LOSS_REL, PARAM_ATOL = 1e-5, 2e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def _pp2_body(rank, world, tmp, corpus, runs):
    out = {}
    for name, steps in runs:
        out.update(train_run(tmp, corpus, name, steps, PP2 + ["train.eval_every=2"])[1])
    return out


def test_checkpoints_move_between_pp2_and_one_process_and_evaluation_runs_through_the_stages(tmp_path, corpus):
    tmp = str(tmp_path)
    record5, single5 = train_run(tmp, corpus, "single5", 5, NO_COMPILE + ["train.eval_every=2"])
    train_run(tmp, corpus, "single3", 3, NO_COMPILE)
    shutil.copytree(f"{tmp}/single3", f"{tmp}/one_to_pp2")
    ranks = run_ranks(_pp2_body, 2, args=(tmp, corpus, [("pp2", 3), ("one_to_pp2", 5)]), timeout=600)
    ref = step_losses(f"{tmp}/single5")
    for name in ("pp2", "one_to_pp2"):
        got = step_losses(f"{tmp}/{name}")
        assert got == pytest.approx({s: ref[s] for s in got}, rel=LOSS_REL), name
    held = {k: v for r in ranks for k, v in r.items()}  # the stages together hold every tensor once
    assert sorted(held) == sorted(single5)
    for k in single5:  # one process -> PP2 for steps 4 and 5: the uninterrupted run's parameters
        np.testing.assert_allclose(held[k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=k)
    # evaluation through the stages: every stage reports the validation loss one process computes
    val = {r["step"]: r["val_loss"] for r in read_metrics(f"{tmp}/one_to_pp2") if "val_loss" in r}
    single_val = {r["step"]: r["val_loss"] for r in read_metrics(f"{tmp}/single5") if "val_loss" in r}
    assert {4, 5} <= set(val) and {s: val[s] for s in (4, 5)} == pytest.approx({s: single_val[s] for s in (4, 5)},
                                                                               rel=LOSS_REL)
    # PP2 -> one process, and export reads the PP2 checkpoint
    _, resumed = train_run(tmp, corpus, "pp2", 5, NO_COMPILE)
    for k in single5:
        np.testing.assert_allclose(resumed[k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=k)
    from pretrain.cli import main
    from pretrain.export import load_folder

    shutil.copytree(f"{tmp}/one_to_pp2", f"{tmp}/export_src")
    assert main(["export", f"{tmp}/export_src", f"{tmp}/folder"]) == 0
    model, _, _, _ = load_folder(f"{tmp}/folder")
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), held[name], err_msg=name)


def _distopt_body(rank, world, tmp, corpus, runs):
    out = {}
    for name, steps in runs:
        out.update(train_run(tmp, corpus, name, steps, PP2 + DISTOPT)[1])
    return out


DISTOPT = ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]


def test_checkpoints_move_between_pp2_with_the_distributed_optimizer_and_one_process(tmp_path, corpus):
    """PP2 x DP2 with megatron's sharded Adam state: its checkpoint is the single-device one both ways."""
    tmp = str(tmp_path)
    _, single5 = train_run(tmp, corpus, "single5", 5, NO_COMPILE)
    train_run(tmp, corpus, "single3", 3, NO_COMPILE)
    shutil.copytree(f"{tmp}/single3", f"{tmp}/one_to_pp")
    ranks = run_ranks(_distopt_body, 4, args=(tmp, corpus, [("pp", 3), ("one_to_pp", 5)]), timeout=600)
    held = {k: v for r in ranks for k, v in r.items()}
    assert sorted(held) == sorted(single5)
    for k in single5:
        np.testing.assert_allclose(held[k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=k)
    _, resumed = train_run(tmp, corpus, "pp", 5, NO_COMPILE)
    ref = step_losses(f"{tmp}/single5")
    assert step_losses(f"{tmp}/pp") == pytest.approx(ref, rel=LOSS_REL)
    for k in single5:
        np.testing.assert_allclose(resumed[k], single5[k], rtol=0, atol=PARAM_ATOL, err_msg=k)


def _launch(tmp_path, corpus, run, steps):
    over = tiny_overrides(tmp_path, corpus, **{"train.run_dir": str(tmp_path / run), "train.max_steps": steps,
                                               "checkpoint.every": 2, "train.eval_every": 0,
                                               "schedule.warmup_steps": 1, "parallel.pp": 2})
    torchrun = [shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun", "--standalone",
                "--nproc-per-node", "2", "-m", "pretrain.cli", "train", "baseline/tiny", *over, *NO_COMPILE]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    return subprocess.Popen(torchrun, env=dict(env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_sigkill_under_pp2_resumes_bit_identical(tmp_path, corpus):
    whole = _launch(tmp_path, corpus, "whole", 8)
    _, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-3000:]
    killed = _launch(tmp_path, corpus, "killed", 8)
    metrics, deadline = tmp_path / "killed" / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and killed.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)  # torchrun and both stages, mid-run
    killed.wait()
    assert len(step_losses(tmp_path / "killed")) < 8
    resumed = _launch(tmp_path, corpus, "killed", 8)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in out
    assert step_losses(tmp_path / "killed") == step_losses(tmp_path / "whole")  # bit for bit


@pytest.mark.parametrize("over, sentence", [
    (["model.n_layers=3"], "model.n_layers=3 does not split into 2 pipeline stages of equal depth (parallel.pp x"),
    (["parallel.data_parallel=deepspeed", "parallel.zero_stage=1"],
     "parallel.pp=2 with parallel.data_parallel=deepspeed is not supported: ZeRO reduces"),
    (["train.compile=true"], "train.compile=true with parallel.pp=2 is not supported yet"),
    (["model.arch=crt"], "parallel.pp=2 is not supported (each of the K passes runs every block"),
])
def test_what_cannot_be_staged_is_one_sentence(over, sentence, tmp_path):
    """(GPN's refusal and every architecture's are checked by the layout matrix.)"""
    with pytest.raises(ConfigError) as e:
        load_config("baseline/tiny", tiny_overrides(tmp_path, "unused") + ["parallel.pp=2", *over], check_data=False)
    assert sentence in str(e.value) and "\n" not in str(e.value)


def test_cart_stages_hold_the_core_with_all_its_passes():
    from pretrain.models.cart import CARTConfig, pipeline_split
    from parallel.stages import balanced_split

    assert pipeline_split(CARTConfig(n_layers=2, n_loops=6), 2) == [0, 2, 4]  # prelude | core + coda
    assert pipeline_split(CARTConfig(n_layers=6, n_loops=2), 2) == [0, 4, 8]  # 4 layers | 2, the core, the coda
    assert balanced_split([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="too few for 5 pipeline stages"):
        pipeline_split(CARTConfig(n_layers=2, n_loops=6), 5)


def _nan_on_stage_0(rank, world, tmp, corpus):
    import torch

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    over = tiny_overrides(tmp, corpus, **{"train.run_dir": f"{tmp}/nan", "train.max_steps": 4, "checkpoint.every": 0,
                                          "train.eval_every": 0, "train.nan_policy": "skip", "schedule.warmup_steps": 0})
    trainer = Trainer(load_config("baseline/tiny", over + PP2), log=lambda *_: None)
    finish = trainer.engine.finish_grads

    def poisoned(max_norm):
        if rank == 0 and trainer.step == 1:  # step 2: one gradient of the first stage only
            next(p for p in trainer.engine.model.parameters() if p.grad is not None).grad[0] = float("nan")
        return finish(max_norm)

    trainer.engine.finish_grads = poisoned
    trainer.fit()
    return trainer.bad_steps.total, {n: bool(torch.isfinite(p).all()) for n, p in trainer.engine.model.named_parameters()}


def test_a_non_finite_gradient_on_one_stage_skips_the_step_on_every_rank(tmp_path, corpus):
    """The gradient norm is reduced over the stages, so the last stage, whose own gradients are finite,
    skips step 2 too: every rank decides alike, and no NaN reaches any parameter."""
    results = run_ranks(_nan_on_stage_0, 2, args=(str(tmp_path), corpus), timeout=300)
    assert [r[0] for r in results] == [1, 1], results
    assert all(all(finite.values()) for _, finite in results)
    assert [r["step"] for r in read_metrics(str(tmp_path / "nan"))] == [1, 2, 3, 4]


INTERLEAVED = ["parallel.pp=4", "parallel.virtual_stages=2", "model.n_layers=8", "train.micro_batch_seqs=2",
               "train.global_batch_seqs=16", "train.eval_every=3"]


def _interleaved_body(rank, world, tmp, corpus, extra):
    return train_run(tmp, corpus, "interleaved", 3, NO_COMPILE + extra)[1]


def test_interleaved_stages_train_and_evaluate_as_one_process(tmp_path, corpus):
    """PP4 with two stages per rank (megatron-core's interleaved 1F1B over eight stages; rank 0 holds
    layers 0 and 4, the embedding, and the tied head's copy is on rank 3): the losses, the validation
    loss (evaluated stage after stage outside the schedule) and every parameter equal one process."""
    tmp = str(tmp_path)
    model = [o for o in INTERLEAVED if not o.startswith("parallel.")]
    _, single = train_run(tmp, corpus, "single", 3, NO_COMPILE + model)
    held = {}
    for part in run_ranks(_interleaved_body, 4, args=(tmp, corpus, INTERLEAVED), timeout=600):
        held.update(part)
    assert sorted(held) == sorted(single)
    for k in single:
        np.testing.assert_allclose(held[k], single[k], rtol=0, atol=PARAM_ATOL, err_msg=k)
    got, want = read_metrics(f"{tmp}/interleaved"), read_metrics(f"{tmp}/single")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=LOSS_REL)
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=LOSS_REL)


def _interleaved_refusal(rank, world, tmp, corpus, extra):
    train_run(tmp, corpus, "refused", 2, NO_COMPILE + extra)


@pytest.mark.parametrize("extra, sentence", [
    (["parallel.pp=2", "parallel.virtual_stages=2", "model.n_layers=4", "train.micro_batch_seqs=1"],
     "with parallel.pp=2 is refused over gloo"),
    (["parallel.pp=2", "parallel.virtual_stages=2", "model.n_layers=4"],  # 8 / 4 = 2 micro batches per step
     "(train.global_batch_seqs / (train.micro_batch_seqs x dp) = 2) to be a multiple of parallel.pp=2 and at least"),
])
def test_interleaved_stages_refuse_what_megatron_cannot_run_here(extra, sentence, tmp_path, corpus):
    with pytest.raises(AssertionError) as e:
        run_ranks(_interleaved_refusal, 2, args=(str(tmp_path), corpus, extra), timeout=300)
    assert sentence in str(e.value)
    with pytest.raises(ConfigError, match="parallel.virtual_stages=2 interleaves pipeline stages: it needs"):
        load_config("baseline/tiny", tiny_overrides(tmp_path, "unused") + ["parallel.virtual_stages=2"],
                    check_data=False)
