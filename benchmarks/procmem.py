"""A process's memory from Linux /proc, for the benchmarks that report it.

VmHWM (the peak resident size) starts afresh at exec. ru_maxrss does not: a child inherits its parent's
peak across fork and exec, so a benchmark that measures in fresh processes reads VmHWM.
"""


def status_kib(key: str, pid: int | str = "self") -> int:
    """The /proc/<pid>/status field `key` (VmRSS: resident now, VmHWM: the peak) in KiB; 0 when absent.
    OSError when the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fresh_env(mmap_threshold: int | None = 65536) -> dict:
    """The environment of a measuring child: glibc malloc (freed memory leaves RSS, so a step's peak is
    its own), one arena, and by default a fixed mmap threshold (every block above it is mapped and
    unmapped on its own, so RSS follows use step after step: glibc's default threshold rises after the
    first large free, and the heap then keeps what a step freed, hiding the next steps' peaks)."""
    import os

    env = dict(os.environ, MALLOC_ARENA_MAX="1", PRETRAIN_MALLOC="system")
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    env.pop("LD_PRELOAD", None)
    env.pop("PRETRAIN_MALLOC_APPLIED", None)
    return env
