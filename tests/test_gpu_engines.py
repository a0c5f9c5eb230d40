"""The data-parallel engines' checkpoint views on CUDA (marker `gpu`; skipped without a CUDA device): a run
stopped at a checkpoint and resumed trains on as the run that went on. On a GPU the optimizer is a fused
AdamW, which keeps `step` on the device, and megatron-core's view writes the optimizer state in directly
(parallel/megatron_ddp.py), so where each tensor lands is this test's subject; on the CPU every tensor is
on the host and the same resumes are checked bit for bit (tests/test_layout_resume.py)."""
import pytest
import torch

from trainer_helpers import step_losses, tiny_overrides, write_markov_corpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fused AdamW state on it)")]

ENGINES = {"ddp": [], "megatron-ddp": ["parallel.data_parallel=megatron"],
           "megatron-distopt": ["parallel.data_parallel=megatron", "parallel.distributed_optimizer=true"]}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_resumed_on_cuda_trains_on_as_the_run_that_went_on(tmp_path, engine):
    if engine.startswith("megatron"):
        pytest.importorskip("megatron.core", reason="needs megatron-core (carry its wheel to the GPU machine)")
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    corpus = write_markov_corpus(tmp_path / "corpus")

    def run(name: str, steps: int) -> dict:
        over = tiny_overrides(tmp_path / name, corpus, **{
            "train.max_steps": steps, "train.eval_every": 0, "checkpoint.every": 2, "schedule.kind": "constant",
            "schedule.warmup_steps": 1, "train.device": "cuda", "train.precision": "fp32", "train.compile": "false",
            "log.peak_tflops": 0.0}) + ENGINES[engine]
        Trainer(load_config("baseline/tiny", over), log=lambda *_: None).fit()
        return step_losses(tmp_path / name / "run")

    went_on = run("straight", 4)
    run("resumed", 2)
    resumed = run("resumed", 4)  # from step 2's checkpoint: the optimizer state goes back onto the device
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):  # fp32 on a GPU: the same kernels, up to the order of atomic adds
        assert resumed[step] == pytest.approx(went_on[step], rel=1e-4), (step, went_on, resumed)
