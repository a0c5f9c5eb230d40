"""One entry per architecture: what the trainer, planner, generator and exporter may ask of it.

The rest of the code reads this registry and never branches on an architecture's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Support:
    """Parallel features an architecture supports; a refused feature carries its reason."""

    tp: bool = True
    sp: bool = True
    pp: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    reasons: dict[str, str] = field(default_factory=dict)  # feature -> why it is refused

    def refusal(self, parallel) -> str | None:
        """Why this architecture cannot run under `parallel` (a ParallelConfig), or None."""
        asks = [("tp", parallel.tp > 1 and not self.tp, f"parallel.tp={parallel.tp}"),
                ("sp", parallel.sp and not self.sp, "parallel.sp=true"),
                ("pp", parallel.pp > 1 and not self.pp, f"parallel.pp={parallel.pp}"),
                ("zero", parallel.zero_stage not in self.zero_stages, f"parallel.zero_stage={parallel.zero_stage}")]
        for feature, refused, setting in asks:
            if refused:
                return f"{setting} is not supported ({self.reasons.get(feature, 'see its registry entry')})"
        return None


@dataclass(frozen=True)
class ArchSpec:
    name: str
    config_cls: type  # a dataclass with validate()
    build: Callable[[Any], Any]  # config -> nn.Module, built through parallel.layers only
    flops_per_token: Callable[[Any, int], float]  # training FLOPs per token at sequence length T
    new_state: Callable[[Any, int], Any]  # (model, batch size) -> empty streaming cache
    step: Callable[[Any, Any, Any], tuple[Any, Any]]  # (model, tokens [B, n], state) -> (logits, state)
    supports: Support = Support()
    # model dimensions tensor parallelism splits: {"model.n_heads": 8, ...}; each must divide by parallel.tp
    tp_dims: Callable[[Any], dict[str, int]] | None = None
    activation_bytes: Callable[[Any, int, int, str], int] | None = None
    # Optional until the issue that needs them lands; validate() refuses a feature whose field is None.
    pipeline_split: Callable[[Any, int], list] | None = None
    recompute_units: Callable[[Any], list] | None = None
    export_adapter: Any | None = None


def count_parameters(model) -> dict[str, int]:
    """total / embedding / non_embedding parameter counts of a model (works on the meta device).

    Shared (tied) tensors count once; the token embedding and an untied output head count as
    embedding. Recognised by their facades' `counts_as_embedding`, so every architecture is counted the same way.
    """
    seen, total, embedding = set(), 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter reports 0 elements
            total += n
            if getattr(module, "counts_as_embedding", False):
                embedding += n
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"architecture {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def get_arch(name: str) -> ArchSpec:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"model.arch {name!r} is not a known architecture; known: {', '.join(sorted(_REGISTRY))}") from None


def all_archs() -> list[ArchSpec]:
    _load_builtin()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def _load_builtin() -> None:
    # Importing a model module registers it; done lazily so `pretrain --help` stays fast.
    from pretrain.models import baseline  # noqa: F401
