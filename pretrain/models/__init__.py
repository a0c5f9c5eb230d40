"""Architectures and their registry. `get_arch(name)` returns an ArchSpec; models register on import."""
from pretrain.models.registry import (ArchSpec, Recompute, Support, all_archs, count_parameters, get_arch, meta_model,
                                     register, weight_shapes)

__all__ = ["ArchSpec", "Recompute", "Support", "all_archs", "count_parameters", "get_arch", "meta_model", "register",
           "weight_shapes"]
