"""Synthetic tasks: training data generated from a seed instead of read from .bin/.idx files.

    data.task: pointer_chasing          # "" (the default) = the file datasets of data.train
    data.task_params: {hops: 3, keys: 3, values: 10, answers_in_input: true}

A task registers one TaskSpec (its typed parameters, vocabulary size, sequence length, a sampler and
the names of the groups its accuracy is reported by). Sample i of the training stream is drawn from
a generator seeded by (data.seed, i), so, exactly like the file datasets, the data is a pure function
of the seed and the count of consumed samples: data-parallel ranks read different indices, and a
resumed run reads what the uninterrupted run would have. Validation draws from a fixed held-out seed,
the same for every run of a task, so evaluations of different runs are comparable.

A sample is the sequence itself (no shift): `targets[t]` is the label of position t (-1 = no loss
there) and `groups[t]` the accuracy group of that target (for pointer chasing, its level).
"""
from __future__ import annotations

import importlib
import pkgutil
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

_TRAIN_TAG, _HELD_OUT = 0x7A5C, 0x4E1D_0A7  # keep the training and validation streams disjoint


class Sample(NamedTuple):
    tokens: np.ndarray  # int64 [T] model input
    targets: np.ndarray  # int64 [T] label of each position, -1 where there is no loss
    groups: np.ndarray  # int64 [T] accuracy group of each target, -1 where there is no target


@dataclass(frozen=True)
class TaskSpec:
    name: str
    config_cls: type  # a dataclass of the task's parameters with validate() (data.task_params)
    vocab_size: Callable[[Any], int]  # tokens the task uses; model.vocab_size must be at least this
    seq_len: Callable[[Any], int]  # length of every sample; data.seq_len must equal it
    sample: Callable[[Any, np.random.Generator], Sample]
    group_names: Callable[[Any], list[str]]  # accuracy groups, reported as val_acc_<name>


_TASKS: dict[str, TaskSpec] = {}
_loaded = False


def register(spec: TaskSpec) -> TaskSpec:
    if spec.name in _TASKS:
        raise ValueError(f"task {spec.name!r} is registered twice")
    _TASKS[spec.name] = spec
    return spec


def _load_all() -> None:
    # Every module of this package registers its task on import; no shared list to edit.
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{mod.name}")


def task_names() -> list[str]:
    _load_all()
    return sorted(_TASKS)


def get_task(name: str) -> TaskSpec:
    _load_all()
    if name not in _TASKS:
        raise ValueError(f"data.task {name!r} is not a known task; choose one of {', '.join(task_names())}")
    return _TASKS[name]


def check_run(task: str, params, seq_len: int, vocab_size: int) -> None:
    """The task exists, its parameters are valid and the run fits it (data.seq_len, model.vocab_size);
    else ValueError in one sentence naming the field."""
    spec = get_task(task)
    if not isinstance(params, spec.config_cls):
        raise ValueError(f"data.task_params must hold the {task} parameters ({spec.config_cls.__name__}), "
                         f"got {params!r}")
    params.validate()
    if seq_len != spec.seq_len(params):
        raise ValueError(f"data.seq_len {seq_len} must equal the {task} sequence length {spec.seq_len(params)} "
                         f"for these data.task_params; set data.seq_len={spec.seq_len(params)}")
    if vocab_size < spec.vocab_size(params):
        raise ValueError(f"model.vocab_size {vocab_size} is smaller than the {task} vocabulary of "
                         f"{spec.vocab_size(params)} tokens; raise model.vocab_size to at least "
                         f"{spec.vocab_size(params)}")


def sample_rng(seed: int | None, index: int) -> np.random.Generator:
    """The generator of sample `index` of the training stream of `seed`, or of the held-out stream
    (seed None)."""
    entropy = [_HELD_OUT, index] if seed is None else [_TRAIN_TAG, seed, index]
    return np.random.default_rng(np.random.SeedSequence(entropy))


class TaskDataset:
    """Sample i of a task's stream, for any i >= 0 (infinite, like PackedDataset's epochs).

    `seed` None is the held-out (validation) stream. Picklable, for DataLoader workers."""

    def __init__(self, task: str, params, seed: int | None):
        self.task, self.params, self.seed = task, params, seed
        self.spec = get_task(task)

    def __len__(self) -> int:
        return 1 << 62  # fresh samples for as long as anyone asks

    def __getitem__(self, index: int) -> Sample:
        return self.spec.sample(self.params, sample_rng(self.seed, int(index)))

    def get_many(self, indices) -> list[Sample]:
        return [self[i] for i in indices]

    def __getstate__(self):  # the spec holds functions; workers look it up again
        return {"task": self.task, "params": self.params, "seed": self.seed}

    def __setstate__(self, state):
        self.__init__(state["task"], state["params"], state["seed"])


class TaskCollator:
    """Samples -> pretrain.data.Batch: one document per row, positions from 0, loss where targets >= 0."""

    def __call__(self, samples):
        import torch

        from pretrain.data.batch import Batch

        tokens = torch.from_numpy(np.stack([s.tokens for s in samples]).astype(np.int64))
        targets = torch.from_numpy(np.stack([s.targets for s in samples]).astype(np.int64))
        B, T = tokens.shape
        return Batch(tokens=tokens, labels=targets.clamp(min=0), loss_mask=targets >= 0,
                     doc_ids=torch.zeros(B, T, dtype=torch.int32),
                     positions=torch.arange(T, dtype=torch.int64).expand(B, T).contiguous())


def evaluate_accuracy(model, logits_fn, dataset: TaskDataset, num_samples: int, micro_batch: int, device,
                      autocast=None) -> dict:
    """Argmax accuracy at the targets of samples [0, num_samples), per group: {val_acc_<group>: float}.

    `logits_fn(model, tokens)` is the architecture's full-sequence logits (ArchSpec.logits). With
    several data-parallel ranks each takes every n-th micro batch and the counts are summed."""
    import torch

    from parallel.data_parallel import all_reduce_sum, dp_rank_and_size

    names = dataset.spec.group_names(dataset.params)
    rank, size = dp_rank_and_size()
    counts = torch.zeros(2, len(names), dtype=torch.float64, device=device)  # correct, total
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(rank * micro_batch, num_samples, micro_batch * size):
            samples = dataset.get_many(range(start, min(num_samples, start + micro_batch)))
            tokens = torch.from_numpy(np.stack([s.tokens for s in samples])).to(device)
            with autocast() if autocast is not None else nullcontext():
                predictions = logits_fn(model, tokens).argmax(-1).cpu().numpy()
            targets = np.stack([s.targets for s in samples])
            groups = np.stack([s.groups for s in samples])
            has = targets >= 0
            correct = np.bincount(groups[has], weights=(predictions[has] == targets[has]).astype(np.float64), minlength=len(names))
            total = np.bincount(groups[has], minlength=len(names))
            counts += torch.from_numpy(np.stack([correct, total]).astype(np.float64)).to(device)
    all_reduce_sum(counts, "task accuracy")
    model.train(was_training)
    correct, total = counts.tolist()
    return {f"val_acc_{n}": c / max(t, 1.0) for n, c, t in zip(names, correct, total)}


def accuracy_line(result: dict) -> str:
    """'accuracy L0 1.000 L1 0.740 ...' from the val_acc_* entries of an evaluation result."""
    parts = [f"{k[len('val_acc_'):]} {v:.3f}" for k, v in result.items() if k.startswith("val_acc_")]
    return "accuracy " + " ".join(parts) if parts else ""


__all__ = ["Sample", "TaskCollator", "TaskDataset", "TaskSpec", "accuracy_line", "check_run",
           "evaluate_accuracy", "get_task", "register", "sample_rng", "task_names"]
