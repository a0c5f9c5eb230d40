"""torch DDP on 2 gloo ranks: the same losses and parameters as one process on the same global
batch, checkpoints written together by both ranks, and resumable on one process (DP2 -> DP1)."""
import numpy as np
import pytest
import torch

from distributed import run_ranks
from pretrain.metrics import read_metrics
from trainer_helpers import train_run, write_markov_corpus


def _ddp_body(rank, world_size, tmp, corpus):
    record, params = train_run(tmp, corpus, "ddp", 3)
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
        ref_record, ref = train_run(tmp_path, corpus, "single", 3)
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
        _, resumed = train_run(tmp_path, corpus, "ddp", 5)
        _, straight = train_run(tmp_path, corpus, "single5", 5)
        for k in straight:
            np.testing.assert_allclose(resumed[k], straight[k], rtol=0, atol=5e-6, err_msg=k)
    finally:
        torch.set_num_threads(threads)
