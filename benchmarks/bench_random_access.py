"""Random-access read speed: our PackedDataset vs megatron-core's IndexedDataset.

    PYTHONPATH=. python benchmarks/bench_random_access.py [--prefix data/x ...] [--seq-len 2048]

(a) megatron: `ds.get(doc, offset, seq_len + 1)` for random (document, offset) pairs in documents
    of at least seq_len + 1 tokens, materialised as int64 (as training needs);
(b) ours: `ds[i]` for random sample indices i (int64 tokens plus int32 doc_ids, samples packed
    across documents), after building the epoch index once (its build time is printed apart).

Both are warmed up over their whole sample lists first so the page cache treats them alike, then
timed alternately for several rounds; the medians are reported. Without --prefix it measures the
Linux documentation corpus that benchmarks/bench_preprocess.py tokenizes (if that has been run) and
a synthetic ~50M-token uint16 dataset of short documents (log-normal lengths, mean ~1,500 tokens),
the hard case for packing: most samples then span two or more documents, read from separate places.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_tools.indexed import IndexedDataset, IndexedWriter  # noqa: E402
from pretrain.data.packed import PackedDataset  # noqa: E402

EOD = 50256
LINUXDOC = "/tmp/pretrain-bench/out_text_document"  # written by benchmarks/bench_preprocess.py


def write_synthetic(prefix: str, num_tokens: int, mean_len: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean_len) - sigma**2 / 2  # a log-normal's mean is exp(mu + sigma^2 / 2)
    lengths = np.maximum(1, rng.lognormal(mu, sigma, int(num_tokens / mean_len * 1.2)).astype(np.int64))
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), num_tokens) + 1]
    with IndexedWriter(prefix, np.uint16) as w:
        for chunk in np.array_split(lengths, max(1, len(lengths) // 4096)):
            tokens = rng.integers(0, EOD, int(chunk.sum()), dtype=np.uint16)
            tokens[np.cumsum(chunk) - 1] = EOD  # every document ends with EOD, as preprocessing does
            w.add_sequences(tokens, chunk)


def time_loop(fn, items) -> float:
    t0 = time.perf_counter()
    fn(items)
    return (time.perf_counter() - t0) / len(items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", nargs="+", help="existing .bin/.idx prefixes (default: see above)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--synthetic-tokens", type=int, default=50_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_random_access-") as tmp:
        prefixes = args.prefix or [p for p in [LINUXDOC] if os.path.exists(p + ".idx")] + [None]
        if not args.prefix and not os.path.exists(LINUXDOC + ".idx"):
            print(f"({LINUXDOC} not found: run benchmarks/bench_preprocess.py first to measure it too)")
        for prefix in prefixes:
            if prefix is None:
                prefix = os.path.join(tmp, "synthetic")
                t0 = time.perf_counter()
                write_synthetic(prefix, args.synthetic_tokens, 1500.0, args.seed)
                print(f"\nwrote a synthetic dataset of short documents in {time.perf_counter() - t0:.1f} s")
            bench_one(prefix, args, os.path.join(tmp, "cache"))


def bench_one(prefix: str, args, cache_dir: str) -> None:
    L1 = args.seq_len + 1
    ours_index = IndexedDataset(prefix)
    lengths = ours_index.sequence_lengths
    print(f"\ndataset {prefix}: {ours_index.num_documents:,} documents, {ours_index.num_tokens:,} tokens, "
          f"{ours_index.dtype}, mean document {ours_index.num_tokens / max(1, ours_index.num_documents):.0f} tokens")
    # (b) ours: build the epoch index once, timed apart.
    t0 = time.perf_counter()
    ours = PackedDataset(ours_index, args.seq_len, seed=args.seed, split="1", cache_dir=cache_dir)
    ours.epoch_arrays(0)
    print(f"ours: index build for epoch 0 ({len(ours):,} samples): {time.perf_counter() - t0:.3f} s")
    rng = np.random.default_rng(args.seed)
    our_items = rng.integers(0, len(ours), args.samples).tolist()

    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot compare"
        print(f"megatron-core is not importable ({type(e).__name__}: {e}); "
              "install megatron-core to compare. Timing ours alone.")
        MegatronIndexed = None
    meg_items = []
    if MegatronIndexed is not None:
        meg = MegatronIndexed(prefix)
        long_docs = np.flatnonzero(lengths >= L1)
        if len(long_docs) == 0:
            sys.exit(f"no document has {L1} tokens; megatron's get() needs one for this comparison")
        seqs = rng.choice(long_docs, args.samples)
        offsets = (rng.random(args.samples) * (lengths[seqs] - L1 + 1)).astype(np.int64)
        meg_items = list(zip(seqs.tolist(), offsets.tolist()))

        def run_megatron(items):
            for s, o in items:
                np.asarray(meg.get(s, o, L1), dtype=np.int64)

    def run_ours(items):
        for i in items:
            ours[i]

    def run_ours_many(items):
        for k in range(0, len(items), 32):
            ours.get_many(items[k : k + 32])

    # Warm-up: touch every page both will read, and the whole .bin, so neither pays page faults.
    np.asarray(ours_index.tokens).sum()
    run_ours(our_items)
    if meg_items:
        run_megatron(meg_items)

    t_meg, t_ours, t_many = [], [], []
    for _ in range(args.rounds):  # alternate, so drift in machine load hits both
        if meg_items:
            t_meg.append(time_loop(run_megatron, meg_items))
        t_ours.append(time_loop(run_ours, our_items))
        t_many.append(time_loop(run_ours_many, our_items))

    def report(label, times):
        med = statistics.median(times)
        print(f"{label:<44} {1 / med:>10,.0f} samples/s {med * 1e6:>8.2f} us/sample")
        return med

    print(f"\nseq_len {args.seq_len}, {args.samples:,} random samples, median of {args.rounds} rounds:")
    m = report("megatron IndexedDataset.get -> int64", t_meg) if t_meg else None
    o = report("ours PackedDataset[i] (tokens + doc_ids)", t_ours)
    report("ours PackedDataset.get_many (batches of 32)", t_many)
    table = ours.epoch_arrays(0)["samples"]
    spanning = float(np.mean(table[:, 2] != table[:, 3]))
    print(f"{spanning:.0%} of our samples span two or more documents (megatron's windows lie in one)")
    if m is not None:
        print(f"RATIO throughput ours/megatron: {m / o:.2f} ({'ours faster' if o < m else 'megatron faster'})")


if __name__ == "__main__":
    main()
