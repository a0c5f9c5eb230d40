"""torch DDP on 2 gloo ranks: the same losses and parameters as one process on the same global
batch, checkpoints written together by both ranks, and resumable on one process (DP2 -> DP1)."""
import numpy as np
import pytest
import torch

from distributed import run_ranks
from pretrain.config import load_config
from pretrain.metrics import read_metrics
from pretrain.trainer import Trainer
from trainer_helpers import tiny_overrides, write_markov_corpus


def _train(tmp, corpus, run, steps, extra=()):
    over = tiny_overrides(tmp, corpus, **{"train.run_dir": f"{tmp}/{run}", "train.max_steps": steps,
                                          "train.eval_every": 0, "checkpoint.every": 0,
                                          "schedule.warmup_steps": 1, "train.threads": 1,
                                          "schedule.kind": "constant"})  # runs of 3 and 5 steps share lrs
    trainer = Trainer(load_config("baseline/tiny", over + list(extra)), log=lambda *_: None)
    record = trainer.fit()
    params = {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}
    return record, params


def _ddp_body(rank, world_size, tmp, corpus):
    record, params = _train(tmp, corpus, "ddp", 3)
    return record.get("val_loss"), params


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


def test_ddp_two_ranks_equal_one_process_and_resume_on_one(tmp_path, corpus):
    tmp = str(tmp_path)
    (val0, p0), (val1, p1) = run_ranks(_ddp_body, 2, args=(tmp, corpus))
    for k in p0:  # DDP keeps the replicas identical
        np.testing.assert_array_equal(p0[k], p1[k])
    assert val0 == val1

    threads = torch.get_num_threads()
    try:
        ref_record, ref = _train(tmp_path, corpus, "single", 3)
        ddp_losses = {r["step"]: r["loss"] for r in read_metrics(f"{tmp}/ddp")}
        single_losses = {r["step"]: r["loss"] for r in read_metrics(f"{tmp}/single")}
        assert sorted(ddp_losses) == [1, 2, 3]
        for step in (1, 2, 3):  # fp32; the two layouts sum gradients in different orders
            assert ddp_losses[step] == pytest.approx(single_losses[step], rel=1e-5)
        for k in ref:
            np.testing.assert_allclose(p0[k], ref[k], rtol=0, atol=2e-6, err_msg=k)
        assert val0 == pytest.approx(ref_record["val_loss"], rel=1e-5)

        # The checkpoint both ranks wrote at step 3 resumes in one process (DP2 -> DP1), and two more
        # steps match five uninterrupted single-process steps.
        _, resumed = _train(tmp_path, corpus, "ddp", 5)
        _, straight = _train(tmp_path, corpus, "single5", 5)
        for k in straight:
            np.testing.assert_allclose(resumed[k], straight[k], rtol=0, atol=5e-6, err_msg=k)
    finally:
        torch.set_num_threads(threads)
