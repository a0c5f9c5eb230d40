"""The .bin/.idx format: round trips, byte compatibility with megatron-core, and refusal of bad files."""
import filecmp
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_tools.indexed import (
    HEADER_BYTES,
    IndexedDataset,
    IndexedFormatError,
    IndexedWriter,
    optimal_dtype,
)


def _docs(seed=0, n=57, vocab=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


def test_round_trip_and_bounds(tmp_path):
    docs = _docs()
    ds = _write(tmp_path / "a", docs)
    assert len(ds) == ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    starts, lengths = ds.document_token_bounds()
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.tokens[starts[i] : starts[i] + lengths[i]], d)
    assert ds.get(3, 1, 2).tolist() == docs[3][1:3].tolist()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]  # no temp files left


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(128256) is np.int32


def test_batched_sequences_and_multi_sequence_documents(tmp_path):
    with IndexedWriter(tmp_path / "b", np.int32) as w:
        w.add_sequences(np.arange(10), [3, 3, 4], end_documents=False)
        w.end_document()
        w.add_sequences(np.arange(5), [5])
    ds = IndexedDataset(tmp_path / "b")
    assert ds.document_indices.tolist() == [0, 3, 4]
    starts, lengths = ds.document_token_bounds()
    assert starts.tolist() == [0, 10] and lengths.tolist() == [10, 5]


def test_megatron_reads_ours_byte_identical(tmp_path, megatron_indexed):
    torch = pytest.importorskip("torch")
    docs = _docs(1)
    ours = _write(tmp_path / "ours", docs)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(np.asarray(d, dtype=np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"ours{ext}", tmp_path / f"theirs{ext}", shallow=False)
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(ours)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)


def test_we_read_megatron_files(tmp_path, megatron_indexed):
    torch = pytest.importorskip("torch")
    docs = _docs(2, vocab=100000)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for d in docs:  # two sequences per document, as megatron writes with --split-sentences
        half = len(d) // 2
        builder.add_document(torch.from_numpy(np.asarray(d, dtype=np.int64)), [half, len(d) - half])
    builder.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and len(ds) == 2 * len(docs) and ds.num_documents == len(docs)
    starts, lengths = ds.document_token_bounds()
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.tokens[starts[i] : starts[i] + lengths[i]], d)


def test_out_of_range_tokens_are_refused(tmp_path):
    with pytest.raises(IndexedFormatError, match="token id 70000 does not fit"):
        with IndexedWriter(tmp_path / "x", np.uint16) as w:
            w.add_document(np.array([1, 70000], dtype=np.int64))
    with pytest.raises(IndexedFormatError, match="token id -1"):
        with IndexedWriter(tmp_path / "y", np.int32) as w:
            w.add_document(np.array([-1, 3], dtype=np.int64))
    assert os.listdir(tmp_path) == []  # aborted writers leave nothing


def test_crash_before_finalize_leaves_no_valid_index(tmp_path):
    old = _write(tmp_path / "d", _docs(3))
    old_idx = (tmp_path / "d.idx").read_bytes()
    w = IndexedWriter(tmp_path / "d", np.uint16)
    w.add_document(np.arange(5))
    # the process "dies" here: nothing under the final names has changed
    assert (tmp_path / "d.idx").read_bytes() == old_idx
    assert len(IndexedDataset(tmp_path / "d")) == len(old)
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_truncated_bin(tmp_path):
    _write(tmp_path / "t", _docs(4))
    size = os.path.getsize(tmp_path / "t.bin")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(IndexedFormatError, match=r"t\.bin: truncated"):
        IndexedDataset(tmp_path / "t")


def test_bin_longer_than_index(tmp_path):
    _write(tmp_path / "t", _docs(5))
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(IndexedFormatError, match="disagree"):
        IndexedDataset(tmp_path / "t")


def test_sizes_disagree_with_pointers(tmp_path):
    _write(tmp_path / "s", [np.arange(4), np.arange(6), np.arange(3)])
    with open(tmp_path / "s.idx", "r+b") as f:
        f.seek(HEADER_BYTES + 4)  # second sequence length
        f.write(struct.pack("<i", 5))
    with pytest.raises(IndexedFormatError, match="sequence 2 starts at byte"):
        IndexedDataset(tmp_path / "s")


@pytest.mark.parametrize(
    "offset,data,message",
    [
        (0, b"XXIDIDX\x00\x00", "bad magic"),
        (9, struct.pack("<Q", 2), "version 2"),
        (17, struct.pack("<B", 9), "unknown dtype code 9"),
        (18, struct.pack("<Q", 1000), "header claims 1000 sequences"),
    ],
)
def test_corrupt_header(tmp_path, offset, data, message):
    _write(tmp_path / "h", _docs(6))
    with open(tmp_path / "h.idx", "r+b") as f:
        f.seek(offset)
        f.write(data)
    with pytest.raises(IndexedFormatError, match=message):
        IndexedDataset(tmp_path / "h")


def test_missing_files(tmp_path):
    with pytest.raises(IndexedFormatError, match="no such file"):
        IndexedDataset(tmp_path / "nothing")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_index_reader(tmp_path_factory, data):
    """Random corruption of a valid pair either is refused with IndexedFormatError or reads back a
    structurally valid dataset whose every document lies inside the .bin; nothing else may happen."""
    d = tmp_path_factory.mktemp("fuzz")
    docs = data.draw(st.lists(st.lists(st.integers(0, 65535), max_size=8), max_size=6))
    _write(d / "f", [np.array(x, dtype=np.int64) for x in docs])
    idx = bytearray((d / "f.idx").read_bytes())
    binb = bytearray((d / "f.bin").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "bin"]))
        if kind == "flip" and idx:
            i = data.draw(st.integers(0, len(idx) - 1))
            idx[i] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            idx = idx[: data.draw(st.integers(0, len(idx)))]
        elif kind == "extend":
            idx += bytes(data.draw(st.binary(max_size=16)))
        else:
            binb = binb[: data.draw(st.integers(0, len(binb)))] + data.draw(st.binary(max_size=4))
    (d / "f.idx").write_bytes(bytes(idx))
    (d / "f.bin").write_bytes(bytes(binb))
    try:
        ds = IndexedDataset(d / "f")
    except IndexedFormatError:
        return
    starts, lengths = ds.document_token_bounds()
    assert ds.num_tokens * ds.dtype.itemsize == len(binb)
    assert (lengths >= 0).all() and (starts + lengths <= ds.num_tokens).all()
    for i in range(len(ds)):
        assert ds[i].size == ds.sequence_lengths[i]
