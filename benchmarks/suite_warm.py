"""The GPU suite's processes: one run under a time cap, or many at once (its warm-up phase, --warm-jobs N).

Why a warm-up phase: a compiled row's first step spends 30-90 s compiling (dynamo, AOT autograd and
inductor's lowering run on one CPU core while the GPU idles), so a part of ten rows spent most of its
minutes compiling, one row after another. The GPU machines have 16 cores. With --warm-jobs N the suite first
trains each row (and its Hugging Face twin) for one step, N runs at once, which fills inductor's on-disk
caches (FX graphs, AOT autograd graphs, Triton kernels); the timed runs then follow one at a time on a quiet
GPU and load their graphs from those caches (on a CPU, the tiny baseline's compile fell from 23.2 s to
2.7 s that way: 3 FX graph and 2 AOT autograd cache hits).

What keeps the timed figures honest:
- nothing else runs while a row is timed;
- each timed run is a fresh process, so the kernel registry measures its paths again, on the quiet GPU;
  where a choice differs from the warm-up's, the graph differs and that run compiles anew (slower, right);
- inductor's autotuned launch configurations (its `*.best_config` files), timed under contention in the
  warm-up, are deleted before the timed runs, which tune again;
- a run starts only while the planner's estimates of the runs on the GPU add up to less than `budget`
  (the planner overestimates: 29.6 GiB against 13.1 measured for baseline/s), and one run alone always may;
- the table's compile column gives both: the warm-up's first compile (contended, so an overestimate of a
  user's first run) and the timed run's from the caches.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Job:
    key: str
    cmd: list[str]
    log: Path
    cap: float  # seconds before it is stopped
    cwd: Path
    stop: Callable[[], bool] = lambda: False  # stop it now (its last timed step is recorded)
    env: dict = field(default_factory=dict)
    gib: float | None = None  # the planner's estimate of its GPU memory (None: not known: a share of the budget)


@dataclass
class Ended:
    how: str  # exit | cap | stop
    rc: int
    log: str
    wall_s: float


def run_many(jobs: list[Job], at_once: int = 1, budget_gib: float = float("inf"), poll_s: float = 0.5) -> dict:
    """Run `jobs` in their order, up to `at_once` at a time and within `budget_gib` of planned memory, each in a
    process group of its own with its output to its log; each ends by itself, at its cap or when its stop()
    says so (its group is then killed). {key: Ended}. On any exception (the suite's SIGTERM) every running
    group is killed."""
    pending, running, done = list(jobs), {}, {}
    need = lambda job: job.gib if job.gib is not None else budget_gib / max(1, at_once)  # noqa: E731
    try:
        while pending or running:
            while pending and len(running) < max(1, at_once):
                planned = sum(need(j) for j, _, _, _ in running.values())
                if running and planned + need(pending[0]) > budget_gib:
                    break  # waits for memory, in order
                job = pending.pop(0)
                log = open(job.log, "w")
                proc = subprocess.Popen(job.cmd, cwd=job.cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", **job.env})
                running[job.key] = (job, proc, log, time.perf_counter())
            for key, (job, proc, log, t0) in list(running.items()):
                wall = time.perf_counter() - t0
                how = ("exit" if proc.poll() is not None else "cap" if wall > job.cap else
                       "stop" if job.stop() else None)
                if how is None:
                    continue
                _end(proc, log, stacks=how == "cap")
                done[key] = Ended(how, proc.returncode, job.log.read_text(), wall)
                del running[key]
            if running:
                time.sleep(poll_s)
    finally:  # stopped, capped, or the suite itself ended (SIGTERM from `timeout`): the groups go too
        for _, proc, log, _ in running.values():
            _end(proc, log, stacks=True)
    return done


STACKS_S = 2.0  # how long a run stopped at its cap has to print its stacks


def _end(proc: subprocess.Popen, log, stacks: bool = False) -> None:
    """Kill the run's process group; with `stacks` (a cap, or the suite's own end) it first prints where it is
    (`pretrain train` prints every thread's stack on SIGUSR2: pretrain/cli.py), so a row that never finished
    compiling says which part of the compile held it."""
    if proc.poll() is None and stacks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STACKS_S)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def forget_autotuning(cache: Path) -> int:
    """Delete inductor's autotuned launch configurations under its cache folder (timed while other runs
    shared the GPU); the next run of each kernel tunes it again. How many were deleted."""
    n = 0
    for path in cache.rglob("*.best_config") if cache.is_dir() else ():
        path.unlink(missing_ok=True)
        n += 1
    return n


def compile_phases(log: str) -> str:
    """Where a run's compile time went: the compile line its trainer logged (pretrain/compile_report.py)."""
    phases = re.findall(r"^compile: [\d.]+ s by step \d+: (.*)", log, re.M)
    return phases[0].strip() if phases else ""


def first_compile(warm: Ended) -> dict:
    """A warm-up run's compile: seconds (its compile line's total, or an HF run's first step beyond a steady
    one) and phases; {} when it compiled nothing or failed."""
    total = re.findall(r"^compile: ([\d.]+) s by step", warm.log, re.M)
    hf = [ln for ln in warm.log.splitlines() if ln.startswith("HF_RESULT ")]
    seconds = float(total[0]) if total else json.loads(hf[-1][len("HF_RESULT "):]).get("compile_s") if hf else None
    if seconds is None:
        return {}
    return {"warm_compile_s": seconds, **({"compile_phases": compile_phases(warm.log)} if total else {})}


def inductor_cache() -> Path:
    """inductor's on-disk cache folder (its FX graphs, and by default Triton's kernels under it)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return Path(cache_dir())
    except Exception:  # noqa: BLE001 - an older torch: its default place
        import getpass
        import tempfile
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                    or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")


def compile_cache() -> str:
    """Whether inductor's and Triton's on-disk caches held anything when the suite started. A row that ran
    before on this machine (a second suite) loads its graphs from them, a re-run's compile time, lower than a
    user's first run; a row new to the machine compiles afresh: its graphs are not there, whatever else is."""
    inductor = inductor_cache()
    triton = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    files = {name: sum(1 for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
             for name, path in (("inductor", inductor), ("Triton", triton))}
    if not any(files.values()):
        return "compile caches cold (compile times are a first run's)"
    return ("compile caches warm (" + ", ".join(f"{name} {n:,} files" for name, n in files.items())
            + ": a row that ran before on this machine compiles from them, a re-run's time; a new one afresh)")
