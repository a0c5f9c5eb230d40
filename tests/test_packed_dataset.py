"""PackedDataset: samples equal a slow reference, order is a pure function of the config, caches
are reused, rebuilt when the data changes, and built safely by many processes at once."""
import multiprocessing as mp
import os
import pickle
import shutil
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_tools.indexed import IndexedDataset, IndexedWriter
from pretrain.data import PackedDataset, parse_split, split_document_ranges
from pretrain.data.cache import load_or_build


def write_docs(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def random_docs(seed=0, n=200, max_len=60, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, max_len))) for _ in range(n)]


def reference_epoch(ds: PackedDataset, epoch: int):
    """Every sample of `epoch`, rebuilt the slow way from the epoch's document order and shuffle."""
    arrays = ds.epoch_arrays(epoch)
    order, shuffle = np.asarray(arrays["doc_order"]), np.asarray(arrays["sample_shuffle"])
    indexed = ds.indexed
    stream = np.concatenate([indexed[int(d)] for d in order]).astype(np.int64)
    ids = np.concatenate([np.full(len(indexed[int(d)]), k) for k, d in enumerate(order)])
    L = ds.seq_len
    samples = []
    for s in shuffle.tolist():
        window = slice(s * L, s * L + L + 1)
        samples.append((stream[window], ids[window] - ids[s * L]))
    return order, shuffle, samples


def check_against_reference(ds: PackedDataset, epoch: int):
    order, shuffle, samples = reference_epoch(ds, epoch)
    lo, hi = ds.document_range
    nonempty = [d for d in range(lo, hi) if len(ds.indexed[d]) > 0]
    assert sorted(order.tolist()) == nonempty  # a permutation of the split's non-empty documents
    assert sorted(shuffle.tolist()) == list(range(len(ds)))
    base = epoch * len(ds)
    for j, (tokens, doc_ids) in enumerate(samples):
        got = ds[base + j]
        assert got["tokens"].dtype == np.int64 and got["doc_ids"].dtype == np.int32
        np.testing.assert_array_equal(got["tokens"], tokens)
        np.testing.assert_array_equal(got["doc_ids"], doc_ids)
    many_tokens, many_ids = ds.get_many(np.arange(base, base + len(ds)))
    np.testing.assert_array_equal(many_tokens, np.stack([t for t, _ in samples]))
    np.testing.assert_array_equal(many_ids, np.stack([i for _, i in samples]))


@pytest.mark.parametrize("seq_len", [1, 7, 64, 300])
def test_samples_equal_reference(tmp_path, seq_len):
    prefix = write_docs(tmp_path / "d", random_docs())
    ds = PackedDataset(prefix, seq_len, split="80,15,5", cache_dir=tmp_path / "cache")
    assert len(ds) == (ds.split_tokens - 1) // seq_len
    for epoch in (0, 1):
        check_against_reference(ds, epoch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=25),
    seq_len=st.integers(1, 40),
    seed=st.integers(0, 2**31),
)
def test_samples_equal_reference_fuzz(tmp_path_factory, lengths, seq_len, seed):
    tmp = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 500, n) for n in lengths]
    if sum(lengths) < seq_len + 1:
        prefix = write_docs(tmp / "d", docs)
        with pytest.raises(ValueError, match="not enough for one sample"):
            PackedDataset(prefix, seq_len, split="1", cache_dir=tmp / "c")
        return
    ds = PackedDataset(write_docs(tmp / "d", docs), seq_len, seed=seed, split="1", cache_dir=tmp / "c")
    check_against_reference(ds, 0)
    shutil.rmtree(tmp)


def test_doc_ids_mark_every_boundary(tmp_path):
    # Documents of known lengths whose tokens all equal their document number: a sample's doc_ids
    # must change exactly where its tokens do, and count from 0.
    docs = [np.full(n, k, np.int64) for k, n in enumerate([5, 1, 9, 3, 3, 12, 2, 7, 1, 1, 8])]
    ds = PackedDataset(write_docs(tmp_path / "d", docs), 6, split="1", cache_dir=tmp_path / "c")
    for i in range(len(ds)):
        s = ds[i]
        changes = np.flatnonzero(np.diff(s["tokens"]) != 0) + 1
        np.testing.assert_array_equal(np.flatnonzero(np.diff(s["doc_ids"]) != 0) + 1, changes)
        assert s["doc_ids"][0] == 0 and np.all(np.diff(s["doc_ids"]) >= 0)


def test_order_is_a_pure_function_of_config(tmp_path):
    docs = random_docs(1)
    a = write_docs(tmp_path / "a" / "corpus", docs)
    b = write_docs(tmp_path / "b" / "corpus", docs)  # same data and name at another path
    da = PackedDataset(a, 16, seed=7, cache_dir=tmp_path / "ca")
    db = PackedDataset(b, 16, seed=7, cache_dir=tmp_path / "cb")
    idx = np.arange(0, 3 * len(da))
    np.testing.assert_array_equal(da.get_many(idx)[0], db.get_many(idx)[0])
    other_seed = PackedDataset(a, 16, seed=8, cache_dir=tmp_path / "ca")
    assert not np.array_equal(other_seed.get_many(idx)[0], da.get_many(idx)[0])
    other_name = PackedDataset(a, 16, seed=7, name="other", cache_dir=tmp_path / "ca")
    assert not np.array_equal(other_name.get_many(idx)[0], da.get_many(idx)[0])
    # Epochs are independent permutations, not repeats of the first.
    e0, e1 = da.epoch_arrays(0), da.epoch_arrays(1)
    assert not np.array_equal(e0["sample_shuffle"], e1["sample_shuffle"])
    assert not np.array_equal(e0["doc_order"], e1["doc_order"])


def test_splits_are_disjoint_document_ranges(tmp_path):
    docs = random_docs(2, n=100)
    prefix = write_docs(tmp_path / "d", docs)
    ranges = split_document_ranges("949,50,1", 100)
    assert ranges == [(0, 95), (95, 100), (100, 100)]
    assert parse_split("8/1/1") == pytest.approx([0.8, 0.1, 0.1])
    assert parse_split([1]) == [1.0, 0.0, 0.0]
    train = PackedDataset(prefix, 8, split="90,10", split_name="train", cache_dir=tmp_path / "c")
    valid = PackedDataset(prefix, 8, split="90,10", split_name="valid", cache_dir=tmp_path / "c")
    assert train.document_range == (0, 90) and valid.document_range == (90, 100)
    seen_valid = set(np.asarray(valid.epoch_arrays(0)["doc_order"]).tolist())
    assert seen_valid <= set(range(90, 100))
    with pytest.raises(ValueError, match="'test' of .* has no documents"):
        PackedDataset(prefix, 8, split="90,10", split_name="test", cache_dir=tmp_path / "c")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=0), "seq_len must be a positive integer"),
        (dict(seq_len=8, split="a,b"), "expected up to 3 numbers"),
        (dict(seq_len=8, split="1,2,3,4"), "expected 1 to 3 weights"),
        (dict(seq_len=8, split="-1,2"), "must be finite, non-negative"),
        (dict(seq_len=8, split_name="dev"), "split_name must be one of"),
        (dict(seq_len=10**6), "not enough for one sample"),
    ],
)
def test_bad_config_is_refused_in_one_line(tmp_path, kwargs, message):
    prefix = write_docs(tmp_path / "d", random_docs(3))
    with pytest.raises(ValueError, match=message) as e:
        PackedDataset(prefix, cache_dir=tmp_path / "c", **kwargs)
    assert "\n" not in str(e.value)


def test_negative_index_is_refused(tmp_path):
    ds = PackedDataset(write_docs(tmp_path / "d", random_docs()), 8, cache_dir=tmp_path / "c")
    with pytest.raises(IndexError, match="negative"):
        ds[-1]
    with pytest.raises(IndexError, match="non-negative"):
        ds.get_many([3, -2])


def test_cache_is_reused_and_rebuilt_when_the_data_changes(tmp_path):
    prefix = write_docs(tmp_path / "d", random_docs(4))
    cache = tmp_path / "cache"
    first = PackedDataset(prefix, 8, cache_dir=cache)
    first[0], first[len(first)]  # epochs 0 and 1
    assert first.num_builds == 2
    again = PackedDataset(prefix, 8, cache_dir=cache)
    np.testing.assert_array_equal(again.get_many(range(2 * len(again)))[0], first.get_many(range(2 * len(first)))[0])
    assert again.num_builds == 0  # both epochs loaded from disk
    assert sorted(os.listdir(cache)) == sorted(
        [first.cache_path(0).rsplit("/", 1)[1], first.cache_path(1).rsplit("/", 1)[1]]
        + [first.cache_path(e).rsplit("/", 1)[1] + ".lock" for e in (0, 1)]
    )
    # Rewriting the dataset (other contents, so other sizes and mtime) gives a new key: rebuilt.
    time.sleep(0.01)
    write_docs(tmp_path / "d", random_docs(5))
    changed = PackedDataset(prefix, 8, cache_dir=cache)
    assert changed.cache_path(0) != first.cache_path(0)
    changed[0]
    assert changed.num_builds == 1
    check_against_reference(changed, 0)
    # A dataset object created before the change refuses to be unpickled (DataLoader workers).
    with pytest.raises(RuntimeError, match="changed on disk"):
        pickle.loads(pickle.dumps(first))


def test_pickle_reopens_the_files(tmp_path):
    ds = PackedDataset(write_docs(tmp_path / "d", random_docs()), 8, cache_dir=tmp_path / "c")
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # no memory maps or index arrays travel to workers
    copy = pickle.loads(blob)
    np.testing.assert_array_equal(copy.get_many(range(len(ds)))[0], ds.get_many(range(len(ds)))[0])


def test_default_cache_dir_is_beside_the_data(tmp_path):
    prefix = write_docs(tmp_path / "d", random_docs())
    ds = PackedDataset(IndexedDataset(prefix), 8)
    ds[0]
    assert os.path.isdir(tmp_path / ".cache" / "packed")
    assert ds.cache_path(0).startswith(str(tmp_path / ".cache" / "packed"))


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    prefix = write_docs(tmp_path / "d", random_docs())
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ds = PackedDataset(prefix, 8, cache_dir=blocker / "cache")
    with pytest.raises(OSError, match="cannot create the index cache directory .* pass cache_dir="):
        ds[0]


# -- several processes building the same cache at the same moment --------------------------------


def _build_in_child(prefix, cache, lock, barrier, results):
    ds = PackedDataset(prefix, 8, cache_dir=cache, _lock=lock)
    slow_build = ds._build_epoch

    def build(epoch):  # widen the race window so that every process really does race
        time.sleep(1.0)
        return slow_build(epoch)

    ds._build_epoch = build
    barrier.wait()
    tokens, doc_ids = ds.get_many(range(len(ds)))
    results.put((ds.num_builds, tokens.tobytes(), doc_ids.tobytes()))


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "rename-only"])
def test_concurrent_cache_build_all_ranks_succeed(tmp_path, lock):
    prefix = write_docs(tmp_path / "d", random_docs(6))
    cache = str(tmp_path / "cache")
    ctx = mp.get_context("fork")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(prefix, cache, lock, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    builds = [g[0] for g in got]
    if lock:
        assert sum(builds) == 1  # one builder, the others waited and loaded its arrays
    else:
        assert sum(builds) >= 2  # several built; the losers of the rename used the winner's
    assert len({g[1:] for g in got}) == 1
    reference = PackedDataset(prefix, 8, cache_dir=cache)
    tokens, doc_ids = reference.get_many(range(len(reference)))
    assert (tokens.tobytes(), doc_ids.tobytes()) == got[0][1:] and reference.num_builds == 0
    leftovers = [f for f in os.listdir(cache) if f.startswith(".tmp-")]
    assert leftovers == []  # losers clean up their temporary directories


def test_failed_build_leaves_no_cache_entry(tmp_path):
    def failing():
        raise MemoryError("simulated crash during the build")

    with pytest.raises(MemoryError):
        load_or_build(str(tmp_path), {"k": 1}, failing, ["a"])
    assert [f for f in os.listdir(tmp_path) if not f.endswith(".lock")] == []
    arrays, built, _ = load_or_build(str(tmp_path), {"k": 1}, lambda: {"a": np.arange(3)}, ["a"])
    assert built and arrays["a"].tolist() == [0, 1, 2]


def test_damaged_cache_entry_is_a_clear_error(tmp_path):
    prefix = write_docs(tmp_path / "d", random_docs())
    ds = PackedDataset(prefix, 8, cache_dir=tmp_path / "c")
    ds[0]
    victim = os.path.join(ds.cache_path(0), "samples.npy")
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(OSError, match=r"index cache .* is unreadable .* delete that directory to rebuild") as e:
        PackedDataset(prefix, 8, cache_dir=tmp_path / "c")[0]
    assert "\n" not in str(e.value)
