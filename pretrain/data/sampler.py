"""Global-batch sampler whose data does not depend on the data-parallel size.

Global batch g covers the global sample indices [consumed + g*G, consumed + (g+1)*G). Rank r of D
takes the contiguous slice [r*G/D, (r+1)*G/D) of it and splits that into micro batches of m. So:

* the union over ranks of a global batch is the same samples in the same order for any D and m;
* the position in the data is one number, the count of consumed samples: a run resumed from it
  sees exactly what the uninterrupted run would have, with any D, m or even a different G.
"""
from __future__ import annotations

import operator

from parallel.data_parallel import accumulation_steps


class GlobalBatchSampler:
    """Yields this rank's micro batches (lists of global sample indices), global batch by global batch.

    Use as `DataLoader(dataset, batch_sampler=sampler)`. Infinite unless `total_samples` is given,
    in which case it stops before a global batch that would go past it.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        total_samples: int | None = None,
    ):
        G, m, r, D, c = (
            _int("global_batch_size", global_batch_size), _int("micro_batch_size", micro_batch_size),
            _int("dp_rank", dp_rank), _int("dp_size", dp_size), _int("consumed_samples", consumed_samples),
        )
        if G < 1 or m < 1 or D < 1:
            raise ValueError(
                f"global_batch_size ({G}), micro_batch_size ({m}) and dp_size ({D}) must be positive"
            )
        if not 0 <= r < D:
            raise ValueError(f"dp_rank {r} is out of range for dp_size {D} (need 0 <= dp_rank < dp_size)")
        steps = accumulation_steps(G, m, D)
        if c < 0:
            raise ValueError(f"consumed_samples must be non-negative, got {c}")
        if total_samples is not None and _int("total_samples", total_samples) < c:
            raise ValueError(f"total_samples {total_samples} is less than consumed_samples {c}")
        self.global_batch_size, self.micro_batch_size = G, m
        self.dp_rank, self.dp_size = r, D
        self.consumed_samples = c
        self.total_samples = total_samples
        self.local_batch_size = G // D
        self.num_micro_batches = steps  # gradient-accumulation steps per optimizer step

    def micro_batches(self, g: int) -> list[list[int]]:
        """This rank's micro batches of global batch g (counted from consumed_samples)."""
        start = self.consumed_samples + g * self.global_batch_size + self.dp_rank * self.local_batch_size
        m = self.micro_batch_size
        return [list(range(start + k * m, start + (k + 1) * m)) for k in range(self.num_micro_batches)]

    def __iter__(self):
        g = 0
        while self.total_samples is None or (
            self.consumed_samples + (g + 1) * self.global_batch_size <= self.total_samples
        ):
            yield from self.micro_batches(g)
            g += 1

    def __len__(self) -> int:
        """Micro batches yielded in total (only with total_samples; the sampler is otherwise infinite)."""
        if self.total_samples is None:
            raise TypeError("an infinite GlobalBatchSampler (no total_samples) has no length")
        steps = (self.total_samples - self.consumed_samples) // self.global_batch_size
        return steps * self.num_micro_batches


def _int(name: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
