"""kernels package of the recurrent-transformer pretraining system: ops with a plain reference and
the fast paths tested against it (kernels/<op>/reference.py beside the others)."""


def paths_used() -> dict[str, list[str]]:
    """{op: the paths that ran}, for every op whose dispatcher has run since the process started (or
    its reset); what the trainer reports after its first step."""
    from kernels import attention

    used = {"attention": sorted(attention.paths_used())}
    return {op: paths for op, paths in used.items() if paths}


def reset_paths_used() -> None:
    """Forget which paths ran (a trainer reports those of its own run)."""
    from kernels import attention

    attention.reset_paths_used()
