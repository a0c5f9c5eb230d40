"""Process groups from torchrun, Slurm and MPI environments; collectives that fail say who and what."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from parallel.dist import CollectiveError, collective, detect_env, expand_hostlist


def test_hostlist_expansion():
    assert expand_hostlist("gpu[01-03,07],login-a[1-2],solo") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login-a1", "login-a2", "solo"]
    assert expand_hostlist("node7") == ["node7"]


def test_detect_torchrun_slurm_mpi_and_single():
    t = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.master_addr, t.master_port, t.launcher) == (
        3, 8, 1, 4, "n1", 1234, "torchrun")
    s = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"})
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.master_addr, s.launcher) == (
        5, 8, 1, 4, "gpu07", "slurm")
    again = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-08]",
                        "SLURM_JOB_ID": "4242"})
    assert again.master_port == s.master_port  # every rank derives the same port from the job id
    m = detect_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, mpi_address=("10.0.0.5", 4000))
    assert (m.rank, m.world_size, m.master_addr, m.master_port, m.launcher) == (1, 2, "10.0.0.5", 4000, "mpi")
    assert detect_env({}).launcher == "single" and detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


def _all_reduce_body(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    collective("all_reduce", dist.all_reduce, t)
    return t.item(), dist.get_world_size(), dist.get_backend()


def test_two_gloo_ranks_all_reduce():
    assert run_ranks(_all_reduce_body, 2) == [(3.0, 2, "gloo"), (3.0, 2, "gloo")]


def _stuck_peer_body(rank, world_size):
    if rank == 1:
        time.sleep(6)  # never joins the collective in time
        return "slept"
    try:
        collective("all_reduce(loss)", dist.all_reduce, torch.ones(1))
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_a_stuck_peer_is_reported_with_rank_and_operation():
    msg, _ = run_ranks(_stuck_peer_body, 2, env={"TEST_DIST_TIMEOUT": "3"})
    assert msg.startswith("rank 0: collective 'all_reduce(loss)' failed (") and "\n" not in msg


_EXIT_PROGRAM = r"""
import sys, tempfile, torch, torch.distributed as dist
from parallel.dist import exit_process
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # its reducer holds the group
model(torch.ones(2, 4)).sum().backward()
print("trained", end="")  # unflushed: exit_process flushes before leaving
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_exit_process_leaves_a_process_group_with_its_code_and_output(code):
    """A program holding a gloo group (DDP's reducer) leaves through exit_process: its exit code and
    its last output kept, no teardown of the group (which can deadlock or abort at exit)."""
    res = subprocess.run([sys.executable, "-c", _EXIT_PROGRAM, str(code)], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == code, res.stderr
    assert res.stdout == "trained"
    assert "terminate called" not in res.stderr


def test_on_a_gpu_the_group_is_nccl_with_gloo_beside_it_for_host_tensors(monkeypatch):
    """A group of NCCL alone refuses a CPU tensor ("No backend type associated with device type cpu"), and
    the stop and lock flags and object collectives are host tensors: on a GPU the default group is NCCL for
    CUDA tensors and gloo for CPU ones."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from parallel.dist import DistEnv, init_distributed

    made, devices, visible = [], [], [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible[0])
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    init_distributed(DistEnv(3, 4, 1, 2, "127.0.0.1", 29500, "torchrun"))
    assert devices == [1] and len(made) == 1
    assert BackendConfig(Backend(made[0])).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    visible[0] = 1  # srun --gpus-per-task: local rank 3 sees one GPU, its own, as device 0
    init_distributed(DistEnv(7, 8, 3, 4, "127.0.0.1", 29500, "slurm"))
    assert devices == [1, 0]


def test_the_gradient_norm_stays_on_the_gradients_device():
    """grad_square_sum builds its sums where the gradients are (meta here, CUDA on a GPU): no copy to the host,
    and a tensor NCCL can reduce over the tensor-parallel group."""
    from parallel.grads import grad_square_sum

    params = [torch.nn.Parameter(torch.zeros(3, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.ones(3, device="meta")
    assert grad_square_sum(params).device.type == "meta"
    cpu = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for i, p in enumerate(cpu):
        p.grad = torch.full((3,), float(i + 1))
    assert grad_square_sum(cpu).item() == 15.0  # 3 x 1 + 3 x 4
