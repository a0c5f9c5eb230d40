"""Fixed-length training samples packed across documents, in an order fixed by (seed, epoch, config).

Each epoch of a split is independent and built lazily:

    doc order   a permutation of the split's documents (numpy PCG64, seeded from a sha256 of
                seed, epoch, split, seq_len and the dataset's identity)
    stream      the documents concatenated in that order
    samples     S = (split_tokens - 1) // seq_len per epoch, the same every epoch; sample j is stream
                tokens [j*seq_len, j*seq_len + seq_len + 1) (inputs [:-1], labels [1:]); the last
                < seq_len tokens of the stream are dropped
    shuffle     a second permutation of the S samples, so one long document does not fill a batch

Global sample i is sample (i % S) of epoch i // S, so the dataset is infinite and sample i is a pure
function of i and the configuration. The per-epoch arrays come from searchsorted over a cumsum (no
Python loop over documents or samples, no compiled helper) and are cached on disk (cache.py).
"""
from __future__ import annotations

import math
import operator
import os
import re
import threading

import numpy as np

from data_tools.indexed import IndexedDataset, file_stamp
from pretrain.data.cache import load_or_build, stable_hash

FORMAT_VERSION = 1  # bump when the cached arrays or the order they define change
SPLIT_NAMES = ("train", "valid", "test")
_EPOCH_NAMES = ["doc_order", "sample_starts", "sample_shuffle", "doc_bounds", "samples"]
_EPOCHS_KEPT = 4  # loaded epochs kept open: a global batch can straddle an epoch boundary


def parse_split(split) -> list[float]:
    """Megatron-style "949,50,1" (or "949/50/1", or a sequence) -> 3 weights summing to 1."""
    parts = re.split(r"[,/]", split) if isinstance(split, str) else list(split)
    try:
        w = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise ValueError(f"split {split!r}: expected up to 3 numbers like '949,50,1'") from None
    if not 1 <= len(w) <= 3:
        raise ValueError(f"split {split!r}: expected 1 to 3 weights (train, valid, test), got {len(w)}")
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"split {split!r}: weights must be finite, non-negative and not all zero")
    w += [0.0] * (3 - len(w))
    total = sum(w)
    return [x / total for x in w]


def split_document_ranges(split, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) document ranges of train/valid/test: boundaries at round(cumulative share)."""
    cum = np.cumsum([0.0] + parse_split(split))
    bounds = [int(round(c * num_documents)) for c in cum]
    bounds[-1] = num_documents  # float error must never lose the last document
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


class PackedDataset:
    """Packed `seq_len + 1`-token samples of one split of an indexed (.bin/.idx) dataset.

    `ds[i]` -> {"tokens": int64 [seq_len+1], "doc_ids": int32 [seq_len+1]}, where doc_ids numbers
    the documents within the sample from 0. Any i >= 0 is valid (epoch i // samples_per_epoch);
    `len(ds)` is the number of samples per epoch. `doc_ids` is read-only (often a view of a shared
    constant, which saves an allocation per sample); `get_many` returns fresh writable arrays.

    The epoch index arrays are cached under `cache_dir` (default `<dataset dir>/.cache/packed/`)
    in a directory named by the hash of every input, built once even when many ranks start at once.
    `name` (default: the file name of the prefix) enters the seed, so two copies of a dataset at
    different paths give the same order, and two different datasets of equal size do not.
    """

    def __init__(
        self,
        dataset: str | os.PathLike | IndexedDataset,
        seq_len: int,
        *,
        seed: int = 1234,
        split="949,50,1",
        split_name: str = "train",
        cache_dir: str | os.PathLike | None = None,
        name: str | None = None,
        _lock: bool = True,
    ):
        if isinstance(dataset, IndexedDataset):
            self.indexed = dataset
        else:
            self.indexed = IndexedDataset(dataset)
        prefix = self.indexed.prefix
        self._args = dict(
            dataset=prefix, seq_len=seq_len, seed=seed, split=split, split_name=split_name,
            cache_dir=cache_dir, name=name, _lock=_lock,
        )
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if split_name not in SPLIT_NAMES:
            raise ValueError(f"split_name must be one of {SPLIT_NAMES}, got {split_name!r}")
        self.seq_len, self.seed, self.split_name = int(seq_len), int(seed), split_name
        self.split = parse_split(split)
        self.name = name if name is not None else os.path.basename(prefix)
        self.cache_dir = os.fspath(
            cache_dir if cache_dir is not None
            else os.path.join(os.path.dirname(os.path.abspath(prefix)), ".cache", "packed")
        )
        self._lock = _lock

        starts, lengths = self.indexed.document_token_bounds()
        lo, hi = split_document_ranges(split, len(lengths))[SPLIT_NAMES.index(split_name)]
        if hi <= lo:
            raise ValueError(
                f"split {split_name!r} of {prefix} has no documents (split {split!r} over "
                f"{len(lengths)} documents gives it [{lo}, {hi}))"
            )
        # Empty documents contribute no tokens; dropping them keeps every doc id of a sample real.
        self._split_docs = lo + np.flatnonzero(lengths[lo:hi])
        self._doc_starts, self._doc_lengths = starts, lengths
        self.split_tokens = int(lengths[lo:hi].sum())
        self.samples_per_epoch = (self.split_tokens - 1) // self.seq_len
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"split {split_name!r} of {prefix} has {self.split_tokens} tokens, not enough for "
                f"one sample of seq_len + 1 = {self.seq_len + 1} tokens"
            )
        self.document_range = (lo, hi)

        # What the order depends on (no paths or mtimes: a copied dataset keeps its order) ...
        self._identity = dict(
            version=FORMAT_VERSION, name=self.name, num_documents=self.indexed.num_documents,
            num_tokens=self.indexed.num_tokens, dtype=str(self.indexed.dtype), split=self.split,
            split_name=split_name, seq_len=self.seq_len, seed=self.seed,
        )
        # ... and what the cache additionally depends on: these exact files.
        self._stamp = dict(
            path=os.path.realpath(prefix),
            idx=file_stamp(self.indexed.idx_file), bin=file_stamp(self.indexed.bin_file),
        )
        self.num_builds = 0  # epochs this object built rather than loaded (tests check reuse)
        self._data = np.asarray(self.indexed.tokens)  # plain ndarray: np.memmap slicing is slow
        self._data_mv = memoryview(self._data)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._epoch = None
        self._table = self._bounds = None
        self._L1 = L1 = self.seq_len + 1
        # L1 zeros then L1 ones: every one- or two-document sample's doc_ids is a view of it.
        self._step = np.repeat(np.arange(2, dtype=np.int32), L1)
        self._step.flags.writeable = False
        self._zeros = self._step[:L1]
        self._tls = threading.local()  # per-thread scratch buffers, so threads may share the dataset

    # -- pickling: DataLoader workers reopen the files instead of copying the memory maps ------
    def __getstate__(self):
        return {"args": self._args, "stamp": self._stamp}

    def __setstate__(self, state):
        args = dict(state["args"])
        self.__init__(IndexedDataset(args.pop("dataset"), verify=False), **args)
        if self._stamp != state["stamp"]:
            raise RuntimeError(f"{self.indexed.prefix} changed on disk since the dataset was created")

    # -- epoch index ---------------------------------------------------------------------------
    def cache_inputs(self, epoch: int) -> dict:
        """Every input of epoch `epoch`'s index arrays; the cache directory is their sha256."""
        return dict(self._identity, **self._stamp, epoch=int(epoch))

    def cache_path(self, epoch: int) -> str:
        return os.path.join(self.cache_dir, stable_hash(self.cache_inputs(epoch)))

    def _build_epoch(self, epoch: int) -> dict[str, np.ndarray]:
        self.num_builds += 1
        entropy = int(stable_hash(dict(self._identity, epoch=int(epoch))), 16)
        doc_seed, sample_seed = np.random.SeedSequence(entropy).spawn(2)
        n, S, L = len(self._split_docs), self.samples_per_epoch, self.seq_len

        order = self._split_docs[np.random.Generator(np.random.PCG64(doc_seed)).permutation(n)]
        lengths = self._doc_lengths[order]
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=cum[1:])
        # Start of sample j (and j = S, whose first token ends sample S-1) in the stream, as
        # (position in the doc order, offset in that document). side="right" skips to the
        # document that actually holds the token.
        targets = np.arange(S + 1, dtype=np.int64) * L
        pos = np.searchsorted(cum, targets, side="right") - 1
        offset = targets - cum[pos]
        shuffle = np.random.Generator(np.random.PCG64(sample_seed)).permutation(S)

        # Derived tables for __getitem__: absolute [start, end) of each ordered document in the
        # .bin, and per shuffled sample: its [start, end) in the .bin as if contiguous, the doc
        # positions of its first and last document, the end of the first and start of the last.
        doc_start = self._doc_starts[order]
        token = doc_start[pos] + offset
        doc_end = doc_start + lengths
        samples = np.stack(
            [token[:-1], token[1:] + 1, pos[:-1], pos[1:], doc_end[pos[:-1]], doc_start[pos[1:]]], axis=1
        )[shuffle]
        idx_type = np.int32 if max(n, S) < 2**31 else np.int64
        return {
            "doc_order": order.astype(idx_type),
            "sample_starts": np.stack([pos, offset], axis=1),
            "sample_shuffle": shuffle.astype(idx_type),
            "doc_bounds": np.stack([doc_start, doc_end], axis=1),
            "samples": samples,
        }

    def epoch_arrays(self, epoch: int) -> dict[str, np.ndarray]:
        """The (memory-mapped, read-only) index arrays of `epoch`, building the cache if needed."""
        if epoch < 0:
            raise IndexError(f"epoch {epoch} is negative")
        arrays, _, _ = load_or_build(
            self.cache_dir, self.cache_inputs(epoch), lambda: self._build_epoch(epoch),
            _EPOCH_NAMES, _lock=self._lock,
        )
        return arrays

    def _use_epoch(self, epoch: int) -> None:
        if epoch not in self._epochs:
            if len(self._epochs) >= _EPOCHS_KEPT:
                self._epochs.pop(next(iter(self._epochs)))
            a = self.epoch_arrays(epoch)
            self._epochs[epoch] = (np.asarray(a["samples"]), np.asarray(a["doc_bounds"]))
        self._table, self._bounds = self._epochs[epoch]
        self._epoch = epoch

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, i) -> dict[str, np.ndarray]:
        e, j = divmod(operator.index(i), self.samples_per_epoch)
        if e != self._epoch:
            if i < 0:
                raise IndexError(f"sample index {i} is negative")
            self._use_epoch(e)
        a, b, p0, p1, end0, start1 = self._table[j].tolist()
        if p0 == p1:  # the whole sample lies inside one document: one copy, all doc ids 0
            return {"tokens": self._data[a:b].astype(np.int64), "doc_ids": self._zeros}
        # Gather into this thread's scratch buffer, in the storage dtype and through memoryviews
        # (a numpy slice assignment costs twice as much, a casting one four times), then widen
        # once: astype makes the fresh int64 array we return.
        try:
            raw, out = self._tls.scratch
        except AttributeError:
            raw = np.empty(self._L1, self._data.dtype)
            raw, out = self._tls.scratch = raw, memoryview(raw)
        if p1 == p0 + 1:  # two documents: w zeros then ones is a read-only view of _step
            w = end0 - a
            out[:w] = self._data_mv[a:end0]
            out[w:] = self._data_mv[start1:b]
            return {"tokens": raw.astype(np.int64), "doc_ids": self._step[self._L1 - w : 2 * self._L1 - w]}
        doc_ids = np.empty(self._L1, np.int32)
        self._gather(a, b, p0, p1, end0, start1, out, doc_ids)
        return {"tokens": raw.astype(np.int64), "doc_ids": doc_ids}

    def _gather(self, a, b, p0, p1, end0, start1, out, doc_ids: np.ndarray) -> None:
        """Copy one sample into the memoryview `out` and its doc ids into the int32 array `doc_ids`.

        The sample is .bin tokens [a, b) when it lies in one document (p0 == p1); otherwise
        [a, end0) of ordered document p0, the whole documents p0+1 .. p1-1, and [start1, b) of p1.
        Doc ids are built as the sum of one 0-then-1 step (a view of _step) per document boundary,
        which costs less than filling each document's run.
        """
        data, step, L1 = self._data_mv, self._step, self._L1
        if p0 == p1:
            out[:] = data[a:b]
            doc_ids[:] = 0
            return
        w = end0 - a
        out[:w] = data[a:end0]
        ids = step[L1 - w : 2 * L1 - w]  # 0 before the first boundary, 1 after
        for lo, hi in self._bounds[p0 + 1 : p1].tolist():
            out[w : w + hi - lo] = data[lo:hi]
            w += hi - lo
            ids = np.add(ids, step[L1 - w : 2 * L1 - w], out=doc_ids)  # one pass per boundary
        if ids is not doc_ids:
            doc_ids[:] = ids
        out[w:] = data[start1:b]

    def get_many(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Samples `indices` as (tokens int64 [n, seq_len+1], doc_ids int32 [n, seq_len+1]).

        Equal to stacking `ds[i]` for each i, with one widening copy for the whole batch.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise IndexError("sample indices must be non-negative")
        L1 = self._L1
        raw = np.empty(idx.size * L1, self._data.dtype)
        doc_ids = np.empty(idx.size * L1, np.int32)
        raw_mv = memoryview(raw)
        epochs, js = np.divmod(idx, self.samples_per_epoch)
        for e in np.unique(epochs).tolist():
            self._use_epoch(e)
            rows = np.flatnonzero(epochs == e)
            for r, row in zip(rows.tolist(), self._table[js[rows]].tolist()):
                self._gather(*row, raw_mv[r * L1 : (r + 1) * L1], doc_ids[r * L1 : (r + 1) * L1])
        return raw.astype(np.int64).reshape(-1, L1), doc_ids.reshape(-1, L1)

    def __repr__(self) -> str:
        return (
            f"PackedDataset({self.indexed.prefix!r}, split={self.split_name!r}, seq_len={self.seq_len}, "
            f"seed={self.seed}, samples_per_epoch={self.samples_per_epoch})"
        )
