"""A process's memory from Linux /proc, for the benchmarks that report it.

VmHWM (the peak resident size) starts afresh at exec. ru_maxrss does not: a child inherits its parent's
peak across fork and exec, so a benchmark that measures in fresh processes reads VmHWM.
"""


def status_kib(key: str, pid: int | str = "self") -> int:
    """The /proc/<pid>/status field `key` (VmRSS: resident now, VmHWM: the peak) in KiB; 0 when absent.
    OSError when the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)
