"""From a DataConfig to the training and validation datasets, with the checks a run needs first.

With data.task set the datasets are a synthetic task's streams (pretrain/tasks): the training stream
seeded by data.seed, validation by the task's fixed held-out seed; no file is read."""
from __future__ import annotations

from data_tools.indexed import IndexedDataset
from pretrain.data.blend import BlendedDataset
from pretrain.data.packed import PackedDataset


def check_vocab(prefixes: list[str], vocab_size: int) -> None:
    """Refuse data whose token ids do not fit the model's embedding (an index error deep in a step
    otherwise, or silently wrong rows on some devices)."""
    for prefix in prefixes:
        top = IndexedDataset(prefix).max_token_id()
        if top >= vocab_size:
            raise ValueError(f"dataset {prefix} holds token id {top}, beyond model.vocab_size {vocab_size}; "
                             "tokenize with the model's tokenizer or raise model.vocab_size")


def check_internal_tokens(prefixes: list[str], internal: dict[str, int]) -> None:
    """Refuse data that holds a token id the architecture uses internally (SPS's <predict>): the model
    could not tell that token from its own slot. One scan per dataset, cached beside it."""
    for prefix in prefixes if internal else ():
        counts = IndexedDataset(prefix).token_counts(sorted(internal.values()))
        for name, token in internal.items():
            if counts[token]:
                raise ValueError(f"dataset {prefix} holds token id {token} ({counts[token]} times), which the model "
                                 f"reserves for {name}; tokenize with the model's tokenizer (which never emits it) "
                                 f"or give {name} another id")


def _packed(data, prefix: str, split: str, split_name: str) -> PackedDataset:
    return PackedDataset(prefix, data.seq_len, seed=data.seed, split=split, split_name=split_name,
                         cache_dir=data.cache_dir or None)


def _combine(parts: list[PackedDataset], weights: list[float]):
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(list(zip(weights or [p.split_tokens for p in parts], parts)))


def train_dataset(data):
    """The (possibly blended) training samples; blend weights default to each split's token count."""
    if data.task:
        from pretrain.tasks import TaskDataset

        return TaskDataset(data.task, data.task_params, data.seed)
    parts = [_packed(data, p, data.resolved_split(), "train") for p in data.train]
    return _combine(parts, list(data.train_weights))


def valid_parts(data) -> list[PackedDataset]:
    """The validation datasets: `data.valid`, else the split's valid share of each `data.train`."""
    if data.valid:
        return [_packed(data, p, "1", "train") for p in data.valid]
    try:
        return [_packed(data, p, data.resolved_split(), "valid") for p in data.train]
    except ValueError as e:
        raise ValueError(f"no validation data ({e}); set data.valid or give data.split a valid share") from None


def valid_dataset(data):
    """(dataset, number of distinct samples) for validation."""
    if data.task:
        from pretrain.tasks import TaskDataset

        held_out = TaskDataset(data.task, data.task_params, None)
        return held_out, len(held_out)
    parts = valid_parts(data)
    return _combine(parts, []), sum(len(p) for p in parts)
