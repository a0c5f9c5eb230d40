"""Megatron's indexed dataset format: a `.bin` of raw tokens and an `.idx` index (MMIDIDX, version 1).

The layout is byte-compatible with `megatron.core.datasets.indexed_dataset`:

    .bin  the C-order concatenation of every sequence's tokens, no header
    .idx  little-endian:
          9 B    magic b"MMIDIDX\\x00\\x00"
          8 B    <Q version = 1
          1 B    <B dtype code (DTYPE_CODES below; megatron-core's table, not gpt-neox's legacy one)
          8 B    <Q sequence count S
          8 B    <Q document count D (document_indices has D entries and starts with 0)
          4*S B  int32 sequence lengths
          8*S B  int64 sequence byte offsets into .bin
          8*D B  int64 document indices: sequence index where each document ends, after a leading 0
          S B    int8 sequence modes, only in multimodal files

`IndexedWriter` streams: sizes and document ends spill to temporary files, so memory stays bounded
however large the corpus is, and `finalize()` publishes the pair atomically (a crash never leaves an
`.idx` that looks valid). `IndexedDataset` validates every structural fact of the pair on open and
raises `IndexedFormatError`, with one line naming the file and the problem, instead of returning
corrupt data.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from .files import atomic_write, fsync_path  # fsync_path stays importable from here

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

# Token ids are written as unsigned 16-bit below this vocabulary size, else int32 (megatron's rule).
UINT16_VOCAB_LIMIT = 65500
_SPILL_ENTRIES = 1 << 20  # sizes/doc ends kept in memory before spilling to the temp files


class IndexedFormatError(ValueError):
    """A `.bin`/`.idx` pair (or data written to one) violates the format; the message names the file."""


def optimal_dtype(vocab_size: int) -> type:
    """The token dtype megatron picks for a vocabulary: uint16 below 65,500 entries, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT else np.int32


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def strip_suffix(path: str | os.PathLike) -> str:
    """Accept `x`, `x.bin` or `x.idx` and return the prefix `x`."""
    p = os.fspath(path)
    return p[:-4] if p.endswith((".bin", ".idx")) else p


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def file_stamp(path: str | os.PathLike) -> list[int]:
    """[size, mtime_ns] of a file: what caches derived from it are keyed by."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _token_limits(dtype: np.dtype) -> tuple[int, int]:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return max(int(info.min), 0), int(info.max)
    raise IndexedFormatError(f"token dtype {dtype} is not an integer type")


class IndexedWriter:
    """Streams sequences into `{prefix}.bin`/`.idx`; nothing appears under the final names before
    `finalize()`, and `finalize()` publishes the `.bin` before the `.idx`.

    Use as a context manager: an exception inside the block removes every temporary file.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise IndexedFormatError(f"dtype {self.dtype} has no code in the MMIDIDX format")
        self._lo, self._hi = _token_limits(self.dtype)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = bin_path(self.prefix) + tag
        self._idx_tmp = idx_path(self.prefix) + tag
        self._sizes_tmp = self.prefix + ".sizes" + tag
        self._docs_tmp = self.prefix + ".docs" + tag
        Path(self._bin_tmp).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._sizes_f = open(self._sizes_tmp, "wb")
        self._docs_f = open(self._docs_tmp, "wb")
        self._sizes: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._pending = 0
        self.num_sequences = 0
        self.num_documents = 0  # documents ended so far (document_indices has one more entry)
        self.num_tokens = 0
        self._closed = False

    # -- adding data -------------------------------------------------------------------------
    def _check_range(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < self._lo or hi > self._hi:
            bad = lo if lo < self._lo else hi
            raise IndexedFormatError(
                f"token id {bad} does not fit the dataset dtype {self.dtype} "
                f"(allowed {self._lo}..{self._hi}); use a wider dtype (int32) for this tokenizer"
            )

    def add_sequences(self, tokens, sizes, end_documents: bool = True) -> None:
        """Append sequences given as one flat token array and their lengths.

        With `end_documents` each sequence is its own document (megatron's layout without sentence
        splitting); otherwise call `end_document()` to close the document they belong to.
        """
        tokens = np.asarray(tokens)
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.ndim != 1 or tokens.ndim != 1:
            raise IndexedFormatError("add_sequences expects a flat token array and a 1-D size array")
        if int(sizes.sum()) != tokens.size:
            raise IndexedFormatError(
                f"sizes add up to {int(sizes.sum())} tokens but {tokens.size} tokens were given"
            )
        if sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
            raise IndexedFormatError("a sequence length is negative or longer than 2**31-1 tokens")
        if tokens.dtype != self.dtype:
            if tokens.dtype.kind not in "iu":
                raise IndexedFormatError(f"token array has non-integer dtype {tokens.dtype}")
            self._check_range(tokens)
            tokens = tokens.astype(self.dtype)
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        n = sizes.size
        self._sizes.append(sizes.astype(np.int32))
        first = self.num_sequences
        self.num_sequences += n
        self.num_tokens += tokens.size
        self._pending += n
        if end_documents and n:
            self._docs.append(np.arange(first + 1, first + n + 1, dtype=np.int64))
            self.num_documents += n
            self._pending += n
        if self._pending >= _SPILL_ENTRIES:
            self._spill()

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence."""
        tokens = np.asarray(tokens)
        self.add_sequences(tokens.reshape(-1), [tokens.size], end_documents=True)

    def end_document(self) -> None:
        """Close the current document after sequences added with `end_documents=False`."""
        self._docs.append(np.array([self.num_sequences], dtype=np.int64))
        self.num_documents += 1
        self._pending += 1

    def append_dataset(self, other: "IndexedDataset", chunk_bytes: int = 64 << 20) -> None:
        """Append a whole dataset (same dtype) by copying its files: the core of `merge`."""
        if other.dtype != self.dtype:
            raise IndexedFormatError(
                f"cannot merge {other.prefix} (dtype {other.dtype}) into a {self.dtype} dataset; "
                "all inputs of a merge must share one token dtype"
            )
        if other.sequence_modes is not None:
            raise IndexedFormatError(f"{other.prefix} is multimodal; merging those is not supported")
        self._bin.flush()
        with open(other.bin_file, "rb") as src:
            _copy_file(src, self._bin, other.num_tokens * self.dtype.itemsize, chunk_bytes)
        seq_base = self.num_sequences
        self._sizes.append(np.asarray(other.sequence_lengths, dtype=np.int32))
        self._docs.append(np.asarray(other.document_indices[1:], dtype=np.int64) + seq_base)
        self.num_sequences += len(other.sequence_lengths)
        self.num_documents += len(other.document_indices) - 1
        self.num_tokens += other.num_tokens
        self._spill()

    def _spill(self) -> None:
        for arr, f in ((self._sizes, self._sizes_f), (self._docs, self._docs_f)):
            for a in arr:
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            arr.clear()
        self._pending = 0

    # -- finishing ---------------------------------------------------------------------------
    def finalize(self) -> None:
        """Write the index and publish `{prefix}.bin` then `{prefix}.idx` by atomic renames."""
        if self._closed:
            raise IndexedFormatError(f"writer for {self.prefix} is already closed")
        self._spill()
        for f in (self._bin, self._sizes_f, self._docs_f):
            f.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._sizes_f.close()
        self._docs_f.close()
        try:
            self._write_index()
            # An old .idx must not describe the new .bin, even for an instant.
            if os.path.exists(idx_path(self.prefix)):
                os.unlink(idx_path(self.prefix))
            os.replace(self._bin_tmp, bin_path(self.prefix))
            os.replace(self._idx_tmp, idx_path(self.prefix))
            fsync_path(os.path.dirname(os.path.abspath(self.prefix)))
        finally:
            self._closed = True
            self._remove_temps()

    def _write_index(self) -> None:
        block = _SPILL_ENTRIES
        itemsize = self.dtype.itemsize
        with open(self._idx_tmp, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", _CODE_OF[self.dtype]))
            out.write(struct.pack("<Q", self.num_sequences))
            out.write(struct.pack("<Q", self.num_documents + 1))
            with open(self._sizes_tmp, "rb") as f:  # sizes, streamed
                _copy_file(f, out, self.num_sequences * 4, 64 << 20)
            sizes = np.memmap(self._sizes_tmp, dtype=np.int32, mode="r") if self.num_sequences else None
            offset = 0
            for start in range(0, self.num_sequences, block):  # pointers = exclusive byte cumsum
                s = np.asarray(sizes[start : start + block], dtype=np.int64) * itemsize
                ptr = np.cumsum(s) - s + offset
                offset += int(s.sum())
                out.write(memoryview(ptr).cast("B"))
            del sizes
            out.write(memoryview(np.zeros(1, dtype=np.int64)).cast("B"))
            with open(self._docs_tmp, "rb") as f:
                _copy_file(f, out, self.num_documents * 8, 64 << 20)
            out.flush()
            os.fsync(out.fileno())

    def abort(self) -> None:
        """Drop everything written so far; the final names are left untouched."""
        if not self._closed:
            for f in (self._bin, self._sizes_f, self._docs_f):
                f.close()
            self._closed = True
        self._remove_temps()

    def _remove_temps(self) -> None:
        for p in (self._bin_tmp, self._idx_tmp, self._sizes_tmp, self._docs_tmp):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


def _copy_file(src, dst, nbytes: int, chunk: int) -> None:
    """Copy exactly `nbytes` from `src` to `dst`, in the kernel when possible."""
    left = nbytes
    dst.flush()  # copy_file_range writes at the descriptor's offset, behind Python's buffer
    try:
        while left > 0:
            n = os.copy_file_range(src.fileno(), dst.fileno(), min(left, 1 << 30))
            if n == 0:
                break
            left -= n
    except (AttributeError, OSError):
        pass
    while left > 0:
        buf = src.read(min(chunk, left))
        if not buf:
            break
        dst.write(buf)
        left -= len(buf)
    if left:
        raise IndexedFormatError(f"{getattr(src, 'name', src)} ended {left} bytes early while copying")


class IndexedDataset:
    """Reads a `.bin`/`.idx` pair through memory maps after checking that the two agree.

    `ds[i]` is sequence i as a read-only array view; `ds.tokens` is the whole `.bin` as one flat array,
    and `document_token_bounds()` gives every document's [start, end) in it, which is what the
    packed training dataset reads.
    """

    def __init__(self, prefix: str | os.PathLike, verify: bool = True):
        self.prefix = strip_suffix(prefix)
        self.idx_file, self.bin_file = idx_path(self.prefix), bin_path(self.prefix)
        for p in (self.idx_file, self.bin_file):
            if not os.path.isfile(p):
                raise IndexedFormatError(f"{p}: no such file")
        self._read_index()
        if verify:
            self.verify()
        nbytes = os.path.getsize(self.bin_file)
        if nbytes:
            self.tokens = np.memmap(self.bin_file, dtype=self.dtype, mode="r")
        else:  # numpy cannot map an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)

    def _fail(self, what: str) -> None:
        raise IndexedFormatError(f"{self.idx_file}: {what}")

    def _read_index(self) -> None:
        size = os.path.getsize(self.idx_file)
        if size < HEADER_BYTES:
            self._fail(f"only {size} bytes, shorter than the {HEADER_BYTES}-byte MMIDIDX header")
        with open(self.idx_file, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:9] != MAGIC:
            if head[:9] == b"TNTIDX\x00\x00"[:9]:
                self._fail("legacy non-mmap TNTIDX index; re-preprocess with this tool or megatron")
            self._fail("not an MMIDIDX index (bad magic bytes)")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            self._fail(f"index version {version}, only version {VERSION} is supported")
        (code,) = struct.unpack_from("<B", head, 17)
        if code not in DTYPE_CODES:
            self._fail(f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        s, d = struct.unpack_from("<QQ", head, 18)
        base = HEADER_BYTES + 12 * s + 8 * d
        if s > size or d > size or size not in (base, base + s):
            self._fail(
                f"header claims {s} sequences and {d} document entries, which needs {base} bytes "
                f"(or {base + s} with modes), but the file has {size}"
            )
        self._map = np.memmap(self.idx_file, mode="r") if size else None
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._map, dtype=np.int32, count=s, offset=off)
        off += 4 * s
        self.sequence_pointers = np.frombuffer(self._map, dtype=np.int64, count=s, offset=off)
        off += 8 * s
        self.document_indices = np.frombuffer(self._map, dtype=np.int64, count=d, offset=off)
        off += 8 * d
        self.sequence_modes = (
            np.frombuffer(self._map, dtype=np.int8, count=s, offset=off) if size == base + s and s else None
        )

    def verify(self) -> None:
        """Check that the index is self-consistent and matches the `.bin` exactly."""
        sizes, ptrs, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        s = len(sizes)
        if s and int(sizes.min()) < 0:
            self._fail(f"negative sequence length at sequence {int(np.argmin(sizes))}")
        nbytes = sizes.astype(np.int64) * self.dtype.itemsize
        expected = np.cumsum(nbytes) - nbytes
        if s and not np.array_equal(expected, ptrs):
            i = int(np.argmax(expected != ptrs))
            self._fail(
                f"sequence {i} starts at byte {int(ptrs[i])} of the .bin, but the lengths before it "
                f"put it at {int(expected[i])}"
            )
        if len(docs) == 0 or docs[0] != 0:
            self._fail("document indices must start with 0")
        if docs[-1] != s:
            self._fail(f"document indices end at sequence {int(docs[-1])}, but there are {s} sequences")
        if len(docs) > 1 and int(np.diff(docs).min()) < 0:
            self._fail("document indices are not in increasing order")
        total = int(nbytes.sum())
        actual = os.path.getsize(self.bin_file)
        if actual < total:
            raise IndexedFormatError(
                f"{self.bin_file}: truncated: {actual} bytes, but the index describes {total} bytes "
                f"({total // self.dtype.itemsize} tokens of {self.dtype})"
            )
        if actual > total:
            raise IndexedFormatError(
                f"{self.bin_file}: {actual} bytes, but the index describes only {total}; the .idx and "
                ".bin disagree (were they written by different runs?)"
            )

    # -- access ------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence i from `offset`, `length` of them (default: to its end); a view."""
        n = len(self.sequence_lengths)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        size = int(self.sequence_lengths[i])
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        stop = start + (size - offset if length is None else length)
        return self.tokens[start:stop]

    def sequence_token_starts(self) -> np.ndarray:
        """Token offset of every sequence in `tokens`, plus the total as the last entry (int64)."""
        starts = np.empty(len(self.sequence_pointers) + 1, dtype=np.int64)
        starts[:-1] = self.sequence_pointers // self.dtype.itemsize
        starts[-1] = self.num_tokens
        return starts

    def document_token_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) in `tokens` of every document; a document's sequences are contiguous."""
        starts = self.sequence_token_starts()
        first = starts[self.document_indices[:-1]]
        return first, starts[self.document_indices[1:]] - first

    def max_token_id(self, chunk_tokens: int = 1 << 26) -> int:
        """The largest token id in the .bin (-1 when empty), scanned once and cached beside the data.

        The format has no vocabulary field, so this is how a trainer checks that the data fits its
        model. The cache `{prefix}.maxid.json` is keyed by both files' sizes and mtimes.
        """
        stamp = file_stamp(self.idx_file) + file_stamp(self.bin_file)
        cache = self.prefix + ".maxid.json"
        try:
            with open(cache) as f:
                saved = json.load(f)
            if saved.get("stamp") == stamp:
                return int(saved["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        tokens = self.tokens
        top = -1
        for start in range(0, len(tokens), chunk_tokens):
            top = max(top, int(tokens[start : start + chunk_tokens].max()))
        try:  # a read-only dataset directory just means no cache; a torn one is rescanned
            atomic_write(cache, json.dumps({"max_token_id": top, "stamp": stamp}), fsync=False)
        except OSError:
            pass
        return top

    def token_counts(self, ids: list[int], chunk_tokens: int = 1 << 26) -> dict[int, int]:
        """How many times each of `ids` occurs in the .bin (a trainer's check for ids its model reserves),
        scanned once per id and cached in `{prefix}.ids.json`, keyed like max_token_id's cache."""
        stamp = file_stamp(self.idx_file) + file_stamp(self.bin_file)
        cache = self.prefix + ".ids.json"
        counts: dict[int, int] = {}
        try:
            with open(cache) as f:
                saved = json.load(f)
            if saved.get("stamp") == stamp:
                counts = {int(k): int(v) for k, v in saved["counts"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        missing = [i for i in ids if i not in counts]
        if missing:
            tokens, found = self.tokens, dict.fromkeys(missing, 0)
            for start in range(0, len(tokens), chunk_tokens):
                chunk = tokens[start : start + chunk_tokens]
                for i in missing:
                    found[i] += int(np.count_nonzero(chunk == i))
            counts.update(found)
            try:
                atomic_write(cache, json.dumps({"counts": counts, "stamp": stamp}), fsync=False)
            except OSError:
                pass
        return {i: counts[i] for i in ids}

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )
