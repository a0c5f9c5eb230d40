"""Tokenize jsonl / text / parquet / `datasets` folders into megatron's indexed format.

The work is split into chunks (see `sources.plan_chunks`) read and tokenized by a pool of worker
processes; the main process writes their results in chunk order, so the output is byte-identical
whatever `--workers` is. Chunks are grouped into partitions: each partition is published atomically
as its own `.bin`/`.idx` under `{output_prefix}.parts-<hash>/` as soon as it is complete, and the
partitions are merged into `{output_prefix}_{key}_document.bin/.idx` at the end. Memory stays
bounded (a fixed window of chunks in flight, index arrays spilled to disk), a crashed or interrupted
run resumes from its finished partitions when the same command is run again, and the final files
appear only when everything is done.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .files import atomic_write
from .indexed import IndexedDataset, IndexedWriter, bin_path, idx_path, optimal_dtype
from .sources import Chunk, InputError, Skip, expand_inputs, plan_chunks, read_chunk

_PLAN_VERSION = 1
_MAX_EXAMPLES = 5  # skip examples kept per reason for the final report


@dataclass
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    tokenizer: str
    json_keys: tuple[str, ...] = ("text",)
    workers: int = 2
    append_eod: bool = True
    input_format: str | None = None
    text_unit: str = "file"
    dtype: str = "auto"
    chunk_mb: float = 4.0
    partition_mb: float = 1024.0
    overwrite: bool = False
    strict: bool = False
    progress: bool = True
    stats_json: str | None = None  # per-chunk timings, for benchmarks
    eos_token: str | None = None  # names the end-of-document token of a foreign tokenizer

    def tokenizer_overrides(self) -> dict:
        return {"eos_token": self.eos_token} if self.eos_token else {}


@dataclass
class Stats:
    documents: int = 0
    tokens: Counter = field(default_factory=Counter)  # per key, EOD included
    text_tokens: int = 0  # tokens produced by the tokenizer (first key), EOD excluded
    input_bytes: int = 0
    skips: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, other: "Stats") -> None:
        self.documents += other.documents
        self.tokens.update(other.tokens)
        self.text_tokens += other.text_tokens
        self.input_bytes += other.input_bytes
        self.skips.update(other.skips)
        for reason, ex in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(ex[: _MAX_EXAMPLES - len(mine)])

    def to_json(self) -> dict:
        return {"documents": self.documents, "tokens": dict(self.tokens), "text_tokens": self.text_tokens,
                "input_bytes": self.input_bytes, "skips": dict(self.skips), "examples": self.examples}

    @classmethod
    def from_json(cls, d: dict) -> "Stats":
        return cls(d["documents"], Counter(d["tokens"]), d["text_tokens"], d["input_bytes"],
                   Counter(d["skips"]), d["examples"])


def output_prefix_for(prefix: str, key: str) -> str:
    """Megatron's naming: `{output_prefix}_{key}_document`."""
    return f"{prefix}_{key}_document"


# -- worker side -------------------------------------------------------------------------------
_W: dict = {}


def _init_worker(tokenizer_path: str, overrides: dict, keys, append_eod: bool, strict: bool,
                 max_id: int) -> None:
    from .tokenizer import load_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process = one encoding thread
    tok = load_tokenizer(tokenizer_path, **overrides)
    _W.update(tok=tok, keys=tuple(keys), eod=tok.eod_id if append_eod else None, strict=strict, max_id=max_id)


def encode_chunk(chunk: Chunk):
    """Read and tokenize one chunk -> ({key: (tokens int32, sizes int64)}, Stats)."""
    tok, keys, eod = _W["tok"], _W["keys"], _W["eod"]
    stats = Stats(input_bytes=chunk.nbytes)
    texts: dict[str, list[str]] = {k: [] for k in keys}
    for item in read_chunk(chunk, keys):
        if isinstance(item, Skip):
            if _W["strict"]:
                raise InputError(f"{item.where}: {item.reason} (--strict)")
            stats.skips[item.reason] += 1
            ex = stats.examples.setdefault(item.reason, [])
            if len(ex) < _MAX_EXAMPLES:
                ex.append(item.where)
            continue
        for k in keys:
            texts[k].append(item[1][k])
    stats.documents = len(texts[keys[0]])
    out = {}
    for n, k in enumerate(keys):
        ids = tok.encode_batch(texts[k]) if texts[k] else []
        sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        if n == 0:
            stats.text_tokens = int(sizes.sum())
        if eod is not None:
            for x in ids:
                x.append(eod)
            sizes += 1
        total = int(sizes.sum())
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
        if total and (int(flat.max()) > _W["max_id"] or int(flat.min()) < 0):
            bad = int(flat.max()) if int(flat.max()) > _W["max_id"] else int(flat.min())
            raise InputError(
                f"tokenizer produced id {bad}, outside 0..{_W['max_id']} of the output dtype; "
                "pass --dtype int32"
            )
        stats.tokens[k] += total
        out[k] = (flat, sizes)
    return out, stats


# -- main side ---------------------------------------------------------------------------------
def _fingerprint(cfg: PreprocessConfig, inputs, tok, dtype) -> str:
    desc = {
        "version": _PLAN_VERSION,
        "inputs": [(os.path.realpath(p), f, os.path.getsize(p) if os.path.isfile(p) else 0,
                    os.stat(p).st_mtime_ns) for p, f in inputs],
        "keys": list(cfg.json_keys), "append_eod": cfg.append_eod, "text_unit": cfg.text_unit,
        "chunk_mb": cfg.chunk_mb, "partition_mb": cfg.partition_mb, "tokenizer": tok.fingerprint(),
        "eod": tok.eod_id,
        "dtype": np.dtype(dtype).name,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _partitions(chunks: list[Chunk], partition_bytes: float) -> list[list[int]]:
    parts, cur, acc = [], [], 0
    for i, c in enumerate(chunks):
        cur.append(i)
        acc += c.nbytes
        if acc >= partition_bytes:
            parts.append(cur)
            cur, acc = [], 0
    if cur or not parts:
        parts.append(cur)
    return parts


def _resolve_dtype(name: str, vocab_size: int):
    if name == "auto":
        return np.dtype(optimal_dtype(vocab_size))
    if name not in ("uint16", "int32"):
        raise InputError(f"--dtype {name}: choose auto, uint16 or int32")
    if name == "uint16" and vocab_size > 65536:
        raise InputError(f"--dtype uint16 cannot hold a vocabulary of {vocab_size} tokens")
    return np.dtype(name)


def _bounded(items, window: threading.Semaphore):
    """Feed the pool lazily: at most `window` chunks are read-ahead or waiting to be written."""
    for it in items:
        window.acquire()
        yield it


class _Progress:
    def __init__(self, total_bytes: int, enabled: bool):
        self.bar = None
        self.t0 = time.perf_counter()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="preprocess", mininterval=0.5, file=sys.stderr, smoothing=0.1)

    def update(self, nbytes: int, stats: Stats) -> None:
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(
                f"{stats.documents / dt:,.0f} docs/s, {stats.text_tokens / dt:,.0f} tok/s", refresh=False
            )
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def preprocess(cfg: PreprocessConfig, log=print) -> Stats:
    """Run the whole job; returns the totals. Raises InputError for bad input or config."""
    from .tokenizer import load_tokenizer

    if cfg.workers < 1:
        raise InputError(f"--workers {cfg.workers}: need at least 1")
    if not cfg.json_keys:
        raise InputError("--json-keys: give at least one key")
    finals = {k: output_prefix_for(cfg.output_prefix, k) for k in cfg.json_keys}
    existing = [p for p in finals.values() if os.path.exists(idx_path(p)) or os.path.exists(bin_path(p))]
    if existing and not cfg.overwrite:
        raise InputError(f"{existing[0]}.bin/.idx already exists; pass --overwrite to replace it")
    inputs = expand_inputs(cfg.inputs, cfg.input_format)
    tok = load_tokenizer(cfg.tokenizer, **cfg.tokenizer_overrides())
    dtype = _resolve_dtype(cfg.dtype, tok.vocab_size)
    max_id = int(np.iinfo(dtype).max)
    chunks = plan_chunks(inputs, max(int(cfg.chunk_mb * (1 << 20)), 1), cfg.text_unit)
    parts = _partitions(chunks, cfg.partition_mb * (1 << 20))
    parts_dir = f"{cfg.output_prefix}.parts-{_fingerprint(cfg, inputs, tok, dtype)}"
    os.makedirs(parts_dir, exist_ok=True)

    total, todo = _finished_partitions(parts, parts_dir)
    if len(todo) < len(parts):
        log(f"resuming: {len(parts) - len(todo)} of {len(parts)} partitions already done in {parts_dir}")
    log(f"preprocess: {len(inputs)} input(s), {len(chunks)} chunk(s) in {len(parts)} partition(s), "
        f"{cfg.workers} worker(s), tokenizer vocab {tok.vocab_size} -> {dtype.name}")

    timeline, t_start = _encode_partitions(cfg, chunks, parts, todo, parts_dir, dtype, max_id, total)
    encode_seconds = time.perf_counter() - t_start

    if total.documents == 0:
        raise InputError("no usable documents in the input" + _skip_summary(total))
    for k, final in finals.items():
        _merge_partitions([os.path.join(parts_dir, f"part-{p:05d}_{k}") for p in range(len(parts))], final, dtype)
    shutil.rmtree(parts_dir, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    if cfg.stats_json:
        with open(cfg.stats_json, "w") as f:
            json.dump({"timeline": timeline, "encode_seconds": encode_seconds, "total_seconds": elapsed,
                       **total.to_json()}, f)
    for k, final in finals.items():
        log(f"wrote {final}.bin/.idx: {total.documents:,} documents, {total.tokens[k]:,} tokens")
    log(f"done in {elapsed:.1f} s: {total.documents / elapsed:,.0f} docs/s, "
        f"{total.text_tokens / elapsed:,.0f} tok/s, {total.input_bytes / elapsed / 2**20:.1f} MiB/s"
        + _skip_summary(total))
    return total


def _finished_partitions(parts: list[list[int]], parts_dir: str) -> tuple[Stats, list[int]]:
    """Resume: (the totals of the partitions a previous run finished, the partitions still to do)."""
    total = Stats()
    todo = []
    for p, idxs in enumerate(parts):
        marker = os.path.join(parts_dir, f"part-{p:05d}.done.json")
        if os.path.isfile(marker):
            with open(marker) as f:
                total.add(Stats.from_json(json.load(f)))
        else:
            todo.append(p)
    return total, todo


def _encode_partitions(cfg: PreprocessConfig, chunks: list[Chunk], parts: list[list[int]], todo: list[int],
                       parts_dir: str, dtype, max_id: int, total: Stats) -> tuple[list, float]:
    """Tokenize the `todo` partitions' chunks, written in chunk order, each partition published as it
    completes; adds to `total` and returns (per-chunk timeline, start time)."""
    progress = _Progress(sum(c.nbytes for c in chunks), cfg.progress)
    progress.update(total.input_bytes, total)
    timeline = []
    t_start = time.perf_counter()
    init_args = (cfg.tokenizer, cfg.tokenizer_overrides(), cfg.json_keys, cfg.append_eod, cfg.strict, max_id)
    order = [(p, i) for p in todo for i in parts[p]]
    pool = None
    try:
        pool, window, results = _start_encoding(cfg.workers, init_args, (chunks[i] for _, i in order))
        writers, part_stats, current = None, None, None
        for (p, i), (out, stats) in zip(order, results):
            if window is not None:
                window.release()
            if p != current:
                writers = {k: IndexedWriter(os.path.join(parts_dir, f"part-{p:05d}_{k}"), dtype)
                           for k in cfg.json_keys}
                part_stats, current = Stats(), p
            for k, (flat, sizes) in out.items():
                writers[k].add_sequences(flat, sizes)
            part_stats.add(stats)
            total.add(stats)
            progress.update(stats.input_bytes, total)
            timeline.append((time.perf_counter() - t_start, stats.text_tokens, stats.input_bytes))
            if i == parts[p][-1]:
                _finish_partition(parts_dir, p, writers, part_stats)
                writers = None
    except BaseException:
        if writers:
            for w in writers.values():
                w.abort()
        if pool is not None:
            pool.terminate()
        progress.close()
        raise
    else:
        if pool is not None:
            pool.close()
            pool.join()
        progress.close()
    return timeline, t_start


def _start_encoding(workers: int, init_args: tuple, chunks):
    """(pool or None, read-ahead window or None, the (out, stats) of each chunk in order): in this process
    for one worker, else lazily fed to a pool of forked workers."""
    if workers == 1:
        _init_worker(*init_args)
        return None, None, map(encode_chunk, chunks)
    import multiprocessing as mp

    pool = mp.get_context("fork").Pool(workers, _init_worker, init_args)
    window = threading.Semaphore(4 * workers)
    return pool, window, pool.imap(encode_chunk, _bounded(chunks, window), chunksize=1)


def _finish_partition(parts_dir: str, p: int, writers: dict, stats: Stats) -> None:
    for w in writers.values():
        w.finalize()
    marker = os.path.join(parts_dir, f"part-{p:05d}.done.json")
    atomic_write(marker, json.dumps(stats.to_json()))  # the marker makes the partition count as done on resume


def _merge_partitions(prefixes: list[str], final: str, dtype) -> None:
    if len(prefixes) == 1:  # nothing to merge: publish by rename, .bin first and .idx last
        if os.path.exists(idx_path(final)):
            os.unlink(idx_path(final))
        os.replace(bin_path(prefixes[0]), bin_path(final))
        os.replace(idx_path(prefixes[0]), idx_path(final))
        return
    with IndexedWriter(final, dtype) as w:
        for p in prefixes:
            w.append_dataset(IndexedDataset(p))


def _skip_summary(stats: Stats) -> str:
    if not stats.skips:
        return ""
    lines = [f"\nskipped {sum(stats.skips.values()):,} record(s):"]
    for reason, n in stats.skips.most_common():
        ex = ", ".join(stats.examples.get(reason, [])[:3])
        lines.append(f"  {n:,} x {reason} (e.g. {ex})")
    return "\n".join(lines)

