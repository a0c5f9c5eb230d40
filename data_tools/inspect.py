"""`pretrain-data inspect`: what is in a .bin/.idx dataset, in numbers and in decoded text."""
from __future__ import annotations

import numpy as np

from .indexed import IndexedDataset


def length_histogram(lengths: np.ndarray, bins: int = 12, width: int = 40) -> list[str]:
    """Log-spaced histogram of document lengths as text rows."""
    if lengths.size == 0:
        return ["  (no documents)"]
    lo, hi = max(int(lengths.min()), 1), max(int(lengths.max()), 1)
    edges = np.unique(np.geomspace(lo, hi + 1, num=bins + 1).astype(np.int64))
    if edges.size < 2:
        edges = np.array([lo, hi + 1])
    counts, _ = np.histogram(np.maximum(lengths, 1), bins=edges)
    peak = max(int(counts.max()), 1)
    rows = []
    for a, b, n in zip(edges[:-1], edges[1:], counts):
        bar = "#" * int(round(width * n / peak))
        rows.append(f"  {a:>9,} - {b - 1:<9,} {n:>10,}  {bar}")
    return rows


def describe(prefix: str, tokenizer: str | None = None, decode: list[int] = (), bins: int = 12,
             max_chars: int = 1000) -> str:
    ds = IndexedDataset(prefix)  # verifies the pair; errors name the problem
    _, lengths = ds.document_token_bounds()
    lines = [
        f"dataset    {ds.prefix}",
        f"format     MMIDIDX v1, dtype {ds.dtype} ({ds.dtype.itemsize} B/token), index and .bin agree",
        f"documents  {ds.num_documents:,}",
        f"sequences  {len(ds):,}",
        f"tokens     {ds.num_tokens:,}",
    ]
    if lengths.size:
        q = np.percentile(lengths, [50, 90, 99])
        lines.append(
            f"doc length min {int(lengths.min()):,}  mean {lengths.mean():,.1f}  median {q[0]:,.0f}  "
            f"p90 {q[1]:,.0f}  p99 {q[2]:,.0f}  max {int(lengths.max()):,}"
        )
    lines.append("length histogram (tokens per document):")
    lines += length_histogram(lengths, bins)
    tok = None
    if tokenizer:
        from .tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        if ds.num_tokens and int(ds.tokens.max()) >= tok.vocab_size:
            lines.append(f"warning: ids up to {int(ds.tokens.max())} but the tokenizer has {tok.vocab_size}")
    starts, _ = ds.document_token_bounds()
    for i in decode:
        if not -ds.num_documents <= i < ds.num_documents:
            raise IndexError(f"document {i} out of range: the dataset has {ds.num_documents} documents")
        i %= ds.num_documents
        ids = np.asarray(ds.tokens[starts[i] : starts[i] + lengths[i]], dtype=np.int64).tolist()
        text = tok.decode(ids) if tok else " ".join(map(str, ids))
        more = f" ... [{len(text) - max_chars:,} more chars]" if len(text) > max_chars else ""
        lines.append(f"--- document {i} ({len(ids):,} tokens) ---")
        lines.append(text[:max_chars] + more)
    return "\n".join(lines)
