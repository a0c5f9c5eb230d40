"""Run the process under a caching memory allocator (tcmalloc, else jemalloc) on Linux.

    from pretrain.malloc import use_caching_allocator
    use_caching_allocator()      # first thing in a CLI, before torch is imported: may exec() again

Why: on CPU, torch takes every tensor from glibc's malloc, which maps buffers over 32 MB straight
from the kernel and returns them on free. Each step's large activations and gradients are then new
memory, page-faulted in again (~60 ms per 170 MB on the reference machine). A caching allocator keeps
freed memory for the next step, as CUDA's allocator does on a GPU. Measured on the d=512 config of
benchmarks/bench_trainer.py: forward + backward ~15-20% faster; DeepSpeed ZeRO-1/2, which allocate
their gradient buckets and flat partitions afresh every step, went from +18-25% over the plain
trainer to under +10% (benchmarks/bench_parallel.py). torch's own CPU launcher
(torch.backends.xeon.run_cpu) preloads the same libraries for the same reason.

How: the library must be loaded before anything allocates, so the process re-executes itself once
with the library in LD_PRELOAD (same PID, same arguments, same open files). Child processes inherit it.

PRETRAIN_MALLOC chooses: `auto` (default: tcmalloc or jemalloc when installed, else the system's),
`system` (never preload), or a library path or name to preload. Install tcmalloc with
`apt-get install libtcmalloc-minimal4` (Debian/Ubuntu).
"""
from __future__ import annotations

import ctypes.util
import os
import sys

ENV = "PRETRAIN_MALLOC"
CANDIDATES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")  # names as ctypes.util.find_library takes them
_DONE = "PRETRAIN_MALLOC_APPLIED"  # set in the re-executed process: never exec twice


def find_caching_allocator() -> str | None:
    """The first installed caching allocator library (a soname the dynamic loader resolves), or None."""
    for name in CANDIDATES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def active_allocator() -> str:
    """What this process runs under, for the logs: the preloaded library or `system malloc`."""
    for lib in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        if any(name in os.path.basename(lib) for name in CANDIDATES):
            return os.path.basename(lib)
    return "system malloc"


def allocator_note() -> str:
    """One phrase for a run's start line: the allocator, and how to get a faster one if it is glibc's."""
    active = active_allocator()
    if active != "system malloc" or os.environ.get(ENV, "auto") == "system" or not sys.platform.startswith("linux"):
        return f"malloc: {active}"
    return "malloc: system (install libtcmalloc-minimal4 for ~15% faster CPU steps, see pretrain/malloc.py)"


def use_caching_allocator(argv: list[str] | None = None) -> None:
    """Re-execute this interpreter under a caching allocator unless PRETRAIN_MALLOC=system, one is
    already preloaded, none is installed, or this is not Linux. Returns only when it does not exec."""
    choice = os.environ.get(ENV, "auto").strip() or "auto"
    if choice == "system" or os.environ.get(_DONE) or not sys.platform.startswith("linux"):
        return
    if active_allocator() != "system malloc":
        return
    lib = find_caching_allocator() if choice == "auto" else choice
    if lib is None:
        return
    if choice != "auto" and os.sep in lib and not os.path.exists(lib):
        raise SystemExit(f"{ENV}={choice}: no such library")
    env = dict(os.environ, **{_DONE: "1"})
    env["LD_PRELOAD"] = ":".join(x for x in (lib, os.environ.get("LD_PRELOAD", "")) if x)
    # tcmalloc reports every allocation over 1 GB on stderr; a 1.6B model's flat buffers are larger
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    args = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args[1:]], env)
