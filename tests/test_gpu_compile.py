"""Compiled training on CUDA (marker `gpu`; skipped without a CUDA device): every architecture's tiny
config trains 3 steps through the real trainer with train.compile=true, bf16 autocast and its default
kernel paths (document masks through the block-sparse Triton path where the config masks documents),
and its losses match the same run eager within bf16 tolerance. The CPU half of this check (the custom
ops' fake functions, compiled == eager through the forced Triton path) is tests/test_custom_ops.py."""
import pytest
import torch

from trainer_helpers import step_losses, tiny_overrides, write_markov_corpus, write_word_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled CUDA training)")]

ARCHS = ["baseline", "sps", "crt", "rt", "cart", "gpn"]


@pytest.mark.parametrize("arch, scope", [(arch, "model") for arch in ARCHS] + [("baseline", "blocks"), ("sps", "blocks")])
def test_tiny_config_trains_compiled_on_cuda_like_eager(tmp_path, arch, scope):
    """scope: train.compile_scope (blocks: each block compiled apart, tests/test_compile_blocks.py on the CPU)."""
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    corpus = write_markov_corpus(tmp_path / "corpus")
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")  # its </s> ends documents: masks have work
    losses = {}
    for compiled in (False, True):
        over = tiny_overrides(tmp_path / str(compiled), corpus, arch, **{
            "train.max_steps": 3, "train.eval_every": 0, "checkpoint.every": 0, "schedule.kind": "constant",
            "schedule.warmup_steps": 1, "train.device": "cuda", "train.precision": "bf16",
            "train.compile": str(compiled).lower(), "train.compile_scope": scope, "log.peak_tflops": 0.0,
            "data.tokenizer": tokenizer})
        Trainer(load_config(f"{arch}/tiny", over), log=lambda *_: None).fit()
        losses[compiled] = step_losses(tmp_path / str(compiled) / "run")
    assert sorted(losses[True]) == [1, 2, 3]
    for step, eager in losses[False].items():
        assert losses[True][step] == pytest.approx(eager, rel=2e-2), (step, losses)
