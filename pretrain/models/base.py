"""What every architecture shares with the rest of the code: its config's base and the step context.

The model contract (docs/adding-an-architecture.md):

    loss, diagnostics = model(batch, ctx)

- `batch` is a pretrain.data.Batch; `loss` is the mean next-token loss over the tokens where
  `batch.loss_mask` is True (the trainer weights micro batches by that count, so the step's loss is
  the token mean over the global batch).
- `ctx` is a StepContext: the optimizer step, whether this is training or evaluation, and a per-step
  seed that every rank and a resumed run share. A per-step draw (CRT's K, CART's R) comes from
  `ctx.generator()`, never from the global RNG, so it is the same on every rank and after a resume.
- `diagnostics` maps names to scalar tensors, each a token mean over this micro batch like the loss;
  the trainer reduces them the same way (token-weighted over micro batches and data-parallel ranks)
  and logs them; in evaluation (`ctx.training` False) they are logged as `val_<name>`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class ModelConfig:
    """Fields the trainer, the data path and the CLI read from every architecture's config."""

    arch: str = ""
    vocab_size: int = 50304
    max_seq_len: int = 4096  # the longest sequence the model accepts (RoPE table, decode cache)
    # The parameter count the architecture's paper gives for this config (0: none declared), checked
    # by the registry-wide tests; params_rounded: the paper rounds it (checked within 0.1%).
    paper_params: int = 0
    paper_params_rounded: bool = False

    def validate(self) -> None:
        for name in ("vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.paper_params < 0:
            raise ValueError(f"model.paper_params must be >= 0, got {self.paper_params}")

    def validate_run(self, run) -> None:
        """Checks that need the rest of the run's config (a RunConfig: sequence length, micro batch,
        parallel layout), called by its validate() before any work; raise ValueError in one sentence."""


def tokenizer_ids(run) -> dict[str, int | None] | None:
    """The special ids of the run's tokenizer (data_tools.tokenizer's special_ids), None without one (a
    synthetic task, or a missing file, which the data check reports)."""
    import os

    path = run.data.tokenizer
    if run.data.task or not path or not os.path.isfile(path):
        return None
    from data_tools.tokenizer import load_tokenizer

    return load_tokenizer(path).special_ids()


def check_eos_id(cfg: ModelConfig, reads: str, run=None) -> None:
    """model.eos_id, where inference reads the documents off the tokens (with model.<reads> on, the field
    that makes training follow documents): a token id below model.vocab_size and, given the run's
    config, its tokenizer's end of a document (training reads documents from the data instead)."""
    if not getattr(cfg, reads):
        return
    if not 0 <= cfg.eos_id < cfg.vocab_size:
        raise ValueError(f"model.eos_id {cfg.eos_id} must be a token id below model.vocab_size {cfg.vocab_size} "
                         f"(with model.{reads}, inference starts a new document after it)")
    ids = tokenizer_ids(run) if run is not None else None
    if ids is not None and ids["eos"] != cfg.eos_id:
        raise ValueError(f"model.eos_id {cfg.eos_id} is not data.tokenizer's end-of-document id {ids['eos']}; "
                         f"set model.eos_id={ids['eos']}")


def doc_ids_of(tokens: Tensor, eos_id: int, first: Tensor | None = None) -> Tensor:
    """Document index of each position of tokens [B, n], an EOS belonging to the document it ends (the data
    path's convention), counting from `first` [B] (the document the first token continues; 0 if None)."""
    eos = (tokens == eos_id).long()
    doc = eos.cumsum(1) - eos
    return doc if first is None else doc + first[:, None]


def continue_doc_ids(tokens: Tensor, eos_id: int, first: Tensor) -> tuple[Tensor, Tensor]:
    """doc_ids_of for a stream fed in pieces: the pieces' ids, and the document [B] the next piece begins in."""
    doc = doc_ids_of(tokens, eos_id, first)
    return doc, doc[:, -1] + (tokens[:, -1] == eos_id).long()


def step_seed(run_seed: int, step: int) -> int:
    """A 63-bit seed for step `step` of a run seeded `run_seed`: a pure function of both (numpy's
    SeedSequence mixes them), so ranks and resumed runs agree without communicating."""
    return int(np.random.SeedSequence([run_seed, step]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class StepContext:
    step: int = 0  # the optimizer step being computed (0-based)
    seed: int = 0  # step_seed(train.seed, step)
    training: bool = True

    @classmethod
    def for_step(cls, run_seed: int, step: int, training: bool = True) -> "StepContext":
        return cls(step, step_seed(run_seed, step), training)

    def generator(self, device="cpu") -> torch.Generator:
        """A generator seeded for this step: draws from it are the same on every rank."""
        return torch.Generator(device=device).manual_seed(self.seed)


EVAL = StepContext(training=False)  # the context of an evaluation or inference forward
