"""What a model needs to know of pipeline stages, without the engine (model files import this; the
exported-folder loader must not pull in torch.distributed.checkpoint or megatron-core): a stage's units,
the placeholder of a module another stage runs, the mark of a weight tied across the first and last
stage, and the cost-balanced split. The engine is parallel/pipeline.py."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from parallel.mesh import layout

TIED = "_pipeline_tied"  # attribute of a parameter tied across the first and last stages: its canonical name


class NotOnThisStage(nn.Module):
    """The place of a module another pipeline stage runs (keeps the indices of a ModuleList)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module runs on another pipeline stage")


def mark_tied(p: nn.Parameter, canonical: str) -> None:
    """Mark a parameter that the first and the last stage each hold a copy of (their grads are summed);
    `canonical` is its name in the single-device model's optimizer state (a shared parameter's first
    name, e.g. the embedding's), under which both stages save and load its optimizer state."""
    setattr(p, TIED, canonical)


@dataclass(frozen=True)
class Stage:
    lo: int
    hi: int
    first: bool
    last: bool

    @classmethod
    def of(cls, boundaries: list[int]) -> "Stage":
        return cls.chunks(boundaries, 1)[0]

    @classmethod
    def chunks(cls, boundaries: list[int], virtual: int) -> list["Stage"]:
        """This rank's stages of a split into pp x virtual stages (the interleaved schedule's model
        chunks: stages rank, rank + pp, ...); first / last: the model's first and last stage."""
        lay = layout()
        n = lay.pp * virtual
        if len(boundaries) != n + 1:
            raise ValueError(f"a pipeline split into {n} stages has {n + 1} boundaries, got {boundaries}")
        return [cls(boundaries[k], boundaries[k + 1], k == 0, k == n - 1) for k in range(lay.pp_rank, n, lay.pp)]


def interleaving_accepts(pp: int, micro_batches: int) -> bool:
    """Whether megatron-core's interleaved schedule runs `micro_batches` per step over pp ranks here (the
    engine refuses otherwise, the planner skips such candidates): a multiple of pp, and at least 2 pp (at
    exactly pp every micro batch is in the warm-up, and megatron-core 0.16's exchange of activation
    shapes deadlocks over gloo)."""
    return micro_batches % pp == 0 and micro_batches >= 2 * pp


def units_of(chunks: list[Stage]) -> set[int]:
    """The pipeline units a rank holding these stages runs."""
    return {u for c in chunks for u in range(c.lo, c.hi)}


def balanced_split(costs: list[float], pp: int) -> list[int]:
    """Boundaries cutting units of the given costs into pp contiguous runs of at least one unit with the
    smallest largest run cost (ties: the earliest cuts); ValueError when there are fewer units than stages."""
    n = len(costs)
    if n < pp:
        raise ValueError(f"{n} pipeline units cannot make {pp} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest cost of cutting units [0, i) into k runs; exact DP (n and pp are small)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds, i = [n], n
    for k in range(pp, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]
