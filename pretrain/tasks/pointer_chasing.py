"""Pointer chasing (spec-000 section 4.10): follow a chain of H table lookups to a value.

Parameters: H hops (`hops`), M keys per level (`keys`), `values` distinct value tokens. Each level
l = 0..H has its own M keys kl_j. The sequence is

    level-0 table    v = k0_j            for j = 0..M-1 (M distinct random values), then ||
    query section    Q k0_j val(k0_j)    for j = 0..M-1, then ||
    level-l table    k{l-1}_pi(j) = kl_j for j = 0..M-1 (pi a random permutation), then ||   (l = 1..H)
    query section    Q kl_j val(kl_j)    for j = 0..M-1, then ||                             (l = 1..H-1)
    final query      Q kH_q              (q random)

so kl_j's value is found by following kl_j -> k{l-1}_pi(j) -> ... -> k0_* -> v. Length
H(6M+2) + 3M + 3: 52 for (H, M) = (2, 3), 338 for (10, 5). The loss sits only at query keys, whose
target is the key's value (the next token in the literal encoding; the last position's target is the
final answer). Each target's level is its group: accuracy is reported for L0 .. LH, LH being the one
final query per sequence.

answers_in_input=False (spec-000 7.20) writes `Q kl_j ?` in the query sections: the value is then
only a target, never an input, which removes the shortcut of copying a previous section's answers.

Token ids: values 0 .. values-1, then key kl_j at values + l*M + j, then `=`, `Q`, `||`, and `?`
(only in the vocabulary when answers are hidden). For (10, 5, 10) the literal vocabulary is 68 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pretrain.tasks import Sample, TaskSpec, register


@dataclass
class PointerChasingConfig:
    hops: int = 10  # H: table lookups from the final query to a value (levels 0 .. H)
    keys: int = 5  # M: keys per level
    values: int = 10  # n_val: value tokens; the level-0 table uses M distinct ones
    answers_in_input: bool = True  # literal encoding (spec default); false: query sections show `Q k ?`

    def validate(self) -> None:
        if self.hops < 1:
            raise ValueError(f"data.task_params.hops must be at least 1, got {self.hops}")
        if self.keys < 2:
            raise ValueError(f"data.task_params.keys must be at least 2 (one key is no lookup), got {self.keys}")
        if self.values < self.keys:
            raise ValueError(f"data.task_params.values {self.values} must be at least data.task_params.keys "
                             f"{self.keys}, so that the level-0 table's values are distinct")


class Layout:
    """Token ids of one configuration."""

    def __init__(self, cfg: PointerChasingConfig):
        self.cfg = cfg
        H, M, V = cfg.hops, cfg.keys, cfg.values
        self.eq, self.query, self.sep = V + (H + 1) * M, V + (H + 1) * M + 1, V + (H + 1) * M + 2
        self.hidden = self.sep + 1 if not cfg.answers_in_input else None
        self.vocab_size = self.sep + 1 + (0 if cfg.answers_in_input else 1)
        self.length = H * (6 * M + 2) + 3 * M + 3

    def key(self, level: int, j: int) -> int:
        return self.cfg.values + level * self.cfg.keys + j

    def name(self, token: int) -> str:
        """Readable form of a token: v3, k2_1, =, Q, ||, ?"""
        V, M = self.cfg.values, self.cfg.keys
        if 0 <= token < V:
            return f"v{token}"
        if V <= token < self.eq:
            return f"k{(token - V) // M}_{(token - V) % M}"
        names = {self.eq: "=", self.query: "Q", self.sep: "||", self.hidden: "?"}
        if token not in names:
            raise ValueError(f"token {token} is not in the pointer-chasing vocabulary of {self.vocab_size}")
        return names[token]


def vocab_size(cfg: PointerChasingConfig) -> int:
    return Layout(cfg).vocab_size


def seq_len(cfg: PointerChasingConfig) -> int:
    return Layout(cfg).length


def sample(cfg: PointerChasingConfig, rng: np.random.Generator) -> Sample:
    """One sequence with its targets and their levels, drawn from `rng` (deterministic given it)."""
    lay, H, M = Layout(cfg), cfg.hops, cfg.keys
    tokens = np.empty(lay.length, dtype=np.int64)
    targets = np.full(lay.length, -1, dtype=np.int64)
    levels = np.full(lay.length, -1, dtype=np.int64)
    pos = 0

    def put(*toks):
        nonlocal pos
        tokens[pos : pos + len(toks)] = toks
        pos += len(toks)

    value = rng.choice(cfg.values, size=M, replace=False)  # value[j] = val(kl_j) at the current level l
    for j in range(M):
        put(value[j], lay.eq, lay.key(0, j))
    put(lay.sep)
    for level in range(H + 1):
        if level:
            pi = rng.permutation(M)
            for j in range(M):
                put(lay.key(level - 1, pi[j]), lay.eq, lay.key(level, j))
            put(lay.sep)
            value = value[pi]  # kl_j points at k{l-1}_pi(j), so it has that key's value
        if level < H:
            for j in range(M):
                put(lay.query, lay.key(level, j))
                targets[pos - 1], levels[pos - 1] = value[j], level
                put(value[j] if cfg.answers_in_input else lay.hidden)
            put(lay.sep)
    q = int(rng.integers(M))
    put(lay.query, lay.key(H, q))
    targets[pos - 1], levels[pos - 1] = value[q], H
    assert pos == lay.length
    return Sample(tokens, targets, levels)


class Sequences(NamedTuple):
    tokens: np.ndarray  # int64 [n, T]
    targets: np.ndarray  # int64 [n, T]: the answer value at query keys, -1 elsewhere
    levels: np.ndarray  # int64 [n, T]: the level of each target, -1 elsewhere


def generate(cfg: PointerChasingConfig, n: int, seed: int) -> Sequences:
    """`n` sequences, deterministic given the seed (tests, notebooks; the trainer draws sample by
    sample through pretrain.tasks.TaskDataset)."""
    cfg.validate()
    rng = np.random.default_rng(seed)
    rows = [sample(cfg, rng) for _ in range(n)]
    return Sequences(*(np.stack(col) for col in zip(*rows)))


def accuracy_per_level(predictions: np.ndarray, targets: np.ndarray, levels: np.ndarray,
                       hops: int) -> np.ndarray:
    """Argmax accuracy per level 0..hops, pooled over sequences (NaN for a level without targets).
    `predictions` [n, T] are the argmax tokens at every position."""
    has = targets >= 0
    correct = np.bincount(levels[has], weights=(predictions[has] == targets[has]).astype(np.float64),
                          minlength=hops + 1)
    total = np.bincount(levels[has], minlength=hops + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return correct / total


SPEC = register(TaskSpec(
    name="pointer_chasing",
    config_cls=PointerChasingConfig,
    vocab_size=vocab_size,
    seq_len=seq_len,
    sample=sample,
    group_names=lambda cfg: [f"L{level}" for level in range(cfg.hops + 1)],
))
