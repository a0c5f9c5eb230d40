"""The training batch and its collate function: the only torch-using part of pretrain.data."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64 input ids
    labels: Tensor  # [B, T] int64 next-token targets
    loss_mask: Tensor  # [B, T] bool: False at padding, at targets that cross a document end, etc.
    doc_ids: Tensor  # [B, T] int32 document index within the sample (document masks, SPS resets)
    positions: Tensor  # [B, T] int64 positions, restarting at each document when configured

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))

    def pin_memory(self) -> "Batch":  # called by DataLoader(pin_memory=True)
        return Batch(*(getattr(self, f.name).pin_memory() for f in fields(self)))


def _stack(samples) -> tuple[np.ndarray, np.ndarray]:
    """A list of {"tokens", "doc_ids"} samples, or a (tokens, doc_ids) pair of [n, L+1] arrays."""
    if isinstance(samples, tuple) and len(samples) == 2 and not isinstance(samples[0], dict):
        tokens, doc_ids = samples
    else:
        if len(samples) == 0:
            raise ValueError("cannot collate an empty list of samples")
        tokens = np.stack([s["tokens"] for s in samples])
        doc_ids = np.stack([s["doc_ids"] for s in samples])
    tokens = np.asarray(tokens, dtype=np.int64)
    doc_ids = np.asarray(doc_ids, dtype=np.int32)
    if tokens.ndim != 2 or tokens.shape != doc_ids.shape or tokens.shape[1] < 2:
        raise ValueError(
            f"expected tokens and doc_ids of one shape [batch, seq_len + 1 >= 2], got "
            f"{tokens.shape} and {doc_ids.shape}"
        )
    return tokens, doc_ids


def collate(
    samples,
    eod_id: int | None,
    reset_positions: bool = True,
    mask_cross_document: bool = True,
    pad_id: int | None = None,
) -> Batch:
    """Stack packed samples (seq_len + 1 tokens each) into a shifted training Batch.

    With `mask_cross_document`, no loss at inputs that are the EOD token, nor where the target
    already belongs to the next document: that token is unpredictable from this document.
    `pad_id` (optional), for datasets that pad instead of packing: no loss where the input is padding
    (spec-001 §2.4: valid = idx != PAD and idx != EOS) nor where the target is (§8 point 2).
    """
    tokens, doc_ids = _stack(samples)
    inputs, labels, docs = tokens[:, :-1], tokens[:, 1:], doc_ids[:, :-1]
    B, T = inputs.shape
    loss_mask = np.ones((B, T), dtype=bool)
    if mask_cross_document:
        loss_mask &= docs == doc_ids[:, 1:]
        if eod_id is not None:
            loss_mask &= inputs != eod_id
    if pad_id is not None:
        loss_mask &= (inputs != pad_id) & (labels != pad_id)
    col = np.arange(T, dtype=np.int64)
    if reset_positions:
        # Index where the current document began: running max of the document-start columns.
        starts = np.zeros((B, T), dtype=np.int64)
        starts[:, 1:] = np.where(docs[:, 1:] != docs[:, :-1], col[1:], 0)
        positions = col - np.maximum.accumulate(starts, axis=1)
    else:
        positions = np.tile(col, (B, 1))
    return Batch(
        tokens=torch.from_numpy(np.ascontiguousarray(inputs)),
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
        loss_mask=torch.from_numpy(loss_mask),
        doc_ids=torch.from_numpy(np.ascontiguousarray(docs)),
        positions=torch.from_numpy(np.ascontiguousarray(positions)),
    )


class Collator:
    """Picklable `collate_fn` with fixed options, for DataLoader workers."""

    def __init__(self, eod_id: int | None, reset_positions: bool = True, mask_cross_document: bool = True,
                 pad_id: int | None = None):
        self.eod_id, self.reset_positions = eod_id, reset_positions
        self.mask_cross_document, self.pad_id = mask_cross_document, pad_id

    def __call__(self, samples) -> Batch:
        return collate(samples, self.eod_id, self.reset_positions, self.mask_cross_document, self.pad_id)
