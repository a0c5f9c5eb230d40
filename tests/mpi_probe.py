"""Run by tests/test_mpi.py under `mpirun -np 2`: ranks come from Open MPI's environment and rank 0's
address from mpi4py (parallel.dist.detect_env); then a 3-step TP2 training run. Prints one JSON line
per rank: how it was started, its coordinates in the layout, and the run's losses."""
import json
import sys

if __name__ == "__main__":
    tmp, corpus = sys.argv[1], sys.argv[2]
    from parallel.dist import detect_env
    from parallel.mesh import layout
    from trainer_helpers import step_losses, train_run

    env = detect_env()
    train_run(tmp, corpus, "mpi-tp2", 3, ["train.compile=false", "parallel.tp=2"])
    lay = layout()
    print(json.dumps({"source": env.launcher, "rank": env.rank, "world": env.world_size, "tp_rank": lay.tp_rank,
                      "dp": lay.dp, "losses": step_losses(f"{tmp}/mpi-tp2")}), flush=True)
