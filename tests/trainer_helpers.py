"""Shared pieces of the trainer tests: a learnable synthetic corpus and tiny run configs."""
from pathlib import Path

import numpy as np

from data_tools.indexed import IndexedWriter

VOCAB = 64
EOD = 2


def write_markov_corpus(prefix, num_docs=300, seed=0):
    """Documents from a sparse random Markov chain ending in EOD: context makes tokens predictable."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(5, VOCAB, size=(VOCAB, 3))
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(num_docs):
            tok = [int(rng.integers(5, VOCAB))]
            for _ in range(int(rng.integers(10, 120))):
                tok.append(int(successors[tok[-1], rng.integers(0, 3)]))
            w.add_document(np.array(tok + [EOD]))
    return str(prefix)


DECODER_SHRINK = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64}


def _decoder_shaped(arch: str) -> bool:
    from dataclasses import fields

    from pretrain.models import get_arch

    try:
        return "d_model" in {f.name for f in fields(get_arch(arch).config_cls)}
    except ValueError:  # registered later (in the process that trains): a test architecture, decoder-shaped
        return True


def tiny_overrides(tmp_path, prefix, arch=None, **extra):
    """Overrides turning baseline/tiny (or an architecture's tiny config: `arch`, or model.arch in
    extra) into a seconds-long CPU run on the synthetic corpus; a model that is not decoder-shaped
    keeps its own tiny widths."""
    tmp_path = Path(tmp_path)
    arch = extra.get("model.arch", arch)
    shrink = DECODER_SHRINK if not arch or _decoder_shaped(arch) else {}
    values = {
        "model.vocab_size": VOCAB, **shrink, "data.train": f"[{prefix}]", "data.valid": "[]", "data.tokenizer": "''",
        "data.split": "90,10", "data.seq_len": 32, "data.num_workers": 0, "data.cache_dir": str(tmp_path / "cache"),
        "train.run_dir": str(tmp_path / "run"), "train.max_steps": 20, "train.global_batch_seqs": 8,
        "train.micro_batch_seqs": 4, "train.log_every": 1, "train.eval_every": 10, "train.eval_batches": 2,
        "train.threads": 1, "schedule.warmup_steps": 3, "checkpoint.every": 5, "log.peak_tflops": 1.0,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def partition_everything_under_zero3():
    """ZeRO-3 keeps parameters under 1e5 elements whole by default: all of a tiny model's. Tests split
    them all, so that ZeRO-3 really gathers and partitions."""
    from parallel import zero

    zero.ZERO_OVERRIDES["stage3_param_persistence_threshold"] = 0


def train_run(tmp, corpus, run, steps, extra=(), arch_config="baseline/tiny"):
    """A short run with a constant lr after one warm-up step (so runs of 3 and 5 steps share their lrs);
    returns (last record, {name: full parameter as numpy}) gathered through the engine's checkpoint view
    (layout-free: the same names and shapes under every layout). Every rank of a layout calls it."""
    import torch

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    arch = None if arch_config.startswith("baseline/") else arch_config.split("/")[0]
    over = tiny_overrides(tmp, corpus, arch, **{"train.run_dir": f"{tmp}/{run}", "train.max_steps": steps,
                                          "train.eval_every": 0, "checkpoint.every": 0,
                                          "schedule.warmup_steps": 1, "train.threads": 1,
                                          "schedule.kind": "constant"})
    if "parallel.data_parallel=deepspeed" in extra:
        partition_everything_under_zero3()
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(load_config(arch_config, over + list(extra)), log=lambda *_: None)
        record = trainer.fit()
        model_sd, _ = trainer.engine.get_state()
    finally:
        torch.set_num_threads(threads)
    return record, {k: v.detach().numpy().copy() for k, v in model_sd.items()}


def step_losses(run_dir) -> dict:
    from pretrain.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}


def write_word_tokenizer(path) -> str:
    """A Hugging Face tokenizer.json for the Markov corpus: ids 0-4 are the specials, 5.. are words
    "t5" ... (so generation from a run of that corpus decodes to text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", "<predict>"])}
    vocab.update({f"t{i}": i for i in range(5, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>", "<predict>"])
    tok.save(str(path))
    return str(path)
