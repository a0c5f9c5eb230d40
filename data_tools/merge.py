"""Concatenate indexed datasets (same token dtype) into one, as megatron's merge_datasets.py does."""
from __future__ import annotations

import glob
import os

from .indexed import IndexedDataset, IndexedFormatError, IndexedWriter, bin_path, idx_path, strip_suffix


def resolve_inputs(inputs: list[str]) -> list[str]:
    """Prefixes in the given order; a folder stands for every dataset in it, sorted by name."""
    out = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(p[:-4] for p in glob.glob(os.path.join(item, "*.idx")))
            if not found:
                raise IndexedFormatError(f"{item}: folder holds no .idx files")
            out += found
        else:
            out.append(strip_suffix(item))
    return out


def merge(inputs: list[str], output_prefix: str, overwrite: bool = False, log=None) -> IndexedDataset:
    prefixes = resolve_inputs(inputs)
    output_prefix = strip_suffix(output_prefix)
    if any(os.path.realpath(idx_path(p)) == os.path.realpath(idx_path(output_prefix)) for p in prefixes):
        raise IndexedFormatError(f"{output_prefix}: the output is also an input")
    if not overwrite and (os.path.exists(idx_path(output_prefix)) or os.path.exists(bin_path(output_prefix))):
        raise IndexedFormatError(f"{output_prefix}.bin/.idx already exists; pass --overwrite to replace it")
    datasets = [IndexedDataset(p) for p in prefixes]  # validates every input before writing anything
    dtypes = {d.dtype for d in datasets}
    if len(dtypes) > 1:
        raise IndexedFormatError(
            "inputs have different token dtypes ("
            + ", ".join(f"{d.prefix}: {d.dtype}" for d in datasets)
            + "); re-preprocess them with one --dtype"
        )
    with IndexedWriter(output_prefix, datasets[0].dtype) as w:
        for d in datasets:
            w.append_dataset(d)
            if log:
                log(f"  + {d.prefix}: {d.num_documents:,} documents, {d.num_tokens:,} tokens")
    merged = IndexedDataset(output_prefix)
    if log:
        log(f"wrote {output_prefix}.bin/.idx: {merged.num_documents:,} documents, {merged.num_tokens:,} tokens")
    return merged
