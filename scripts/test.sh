#!/usr/bin/env bash
# The README's test command, and what .ci/run calls: on a fresh machine it first installs what the
# suite needs, then runs every test that is neither `slow` nor `gpu`, on two workers. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh -m slow`, `bash scripts/test.sh tests/test_checkpoint.py`).
#
# What it installs, only when missing:
#   - Debian packages, through apt-get (needs root): openmpi-bin + libopenmpi-dev (the mpirun test,
#     mpi4py), slurmctld + slurmd + slurm-client + munge (the `slurm` tests start a two-node Slurm of
#     their own) and libtcmalloc-minimal4 (the caching allocator `pretrain train` runs under).
#     Without root or apt-get nothing is installed; the tests that need a missing package fail
#     naming it (none is skipped).
#   - .venv with CPU torch 2.13.0, this package and its test extras, DeepSpeed and mpi4py
#     (scripts/setup_env.sh; it only adds what is missing).
set -uo pipefail
cd "$(dirname "$0")/.."

# binary or library -> the Debian package that provides it
declare -A PACKAGE=([mpirun]=openmpi-bin [mpicc]=libopenmpi-dev [slurmctld]=slurmctld [slurmd]=slurmd
                    [sbatch]=slurm-client [munged]=munge [libtcmalloc_minimal]=libtcmalloc-minimal4)
missing=()
for need in mpirun mpicc slurmctld slurmd sbatch munged libtcmalloc_minimal; do
  if [ "$need" = libtcmalloc_minimal ]; then
    ldconfig -p 2>/dev/null | grep -q "$need" || missing+=("${PACKAGE[$need]}")
  elif ! command -v "$need" >/dev/null; then
    missing+=("${PACKAGE[$need]}")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[test] installing with apt-get: ${missing[*]} (log: /tmp/pretrain-apt.log)"
    t0=$SECONDS
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          "${missing[@]}") >/tmp/pretrain-apt.log 2>&1; then
      echo "[test] apt-get done in $((SECONDS - t0)) s"
    else
      echo "[test] apt-get failed (see /tmp/pretrain-apt.log): the tests that need ${missing[*]} will fail naming them"
    fi
  else
    echo "[test] not installed and not installable here (needs root and apt-get): ${missing[*]};" \
         "the tests that need them will fail naming them"
  fi
fi

bash scripts/setup_env.sh || exit 1
# Compiled-kernel caches shared by every test of the run (DeepSpeed's JIT comm op, inductor)
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
export DS_ACCELERATOR=cpu
# Two pytest-xdist workers, each taking whole files (--dist loadfile: a file's module fixtures, such as the
# two-node Slurm, start once), the longest files first (tests/conftest.py; --no-loadscope-reorder keeps that
# order). Much of the suite waits on the processes it starts, so a second worker puts the second core to
# work. PYTEST_WORKERS=0 runs everything in this process (pdb, -s).
# Each worker's torch (and every process it starts: `pretrain train`, torchrun ranks) gets its share of the
# cores: two workers of two OpenMP threads each on two cores oversubscribe them, and spinning OpenMP threads
# then slow the many small ops of tiny-model steps. Measured on 2 cores: the suite in 1,023 s with one
# thread each against 1,236 s with two, run back to back. An OMP_NUM_THREADS already set is kept.
WORKERS=${PYTEST_WORKERS:-2}
if [ "$WORKERS" -gt 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  CORES=$(nproc 2>/dev/null || echo 1)
  export OMP_NUM_THREADS=$(( CORES / WORKERS > 1 ? CORES / WORKERS : 1 ))
fi
.venv/bin/python -m pytest -m "not slow and not gpu" -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure"
  exit 1
fi
exit "$rc"
