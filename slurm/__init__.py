"""Slurm and MPI launch: sbatch scripts, the cluster profile they are rendered from, the in-job helper
(restart accounting, rendezvous port, run records) and sweeps. See the Slurm section of README.md."""
