"""Process groups from whatever started us: torchrun, Slurm's srun, or MPI (mpirun).

    env = detect_env()            # ranks, sizes, rendezvous address; reads only the environment
    init_distributed(env, timeout_s=600)

torchrun exports RANK / WORLD_SIZE / MASTER_ADDR; srun exports SLURM_PROCID / SLURM_NTASKS and a
node list whose first host serves the rendezvous; mpirun exports OMPI_COMM_WORLD_* (Open MPI) or
PMI_* / PMIX_* (MPICH, Intel MPI), and the rendezvous address comes from rank 0 via mpi4py when it
is not in the environment. torch has no MPI backend in its wheels, so MPI only discovers ranks and
gloo (CPU) or NCCL (GPU) carries the collectives.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass

from data_tools.errors import first_line


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"


def _int(env, *names, default=None):
    for n in names:
        if env.get(n, "") != "":
            try:
                return int(env[n])
            except ValueError:
                raise ValueError(f"environment variable {n}={env[n]!r} is not an integer") from None
    if default is None:
        raise ValueError(f"none of the environment variables {', '.join(names)} is set")
    return default


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login-a[1-2]") as host names, in order."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


def _slurm_tasks_on_node(env) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": tasks per node in node order.
    node = _int(env, "SLURM_NODEID", default=0)
    counts = []
    for item in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else _int(env, "SLURM_NTASKS_PER_NODE", default=1)


def default_port(seed: str) -> int:
    """A rendezvous port in 20000-39999 that every rank derives alike from the Slurm job id: consecutive
    jobs get different ports, so two jobs sharing a first node do not collide."""
    if seed.isdigit():
        return 20000 + int(seed) % 20000
    return 20000 + sum(ord(c) * 31**i for i, c in enumerate(seed)) % 20000


def detect_env(environ=None, mpi_address=None) -> DistEnv:
    """Rank layout from the launcher's environment variables; a single process when there is none.

    `mpi_address` (tests) replaces the mpi4py broadcast of rank 0's address.
    """
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return DistEnv(_int(env, "RANK"), world, _int(env, "LOCAL_RANK", default=0),
                       _int(env, "LOCAL_WORLD_SIZE", default=world), env.get("MASTER_ADDR", "127.0.0.1"),
                       _int(env, "MASTER_PORT", default=29500), "torchrun")
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1")
        return DistEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", default=0),
                       _slurm_tasks_on_node(env), env.get("MASTER_ADDR") or nodes[0],
                       _int(env, "MASTER_PORT", default=default_port(env.get("SLURM_JOB_ID", "0"))), "slurm")
    for rank_var, size_var, local_var, local_size_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if rank_var in env:
            rank, world = _int(env, rank_var), _int(env, size_var, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
            addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
            if not (addr and port):
                addr, port = mpi_address or _mpi_rendezvous()
            return DistEnv(rank, world, _int(env, local_var, default=0), _int(env, local_size_var, default=world),
                           addr, int(port), "mpi")
    return DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def _mpi_rendezvous() -> tuple[str, int]:
    """Rank 0's host and a free port on it, broadcast to every rank through MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError("started by mpirun but mpi4py is not installed (pip install mpi4py), and "
                           "MASTER_ADDR/MASTER_PORT are not set") from None
    comm = MPI.COMM_WORLD
    addr = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = (socket.gethostbyname(socket.gethostname()), s.getsockname()[1])
    return comm.bcast(addr, root=0)


GPU_BACKEND = "cpu:gloo,cuda:nccl"


def init_distributed(env: DistEnv, backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Create the default process group (no-op for a single process); gloo on CPU; on GPU NCCL for CUDA
    tensors with gloo beside it for the host's few (the stop and lock flags, object collectives): a group
    of NCCL alone refuses a CPU tensor, and putting a flag on the device would add a sync to every step."""
    import torch
    import torch.distributed as dist

    if env.world_size == 1 or dist.is_initialized():
        return env
    if backend is None:
        backend = GPU_BACKEND if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        # the rank's GPU among those it sees: a launcher that shows each task only its own GPU (Slurm's
        # --gpus-per-task, a per-rank CUDA_VISIBLE_DEVICES) makes that device 0 whatever the local rank
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                            world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return env


def exit_process(code: int, teardown_s: float = 30.0) -> None:
    """End a program that may hold a process group, compile workers or loader workers: flushed, then
    os._exit when a process group is initialized or the program failed (code != 0); otherwise the
    interpreter's own exit, ended by os._exit if it takes longer than `teardown_s`.

    Tearing a gloo group down is not safe at the end of a run: DDP's reducer frees the group while
    holding the GIL and joins its worker thread, which may still be freeing the last broadcast's
    tensors and so waits for the GIL (a deadlock, seen under load in the Slurm reference job); left
    to the interpreter's exit, the same threads abort the process ("terminate called without an
    active exception"), failing a finished job. A failed step can leave work that the interpreter's
    exit waits for: inductor's atexit handler waits up to 300 s for its compile-worker sidecar, and
    its compile thread pool's non-daemon threads are joined (a compiled run that failed on an H100
    printed its traceback and did not exit in 120 s). Everything the run writes is closed (and
    renamed into place) before this point, and worker processes end when their parent does, so
    skipping the destructors loses nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        mpi = sys.modules.get("mpi4py.MPI")  # mpirun fails a rank that exits without MPI_Finalize
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        os._exit(code)
    if code != 0:
        os._exit(code)
    import threading

    def overdue() -> None:  # a daemon thread runs while the exit joins threads and runs atexit handlers
        sys.stderr.write(f"exit: the interpreter's teardown took over {teardown_s:g} s; leaving without it\n")
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(teardown_s, overdue)
    timer.daemon = True
    timer.start()
    sys.exit(code)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; names the rank and the operation instead of hanging."""


def collective(name: str, fn, *args, **kwargs):
    """Run a torch.distributed collective; a timeout or a dead peer becomes one line naming it."""
    import torch.distributed as dist

    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(f"rank {rank}: collective {name!r} failed ({first_line(e)}); "
                              "another rank may have crashed or be stuck") from e


def rank_logger(run_dir: str | None, env: DistEnv, echo=print):
    """A log function: every rank appends to run_dir/logs/rank<r>.log; rank 0 also prints. The file
    is opened at the first message, so that a trainer refused the run directory's lock (which logs
    nothing before it) writes nothing there."""
    f = None

    def log(msg: str) -> None:
        nonlocal f
        if env.rank == 0:
            echo(msg)
        if run_dir and f is None:
            os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
            f = open(os.path.join(run_dir, "logs", f"rank{env.rank}.log"), "a", buffering=1)
        if f is not None:
            f.write(msg + "\n")

    return log
