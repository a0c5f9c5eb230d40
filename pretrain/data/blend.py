"""A weighted blend of datasets: deterministic, infinite, O(1) per lookup, exact per block.

Samples come in blocks of B (default 16384). Every block draws n_d samples from dataset d, where
n_d is the largest-remainder apportionment of B * w_d, so each block holds exactly those counts.
Inside a block the datasets are interleaved by sorting the "times" (k + 0.5) / n_d, k < n_d, which
spreads each dataset evenly over the block; the same pattern repeats in every block, so any window
of B consecutive samples has exactly the block's proportions.

    i -> block b = i // B, position p = i % B -> (dataset d, k) = pattern[p] -> dataset d's
    sample b * n_d + k

Unlike megatron's blend, there is no per-sample index to build or cache, and no end.
"""
from __future__ import annotations

import math
import operator

import numpy as np


def apportion(weights, total: int) -> np.ndarray:
    """Largest-remainder apportionment of `total` seats by `weights` (ties: earlier entry first)."""
    w = np.asarray(weights, dtype=np.float64)
    quota = total * w / w.sum()
    seats = np.floor(quota).astype(np.int64)
    left = total - int(seats.sum())
    # Stable sort of the negated remainders: equal remainders keep dataset order.
    seats[np.argsort(-(quota - seats), kind="stable")[:left]] += 1
    return seats


def interleave(counts) -> tuple[np.ndarray, np.ndarray]:
    """The in-block pattern: (dataset, local index) of each position, by sorted times (k+0.5)/n_d."""
    counts = np.asarray(counts, dtype=np.int64)
    d = np.repeat(np.arange(len(counts)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    # (k + 0.5) / n is one correctly rounded division of exact values, so equal fractions compare
    # equal across datasets and the stable sort breaks those ties by dataset index.
    times = (k + 0.5) / counts[d]
    order = np.argsort(times, kind="stable")
    return d[order], k[order]


def _label(dataset, index: int) -> str:
    name = getattr(dataset, "name", None)
    return f"dataset {index} ({name})" if name else f"dataset {index} ({dataset!r})"


class BlendedDataset:
    """`BlendedDataset([(weight, dataset), ...], block_size=16384)`; `ds[i]` is a child's sample."""

    def __init__(self, weighted, block_size: int = 16384):
        weighted = list(weighted)
        if not weighted:
            raise ValueError("a blend needs at least one (weight, dataset) pair")
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.datasets = [d for _, d in weighted]
        weights = []
        for index, (w, d) in enumerate(weighted):
            w = float(w)
            if not math.isfinite(w) or w <= 0:
                raise ValueError(f"{_label(d, index)} has weight {w}; weights must be positive and finite")
            weights.append(w)
        self.weights = [w / sum(weights) for w in weights]
        self.block_size = int(block_size)
        self.counts = apportion(weights, self.block_size)
        for index, n in enumerate(self.counts.tolist()):
            if n == 0:
                raise ValueError(
                    f"{_label(self.datasets[index], index)} has weight {self.weights[index]:.3g}, which "
                    f"gets no sample in a block of {self.block_size}; raise its weight or block_size"
                )
        d, k = interleave(self.counts)
        self._pattern_dataset, self._pattern_index = d, k
        self._pattern = list(zip(d.tolist(), k.tolist()))  # Python ints: the lookup is the hot path
        self._counts = self.counts.tolist()

    def source(self, i) -> tuple[int, int]:
        """(dataset index, sample index in that dataset) of blended sample i."""
        i = operator.index(i)
        if i < 0:
            raise IndexError(f"sample index {i} is negative")
        b, p = divmod(i, self.block_size)
        d, k = self._pattern[p]
        return d, b * self._counts[d] + k

    def __getitem__(self, i):
        d, k = self.source(i)
        return self.datasets[d][k]

    def sources(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `source` for an array of indices."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and idx.min() < 0:
            raise IndexError("sample indices must be non-negative")
        b, p = np.divmod(idx, self.block_size)
        d = self._pattern_dataset[p]
        return d, b * self.counts[d] + self._pattern_index[p]

    def get_many(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n, L+1], doc_ids [n, L+1]) like PackedDataset.get_many, grouped per child."""
        d, k = self.sources(np.asarray(indices, dtype=np.int64).reshape(-1))
        tokens = doc_ids = None
        for c in np.unique(d).tolist():
            rows = np.flatnonzero(d == c)
            t, di = self.datasets[c].get_many(k[rows])
            if tokens is None:
                tokens = np.empty((len(d),) + t.shape[1:], t.dtype)
                doc_ids = np.empty((len(d),) + di.shape[1:], di.dtype)
            tokens[rows], doc_ids[rows] = t, di
        if tokens is None:
            raise ValueError("get_many needs at least one index")
        return tokens, doc_ids

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g}: {_label(d, i)}" for i, (w, d) in enumerate(zip(self.weights, self.datasets)))
        return f"BlendedDataset([{parts}], block_size={self.block_size})"
