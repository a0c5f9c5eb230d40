"""kernels package of the recurrent-transformer pretraining system: ops with a plain reference and
the fast paths tested against it (kernels/<op>/reference.py beside the others), dispatched through
kernels/registry.py."""
from kernels.registry import describe_paths_used, force, paths_used, reset_paths_used

__all__ = ["describe_paths_used", "force", "paths_used", "reset_paths_used"]
