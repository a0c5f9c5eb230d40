"""Associative recall (spec-002 §6 T10): key-value pairs, then queries of their keys.

Parameters: `pairs` pairs, `queries` queries, `keys` key tokens, `values` value tokens. A sequence is

    k_1 v_1 k_2 v_2 ... k_P v_P    q_1 val(q_1) q_2 val(q_2) ... q_Q val(q_Q)

with P distinct keys, values drawn with replacement, and each query one of the P keys (with
replacement). The loss sits only at query keys, whose target is the key's value (the next token):
answering needs the pair seen earlier, which a fixed-size state must have stored. Length 2(P + Q):
48 for the spec's 8 pairs and 16 queries. One accuracy group, `query`.

Token ids: keys 0 .. keys-1, values keys .. keys+values-1 (the spec's vocabulary of 64 at 32 + 32).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pretrain.tasks import Sample, TaskSpec, register


@dataclass
class AssociativeRecallConfig:
    pairs: int = 8
    queries: int = 16
    keys: int = 32
    values: int = 32

    def validate(self) -> None:
        if self.pairs < 1 or self.queries < 1:
            raise ValueError(f"data.task_params.pairs and queries must be at least 1, got {self.pairs} and "
                             f"{self.queries}")
        if self.keys < self.pairs:
            raise ValueError(f"data.task_params.keys {self.keys} must be at least data.task_params.pairs "
                             f"{self.pairs}, so that a sequence's keys are distinct")
        if self.values < 2:
            raise ValueError(f"data.task_params.values must be at least 2, got {self.values}")


def sample(cfg: AssociativeRecallConfig, rng: np.random.Generator) -> Sample:
    P, Q = cfg.pairs, cfg.queries
    keys = rng.choice(cfg.keys, size=P, replace=False)
    values = cfg.keys + rng.integers(0, cfg.values, size=P)
    asked = rng.integers(0, P, size=Q)
    tokens = np.empty(2 * (P + Q), dtype=np.int64)
    tokens[0:2 * P:2], tokens[1:2 * P:2] = keys, values
    tokens[2 * P::2], tokens[2 * P + 1::2] = keys[asked], values[asked]
    targets = np.full_like(tokens, -1)
    targets[2 * P::2] = values[asked]
    groups = np.where(targets >= 0, 0, -1)
    return Sample(tokens, targets, groups)


SPEC = register(TaskSpec(
    name="associative_recall",
    config_cls=AssociativeRecallConfig,
    vocab_size=lambda c: c.keys + c.values,
    seq_len=lambda c: 2 * (c.pairs + c.queries),
    sample=sample,
    group_names=lambda c: ["query"],
))
