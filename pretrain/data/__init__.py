"""Runtime training data: packed samples, blends, a DP-size-independent sampler, collate.

Everything here but `Batch`/`collate`/`Collator` is numpy-only; those live in `batch.py` and import
torch only when first used, so data tooling can use the datasets without torch installed.
"""
from pretrain.data.blend import BlendedDataset
from pretrain.data.packed import PackedDataset, parse_split, split_document_ranges
from pretrain.data.sampler import GlobalBatchSampler

__all__ = [
    "Batch", "BlendedDataset", "Collator", "GlobalBatchSampler", "PackedDataset", "collate",
    "parse_split", "split_document_ranges",
]


def __getattr__(name):
    if name in ("Batch", "collate", "Collator"):
        from pretrain.data import batch

        return getattr(batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
