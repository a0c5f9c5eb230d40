"""Run one test body on N gloo processes on the CPU (OLMo-core's pattern). The backend is always gloo:
no test runs these bodies on NCCL or a GPU.

    results = run_ranks(body, world_size=2, args=(x,))   # body(rank, world_size, *args) -> picklable

`body` must be a module-level function (processes are spawned). Each rank gets the torchrun-style
environment, so parallel.dist.detect_env/init_distributed see a real launcher; an exception on any
rank fails the test with that rank's traceback.
"""
import multiprocessing as mp
import os
import socket
import traceback


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen, so the kernel cannot hand
    out one port twice (closing each before the next is asked for can)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _child(body, rank, world_size, port, args, env, queue):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)  # N ranks share the 2 cores
        from parallel.dist import detect_env, init_distributed

        init_distributed(detect_env(), backend="gloo", timeout_s=float(env.get("TEST_DIST_TIMEOUT", 60)))
        queue.put((rank, "ok", body(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(body, world_size: int = 2, args=(), env=None, timeout: float = 180.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(body, r, world_size, port, tuple(args), dict(env or {}), queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
